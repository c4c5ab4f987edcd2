"""The per-CPU calibration of the matmul template's rows tile: measured once, cached, read back; a target this
machine cannot run gets the static choice without measuring."""
from __future__ import annotations

import tvm

from kerneltune import calibrate
from kerneltune.targets import llvm_target


def test_the_rows_tile_is_measured_once_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_MODEL_CACHE", str(tmp_path))
    calibrate._measured_row_repeat.cache_clear()
    calls = []
    real = calibrate._measure
    monkeypatch.setattr(calibrate, "_measure", lambda *a: calls.append(a) or real(*a))
    target = llvm_target(2)
    first = calibrate.row_repeat(target)
    assert first in calibrate.ROW_REPEATS and len(calls) == 1
    calibrate._measured_row_repeat.cache_clear()  # a new process: the file answers
    assert calibrate.row_repeat(target) == first and len(calls) == 1
    assert list(tmp_path.glob("calibration-*.json"))
    calibrate._measured_row_repeat.cache_clear()


def test_a_target_that_cannot_run_here_gets_the_static_choice(monkeypatch):
    monkeypatch.setattr(calibrate, "_measure", lambda *a: (_ for _ in ()).throw(AssertionError("measured")))
    cross = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"})
    assert calibrate.row_repeat(cross) == calibrate.STATIC_ROW_REPEAT
