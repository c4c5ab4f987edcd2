"""A run under a resource limit of its process (``ulimit -v``, ``ulimit -f``) ends in one line naming the
limit, exit 2, and the previous build in DIR kept — not an internal error from wherever TVM, LLVM or protobuf
first failed to allocate or write."""
from __future__ import annotations

import errno
import json
import resource
import subprocess
import sys

import onnx
import pytest

from graphopt import rlimits
from models.mlp import build_mlp

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="rlimits and /proc/self/status are Linux's")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    work = tmp_path_factory.mktemp("rlimits")
    path = work / "mlp.onnx"
    onnx.save(build_mlp(batch=8, sizes=(256, 512, 10)), str(path))  # 0.55 MB of weights
    return path


def _run(argv: list[str], limit: int, value: int, timeout: int = 300) -> subprocess.CompletedProcess:
    def set_limit():
        resource.setrlimit(limit, (value, resource.getrlimit(limit)[1]))

    fn = {"optimize-model": "optimize_model_main", "run-model": "run_model_main"}[argv[0]]
    return subprocess.run([sys.executable, "-c", f"import sys; from pipeline.cli import {fn}; sys.exit({fn}())",
                           *argv[1:]], capture_output=True, text=True, timeout=timeout, preexec_fn=set_limit)


def _build(model, out, limit=resource.RLIMIT_CORE, value=0):
    return _run(["optimize-model", str(model), "--target", "llvm", "-o", str(out), "--skip-graph", "--skip-tune",
                 "--threads", "2", "-q"], limit, value)


def _one_line(proc, *words):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-1500:])
    assert all(w in lines[0] for w in words), lines[0]


def test_file_size_limits_refuse_up_front_or_at_the_write_and_keep_the_previous_build(model, tmp_path):
    out = tmp_path / "out"
    assert _build(model, out).returncode == 0
    before = (out / "report.json").read_bytes()
    _one_line(_build(model, out, resource.RLIMIT_FSIZE, 64 * 1024), "ulimit -f", "unlimited")  # < the weights
    size = (out / "model.so").stat().st_size
    weights = onnx.load(str(model)).ByteSize()
    assert weights < size  # a limit between the two passes the up-front check and fails at model.so's write
    _one_line(_build(model, out, resource.RLIMIT_FSIZE, (weights + size) // 2), "ulimit -f", "size limit")
    assert (out / "report.json").read_bytes() == before and (out / "model.so").stat().st_size == size


def test_an_address_space_limit_below_a_build_is_refused_up_front(model, tmp_path):
    _one_line(_build(model, tmp_path / "out", resource.RLIMIT_AS, rlimits.BUILD_ADDRESS_SPACE - 2**26),
              "ulimit -v", "address space")
    assert not (tmp_path / "out" / "report.json").exists()


def test_run_model_out_of_address_space_is_one_line(model, tmp_path):
    out = tmp_path / "out"
    assert _build(model, out).returncode == 0
    _one_line(_run(["run-model", str(out)], resource.RLIMIT_AS, 2**30 - 2**27), "ulimit -v")


def test_explain_names_the_limit_that_accounts_for_an_error(monkeypatch):
    limits = {"RLIMIT_AS": None, "RLIMIT_FSIZE": None}
    monkeypatch.setattr(rlimits.Limit, "soft", lambda self: limits[self.name])
    monkeypatch.setattr(rlimits, "vm_peak", lambda: 3 * 2**30)
    too_large = OSError(errno.EFBIG, "File too large")
    assert rlimits.explain(too_large) is None and rlimits.explain(AttributeError("x")) is None  # no limit set
    limits["RLIMIT_FSIZE"] = 2**20
    assert "ulimit -f" in rlimits.explain(too_large) and "ulimit -f" in rlimits.explain(RuntimeError("LLVM: File too large"))
    limits["RLIMIT_AS"] = 2**32  # the peak is 3 of the 4 GB: not close enough to blame the limit
    assert rlimits.explain(AttributeError("x")) is None and "ulimit -v" in rlimits.explain(MemoryError())
    limits["RLIMIT_AS"] = 3 * 2**30 + 2**20
    assert "ulimit -v" in rlimits.explain(AttributeError("module has no attribute 'RegisterOpAttr'"))
