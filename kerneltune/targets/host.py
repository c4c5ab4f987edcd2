"""This machine's CPU as LLVM sees it, and what a target's CPU offers the templates: the host CPU and
triple, its name, the cores this process may use, a target's vector width
and registers, the features an llvm target uses that this CPU lacks, the architecture family of a triple."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

# TVM is imported inside the functions that need it (see kerneltune.targets).
if TYPE_CHECKING:
    import tvm


def host_cpu() -> str:
    """The host CPU name as LLVM knows it (``znver5``, ``skylake-avx512``...), ``generic`` if unknown."""
    from tvm.target import codegen

    cpu = str(codegen.llvm_get_system_cpu())
    return cpu if cpu and codegen.llvm_is_valid_cpu(cpu, "") else "generic"


def _cpuinfo(key: str) -> str:
    """The value of the first ``key`` line of /proc/cpuinfo ("" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def host_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo ("" elsewhere): benchmark JSON records it, because the
    same numbers mean different things on a Zen 4 and a Zen 5 (their FMA peaks differ ~2x)."""
    return _cpuinfo("model name")


def cpu_flags() -> set[str]:
    """The feature flags the kernel reports for this CPU (/proc/cpuinfo; empty elsewhere): what the machine has,
    whatever CPUID a process is shown (bench/isa_mask.py hides some)."""
    return set(_cpuinfo("flags").split())


def default_threads() -> int:
    """Cores this process may use (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def llvm_target(threads: int | None = None) -> "tvm.target.Target":
    """LLVM target for this machine's CPU: ``mcpu`` from LLVM's host detection (without it LLVM generates
    baseline x86-64 code: no AVX, no FMA, 4x fewer FLOPs per instruction) and ``threads`` cores."""
    import tvm

    return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "num-cores": int(threads or default_threads())})


def num_cores(target: "tvm.target.Target", default: int = 1) -> int:
    """The target's thread count, its ``num-cores`` (``default`` when unset): the one place it is read, so
    the threads a build runs with are the target's wherever they are asked for.  Callers differ only in
    what an unset count means to them (1: a schedule that parallelizes nothing; 0: "ask the machine")."""
    return int(target.attrs["num-cores"]) if "num-cores" in target.attrs else default


def vector_bits(target: "tvm.target.Target") -> int:
    """Width of the target's widest vector register: 512 with AVX-512, 256 with AVX2, else 128.  Follows the
    target's ``mcpu``/``mattr``: a bare ``llvm`` target emits SSE2 code only."""
    from tvm.target import codegen

    if codegen.target_has_features("avx512f", target):
        return 512
    if codegen.target_has_features("avx2", target):
        return 256
    return 128


def vector_registers(target: "tvm.target.Target") -> int:
    """Architectural vector registers: 32 with AVX-512 (zmm0-31), 16 with AVX2/SSE (ymm/xmm0-15).  The
    templates size their register tiles by it: a tile of accumulators for 32 registers spills on 16."""
    return 32 if vector_bits(target) == 512 else 16


def vector_lanes(target: "tvm.target.Target", dtype: str) -> int:
    """Lanes of ``dtype`` in the target's widest vector register."""
    import tvm

    return max(1, vector_bits(target) // tvm.DataType(dtype).bits)


def arch_of(triple: str) -> str:
    """The CPU architecture family of an LLVM triple (``armv7a-linux-gnueabihf`` -> ``arm``)."""
    arch = triple.split("-", 1)[0].lower()
    if arch in ("arm64", "aarch64"):
        return "aarch64"
    if arch.startswith(("arm", "thumb")):
        return "arm"
    if arch in ("amd64", "x86_64"):
        return "x86_64"
    return arch


def host_arch() -> str:
    """This machine's CPU architecture family (``x86_64``, ``aarch64``...)."""
    return arch_of(platform.machine())


def host_triple() -> str:
    """LLVM's triple for this machine."""
    from tvm.target import codegen

    return str(codegen.llvm_get_system_triple())


# LLVM "features" that only tune code generation (no instruction needs them): a haswell target on a Zen
# differs in these, yet runs.
_TUNING_FEATURES = ("fast-", "faster-", "slow-", "false-deps", "no-bypass", "prefer-", "tuning-", "ermsb", "fsrm",
                    "idiv", "lea-", "pad-short", "macrofusion", "branchfusion", "use-", "allow-", "avoid-",
                    "sbb-dep", "branch-hint", "fast")


# str(target) -> runs_here's answer: asking LLVM for both CPUs' features takes ~0.6 ms, and every default config
# asks (the calibrated rows tile, the cache budgets), thousands of times in a tuning run
_RUNS_HERE: dict[str, bool] = {}


def runs_here(target: "tvm.target.Target") -> bool:
    """Whether code for ``target`` runs on this machine: an llvm target for this architecture whose features
    this CPU has (a cross build or an ``-mcpu`` of a newer CPU does not)."""
    key = str(target)
    if key not in _RUNS_HERE:
        _RUNS_HERE[key] = (str(target.kind.name) == "llvm" and "mtriple" not in target.attrs
                           and not missing_cpu_features(target))
    return _RUNS_HERE[key]


def missing_cpu_features(target: "tvm.target.Target") -> list[str]:
    """Instruction-set features an llvm target for this architecture uses that this CPU lacks (its code
    would die of SIGILL here)."""
    from tvm.target import codegen

    return sorted(f for f in codegen.llvm_get_cpu_features(target) - codegen.llvm_get_cpu_features(llvm_target(1))
                  if not f.startswith(_TUNING_FEATURES))
