"""Stopping tuning before its budget (issue 43): ``--early-stop N`` ends a task after N trials without a gain
beyond noise and the scheduler hands its trials to the others; ``--timeout`` ends the run with the best so
far; the reason is recorded; bad values are refused in one line.  Fake measurers (a latency that is a fixed
function of the config), so no kernel is compiled."""
from __future__ import annotations

import logging
import time

import pytest

from fake_measurer import FakeMeasurer
from graphopt.errors import UserError
from kerneltune import templates
from kerneltune.records import RecordLog
from kerneltune.scheduler import TaskInfo, make_scheduler
from kerneltune.searchers import make_searcher
from kerneltune.stopping import Deadline, Patience, StopReason, StopRule
from kerneltune.targets.parse import parse_target
from kerneltune.task import make_task
from kerneltune.tune import TaskRecords, TaskTuner, run_task
from kerneltune.tune_tasks import TuningRun, TuningTask, tune_tasks

SPEC = parse_target("llvm", 2)
FLAT, STEEP = make_task("matmul", "16,64,64"), make_task("matmul", "32,64,128")


class Plateau(FakeMeasurer):
    """FLAT's every config takes 1 ms, its default included (nothing to gain); STEEP's each new config is 5%
    faster than the one before (it never stops improving)."""

    def __init__(self, target, rpc):
        super().__init__(target, rpc)
        self.steep = 1e-3

    def latency(self, task, config, default):
        if task.key == FLAT.key:
            return 1e-3
        self.steep *= 0.95
        return self.steep


class AllFlat(FakeMeasurer):
    def latency(self, task, config, default):
        return 1e-3


class Slow(FakeMeasurer):
    """Each measure call takes 50 ms."""

    def seen(self, task, configs):
        time.sleep(0.05)


def test_patience_counts_trials_without_a_gain_beyond_noise():
    p = Patience(3, noise=0.01)
    for lat in (1.0, 0.995, None, 1.2):  # the first sets the best; a 0.5% gain and a failure do not count
        p.observe(lat)
    assert p.flat == 3 and p.stopped and p.best_s == 0.995
    p = Patience(3)
    for lat in (1.0, 1.0, 1.0, 0.9):  # a real gain resets the count
        p.observe(lat)
    assert p.flat == 0 and not p.stopped
    assert not Patience(None).stopped


def test_one_task_stops_after_n_trials_without_a_gain():
    space = templates.space_for(FLAT, SPEC.target)
    default = templates.default_config(FLAT, SPEC.target)
    m = AllFlat(SPEC.target, None)
    tuner = TaskTuner(space, make_searcher("random", space, 0, batch_size=1), lambda cs: m.measure(FLAT, cs),
                      TaskRecords(FLAT.key, str(SPEC.target)), stop=StopRule(early_stop=5))
    res = run_task(tuner, 100, warm_start=default, progress=False)
    assert res.trials == 1 + 5 and res.early_stopped and res.stop_reason is StopReason.EARLY_STOP


def test_an_early_stopped_task_gives_its_trials_to_the_others(tmp_path):
    tasks = [TuningTask(FLAT, weight=12, index=0), TuningTask(STEEP, weight=1, index=1)]
    run = TuningRun(SPEC, 64, RecordLog(tmp_path / "r.jsonl"), "gradient", "random", progress=False,
                    stop=StopRule(early_stop=4))
    res = tune_tasks(tasks, run, Plateau)
    flat, steep = sorted(res.tasks, key=lambda t: t.index)
    # FLAT weighs 12 times more, so the scheduler favours it; stopped after its default and one batch (8 >= 4
    # trials without a gain), everything else goes to STEEP and the budget is spent whole.
    assert flat.early_stopped and flat.trials == 1 + 8 and not steep.early_stopped
    assert res.trials == 64 and steep.trials == 64 - flat.trials and res.stop_reason is StopReason.BUDGET
    assert steep.best_ms < steep.default_ms and FLAT.key not in res.best_configs


def test_the_run_ends_when_every_task_stopped_improving(tmp_path):
    tasks = [TuningTask(FLAT, 1, 0), TuningTask(STEEP, 1, 1)]
    run = TuningRun(SPEC, 1000, RecordLog(tmp_path / "r.jsonl"), "round-robin", "random", progress=False,
                    stop=StopRule(early_stop=8))
    res = tune_tasks(tasks, run, AllFlat)
    assert res.stop_reason is StopReason.EARLY_STOP and res.trials == 2 * (1 + 8)
    assert all(t.early_stopped for t in res.tasks) and res.best_configs == {}


def test_the_timeout_ends_the_run_with_the_best_so_far(tmp_path, caplog):
    from pipeline.tuning import stop_fields, tune_model

    class Fused:  # what tune_model reads of a pipeline.partition.FusedTask
        def __init__(self, task, index):
            self.task, self.weight, self.index = task, 1, index
            self.scheduled_task = task  # a static kernel: the task itself

    run = TuningRun(SPEC, 10_000, RecordLog(tmp_path / "r.jsonl"), "gradient", "random", progress=False,
                    stop=StopRule(timeout_s=0.3))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pipeline.tuning"):
        res = tune_model([Fused(FLAT, 0), Fused(STEEP, 1)], run, Slow)
    assert time.monotonic() - t0 < 2.0
    assert res.stop_reason is StopReason.TIMEOUT and 2 <= res.trials < 10_000
    assert all(t.default_ms == 1.0 for t in res.tasks) and res.best_configs  # measured trials are kept and used
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == res.trials
    notes = [r.getMessage() for r in caplog.records if "--timeout" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("note: tuning stopped at the --timeout of 0.3 s after ")
    assert stop_fields(res) == {"stop_reason": "timeout", "timeout_s": 0.3, "early_stop": None, "early_stopped": []}


def test_a_deadline_is_checked_against_its_clock():
    now = [100.0]
    deadline = StopRule(timeout_s=5).deadline(lambda: now[0])
    assert not deadline.passed
    now[0] = 105.0
    assert deadline.passed and not Deadline().passed


@pytest.mark.parametrize("name", ["gradient", "round-robin"])
def test_a_retired_task_is_not_picked_again(name):
    sched = make_scheduler(name, [TaskInfo("a", 10, 1e6, "matmul", 1e-3), TaskInfo("b", 1, 1e6, "matmul", 1e-3),
                                  TaskInfo("c", 1, 1e6, "matmul", 1e-3)])
    sched.retire(0)
    picks = [sched.next_task() for _ in range(6)]
    assert 0 not in picks and set(picks) <= {1, 2}


@pytest.mark.parametrize("rule, message", [
    (StopRule(timeout_s=0), "--timeout 0: give a positive number of seconds"),
    (StopRule(timeout_s=float("nan")), "--timeout nan: give a positive number of seconds"),
    (StopRule(early_stop=0), "--early-stop 0: give a positive number of trials"),
    (StopRule(early_stop=-3), "--early-stop -3: give a positive number of trials"),
])
def test_bad_stop_values_are_refused(rule, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        rule.validate()


def test_report_md_says_why_tuning_stopped():
    from pipeline.report import stage_summary

    st = {"trials": 40, "measured_now": 40, "searcher": "opevo", "scheduler": "gradient", "kernel_ms_before": 1.0,
          "kernel_ms_after": 0.5, "records": "r.jsonl", "stop_reason": "timeout", "timeout_s": 30.0, "early_stop": 8,
          "early_stopped": [1, 3], "time_s": 1.0}
    assert "; stopped at the --timeout of 30 s (2 tasks early-stopped after 8 trials without a gain); " in \
        stage_summary("tune", st)
    assert "stopped" not in stage_summary("tune", st | {"stop_reason": "budget", "early_stopped": []})
