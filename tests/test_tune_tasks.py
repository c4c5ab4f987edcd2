"""kerneltune's multi-task loop on its own tasks (no model, no pipeline): the budget is spent exactly, the
gradient scheduler gives the heavier task more of it, and a rerun resumes from the records."""
from __future__ import annotations

from fake_measurer import FakeMeasurer as BaseFake
from kerneltune.records import RecordLog
from kerneltune.targets.parse import parse_target
from kerneltune.task import make_task
from kerneltune.tune_tasks import TuningRun, TuningTask, tune_tasks


class FakeMeasurer(BaseFake):
    """Latency a fixed function of the config (the default config: 1 ms), so the bookkeeping is exact."""

    lo = 0.3
    calls: list = []

    def seen(self, task, configs):
        FakeMeasurer.calls.extend(task.key for _ in configs)


def test_tune_tasks_spends_the_budget_favours_weight_and_resumes(tmp_path):
    spec = parse_target("llvm", 2)
    light, heavy = make_task("matmul", "16,64,64"), make_task("matmul", "32,64,128")
    tasks = [TuningTask(light, weight=1, index=0), TuningTask(heavy, weight=12, index=1)]
    records = tmp_path / "r.jsonl"
    FakeMeasurer.calls = []
    run = TuningRun(spec, 48, RecordLog(records), "gradient", "random", progress=False)
    res = tune_tasks(tasks, run, FakeMeasurer)
    assert res.trials == 48 and sum(t.trials for t in res.tasks) == 48
    assert len(records.read_text().splitlines()) == 48
    by_index = {t.index: t for t in res.tasks}
    assert by_index[1].trials > by_index[0].trials
    assert by_index[1].name == heavy.name and by_index[1].weight == 12 and by_index[1].flops == float(heavy.flops)
    for t in res.tasks:
        assert t.default_ms == 1.0 and (t.key not in res.best_configs or t.best_ms < t.default_ms)
    objective = [y for _, y in res.objective]
    assert objective == sorted(objective, reverse=True)
    FakeMeasurer.calls = []
    again = tune_tasks(tasks, run, FakeMeasurer)
    # The defaults were recorded as trials too: the rerun measures nothing and ends where the first did.
    assert again.trials == 48 and FakeMeasurer.calls == [] and again.measured_now == 0
    assert again.best_configs == res.best_configs
    assert [t.trials for t in again.tasks] == [t.trials for t in res.tasks]
