"""bench/isa_mask.py: a process run under it sees an AVX2 CPU (the peers of an x86-64-v3 build), and a real
crash in it still reaches the program's own handler."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kerneltune.targets.host import cpu_flags

BENCH = Path(__file__).resolve().parents[1] / "bench"
# bench/ is a folder of scripts, not on sys.path: loaded by file, so its names (coverage, dynamic, ...) shadow
# nothing in this process
_spec = importlib.util.spec_from_file_location("isa_mask", BENCH / "isa_mask.py")
isa_mask = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(isa_mask)


def _library(tmp_path) -> Path:
    flags = cpu_flags()
    if not flags & {"avx512f", "avx512_vnni", "avx_vnni"}:
        pytest.skip("this CPU has nothing above AVX2 to hold back")
    try:
        return isa_mask.library(tmp_path)
    except RuntimeError as exc:  # no C compiler, or no CPUID faulting in this kernel or VM
        pytest.skip(str(exc))


def _run(code: str, lib: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LD_PRELOAD": str(lib), "PYTHONPATH": str(BENCH)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_process_under_the_mask_sees_avx2_and_nothing_above(tmp_path):
    lib = _library(tmp_path)
    out = _run("from numpy._core._multiarray_umath import __cpu_features__ as f\n"
               "import isa_mask\n"
               "print(f['AVX2'], f['FMA3'], f['AVX512F'], f['AVX512VNNI'], isa_mask.held_isa())", lib)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False", "False", "avx2"]
    assert isa_mask.held_isa() is None  # this process is not held


def test_a_real_fault_under_the_mask_still_reaches_the_programs_handler(tmp_path):
    """Python's faulthandler installs its SIGSEGV handler after the mask's: the mask keeps its own first and
    passes every fault that is not a CPUID on, so the crash is reported and the process dies of it."""
    lib = _library(tmp_path)
    out = _run("import faulthandler, ctypes\nfaulthandler.enable()\nctypes.string_at(0)", lib)
    assert out.returncode == -11 and "Fatal Python error: Segmentation fault" in out.stderr, out
