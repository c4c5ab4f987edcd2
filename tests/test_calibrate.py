"""The per-CPU calibration of template defaults (the matmul rows tile): measured once, cached, read back; a
target this machine cannot run gets the static choice without measuring."""
from __future__ import annotations

import tvm

from kerneltune import calibrate
from kerneltune.targets.host import llvm_target
from kerneltune.templates import cpu


def test_the_rows_tile_is_measured_once_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "_VALUES", {})
    calls = []

    def measure(target):
        calls.append(target)
        return cpu.time_row_repeats(target)

    target = llvm_target(2)
    first = calibrate.calibrated("matmul_row_repeat", target, cpu.STATIC_ROW_REPEAT, measure)
    assert first in cpu.ROW_REPEATS and len(calls) == 1
    monkeypatch.setattr(calibrate, "_VALUES", {})  # a new process: the file answers
    assert calibrate.calibrated("matmul_row_repeat", target, cpu.STATIC_ROW_REPEAT, measure) == first
    assert len(calls) == 1 and list(tmp_path.glob("calibration-*.json"))


def test_a_target_that_cannot_run_here_gets_the_static_choice():
    def measure(target):
        raise AssertionError("measured a target that cannot run here")

    cross = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"})
    assert calibrate.calibrated("matmul_row_repeat", cross, cpu.STATIC_ROW_REPEAT, measure) == cpu.STATIC_ROW_REPEAT
