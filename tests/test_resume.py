"""A resumed tuning run is the run it resumes: after interruptions (exceptions in-process for every searcher,
real SIGKILLs of a tuning process at three points) the rerun with the same seed ends with the same per-task
trial allocation, the same best configs and the same records as an uninterrupted run.  Fake measurers (a
latency that is a fixed function of the config), so only the bookkeeping is under test."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import pytest

from fake_measurer import FakeMeasurer as BaseFake
from kerneltune.records import RecordLog
from kerneltune.searchers import SEARCHERS
from kerneltune.targets.parse import parse_target
from kerneltune.task import make_task
from kerneltune.tune_tasks import TuningRun, TuningTask, tune_tasks

SPEC = parse_target("llvm", 2)
TASKS = [TuningTask(make_task("matmul", "16,64,64"), 1, 0), TuningTask(make_task("matmul", "32,64,128"), 6, 1),
         TuningTask(make_task("matmul", "64,32,64"), 3, 2), TuningTask(make_task("matmul", "8,128,32"), 2, 3)]


class Interrupted(BaseException):
    """Stands for a kill: not an Exception, so the tuning loop's crash handling does not swallow it."""


class FakeMeasurer(BaseFake):
    """Default config 1 ms; other configs 0.5-1.5 ms, a fixed function of (task, config)."""

    lo = 0.5
    delay = 0.0          # seconds per measure call (gives a killer time to strike mid-run)
    interrupt_after = None   # raise Interrupted on this measure call (in-process "kill")
    calls = 0

    def key(self, task, config) -> str:
        return repr((task.key, config))

    def seen(self, task, configs):
        FakeMeasurer.calls += 1
        if FakeMeasurer.interrupt_after is not None and FakeMeasurer.calls >= FakeMeasurer.interrupt_after:
            raise Interrupted()
        time.sleep(FakeMeasurer.delay)


def run(records, searcher="opevo", trials=80):
    return tune_tasks(TASKS, TuningRun(SPEC, trials, RecordLog(records), "gradient", searcher, seed=3, progress=False),
                      FakeMeasurer)


def summary(res) -> dict:
    return {"trials": {t.key: t.trials for t in res.tasks},
            "best": {k: [list(v) if isinstance(v, tuple) else v for v in c] for k, c in res.best_configs.items()},
            "objective": res.objective[-1][1], "spent": res.trials}


def trial_lines(path) -> list[tuple]:
    return [(r.task, json.dumps(r.config, sort_keys=True), r.gflops) for r in RecordLog(path).load()]


@pytest.fixture(autouse=True)
def reset_fake():
    FakeMeasurer.delay, FakeMeasurer.interrupt_after, FakeMeasurer.calls = 0.0, None, 0
    yield
    FakeMeasurer.delay, FakeMeasurer.interrupt_after, FakeMeasurer.calls = 0.0, None, 0


@pytest.mark.parametrize("searcher", sorted(SEARCHERS))
def test_interrupted_runs_resume_to_the_uninterrupted_result(tmp_path, searcher):
    """Every searcher: interrupted at three points (round 0 of the defaults, early, late), resumed each time."""
    ref = summary(run(tmp_path / "ref.jsonl", searcher))
    assert sum(ref["trials"].values()) == 80 and len(set(ref["trials"].values())) > 1  # uneven: the scheduler chose
    assert ref["best"], "some tuned config beat a default"
    path = tmp_path / "resumed.jsonl"
    for calls in (3, 5, 4):  # the 3rd, 5th, 4th measure call of each run: after 2, 6 and 9 of ~14 in all
        FakeMeasurer.calls, FakeMeasurer.interrupt_after = 0, calls
        with pytest.raises(Interrupted):
            run(path, searcher)
    FakeMeasurer.interrupt_after = None
    assert summary(run(path, searcher)) == ref
    assert trial_lines(path) == trial_lines(tmp_path / "ref.jsonl")  # nothing measured twice, nothing lost


def _child(records: str, delay: float, out: str) -> None:
    FakeMeasurer.delay = delay
    res = run(records)
    with open(out, "w") as fh:
        json.dump(summary(res), fh)


def _lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_at_three_points_then_resume_equals_uninterrupted(tmp_path):
    """Real processes killed with SIGKILL while they tune (forked from this one: no TVM import per process)."""
    ref = summary(run(tmp_path / "ref.jsonl"))
    path, out = tmp_path / "killed.jsonl", tmp_path / "out.json"
    ctx = mp.get_context("fork")
    for at in (2, 30, 60):  # during round 0 (4 defaults), early in the scheduled rounds, late
        proc = ctx.Process(target=_child, args=(str(path), 0.05, str(out)))
        proc.start()
        deadline = time.time() + 60
        while _lines(path) < at and proc.is_alive() and time.time() < deadline:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL and not out.exists(), "the run finished before the kill"
        assert at <= _lines(path) < 80
    proc = ctx.Process(target=_child, args=(str(path), 0.0, str(out)))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(ref))
    assert trial_lines(path) == trial_lines(tmp_path / "ref.jsonl")
