"""Multi-task tuning: spend a global trial budget over a model's tasks (MetaSchedule's task-scheduler loop).

A task scheduler (:mod:`kerneltune.scheduler`: Ansor's gradient rule or round-robin) picks which task gets
the next batch; :func:`kerneltune.tune.tune` runs that batch with the task's own searcher (kept across
rounds, so its population / model carries on) and appends every measurement to the records file.
The objective is the model's kernel time, sum of weight x best latency.

Resuming: before the first round every task replays its stored records (same file, same target) into its
searcher; those trials count towards ``--trials``, so rerunning a finished command measures nothing.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from graphopt.errors import UserError
from kerneltune import templates
from kerneltune.records import RecordLog
from kerneltune.scheduler import TaskInfo, make_scheduler
from kerneltune.searchers import FACTOR_ONLY, make_searcher
from kerneltune.targets import TargetSpec
from kerneltune.task import Task
from kerneltune.tune import tune


@dataclass(frozen=True)
class TuningTask:
    """One task of a multi-task run: the kernel, how often a model run calls it, and its index in the
    caller's task list (for reports)."""

    task: Task
    weight: int
    index: int = 0

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def kind(self) -> str:
        return self.task.kind

    @property
    def flops(self) -> float:
        return float(self.task.flops)


@dataclass
class TaskTuning:
    """Per-task outcome for report.json."""

    index: int
    name: str
    key: str
    kind: str
    weight: int
    flops: float
    default_ms: float | None  # the template's default config, measured in this run
    best_ms: float | None  # best tuned config (None when nothing beat failure)
    trials: int = 0  # measured for this task in total, resumed ones included
    curve: list[tuple[int, float]] = field(default_factory=list)  # (global trials spent, best ms) per round

    @property
    def final_ms(self) -> float | None:
        vals = [v for v in (self.default_ms, self.best_ms) if v is not None]
        return min(vals) if vals else None


@dataclass
class TuningResult:
    best_configs: dict[str, Any]  # task key -> config (only where tuning beat the default)
    tasks: list[TaskTuning]
    trials: int
    objective: list[tuple[int, float]]  # (global trials spent, sum weight x best ms) after each round
    scheduler: str
    searcher: str
    seconds: float


class _NoReplay:
    """The records log seen by later rounds of a task: appends go to the file, nothing is replayed again
    (the task's searcher already observed its stored records in the first round)."""

    def __init__(self, log):
        self._log = log
        self.path = log.path

    def load(self, *_: Any, **__: Any) -> list:
        return []

    def append(self, records) -> None:
        self._log.append(records)


@dataclass
class _State:
    task: TuningTask
    space: Any
    searcher: Any
    report: TaskTuning
    best: tuple[float, Any] = (math.inf, None)  # (latency s, config)
    exhausted: bool = False


def _objective(states: list[_State]) -> float:
    return sum(s.report.weight * (s.report.final_ms or math.inf) for s in states)


def tune_tasks(tasks: list[TuningTask], spec: TargetSpec, trials: int, records_path: str | Path,
               scheduler: str = "gradient", searcher: str = "opevo", seed: int = 0, rpc: str | None = None,
               measure_factory: Callable | None = None, progress: bool = True) -> TuningResult:
    """Tune ``tasks`` with ``trials`` measurements in total.

    ``measure_factory(target, rpc)`` returns a context manager with ``measure(task, configs)``; the default
    is :class:`kerneltune.measure.Measurer` (tests pass a fake one).
    """
    if not tasks:
        raise UserError("no task to tune")
    if not spec.can_run and not rpc:
        raise UserError(f"tuning for --target {spec.kind} needs a device: {spec.note}; pass --rpc "
                        "HOST:PORT:KEY of a TVM RPC tracker with that device, or --skip-tune")
    if measure_factory is None:
        # Deferred: the measurer starts worker processes; tests and resumed runs pass their own.
        from kerneltune.measure import Measurer

        # Cold caches (CPU): in the model a kernel's weights come from DRAM, see kerneltune.measure.
        measure_factory = lambda target, rpc_: Measurer(target, rpc=rpc_, cache_flush=True)  # noqa: E731
    target = spec.target
    target_key = str(target)
    log = RecordLog(records_path)
    t0 = time.perf_counter()
    states: list[_State] = []
    with measure_factory(target, rpc) as m:
        timing = getattr(m, "timing", "warm")
        spent = 0
        for t in tasks:
            space = templates.space_for(t.task, target)
            default = templates.default_config(t.task, target)
            fixed = default if searcher in FACTOR_ONLY and not space.factor_only else None
            srch = make_searcher(searcher, space, seed, fixed=fixed)
            base = m.measure(t.task, [default])[0]
            rep = TaskTuning(t.index, t.name, t.task.key, t.kind, t.weight, t.flops,
                             base.latency_s * 1e3 if base.latency_s else None, None)
            st = _State(t, space, srch, rep)
            # Replay stored records (resume): counts towards the budget, measures nothing.
            res = tune(space, srch, lambda cs, task=t.task: m.measure(task, cs), 0, task_key=t.task.key,
                       target=target_key, records=log, progress=False, timing=timing)
            _account(st, res, space)
            spent += res.trials
            states.append(st)
        sched = make_scheduler(scheduler, [TaskInfo(s.task.name, s.task.weight, s.task.flops, s.task.kind,
                                                    (s.report.final_ms or math.inf) / 1e3) for s in states])
        objective = [(spent, _objective(states))]
        bar = tqdm(total=trials, initial=min(spent, trials), desc="tuning", disable=not progress, unit="trial")
        try:
            while spent < trials and not all(s.exhausted for s in states):
                i = sched.next_task()
                st = states[i]
                if st.exhausted:
                    sched.update(i, (st.report.final_ms or math.inf) / 1e3)
                    continue
                n = min(st.searcher.batch_size, trials - spent)
                res = tune(st.space, st.searcher, lambda cs, task=st.task.task: m.measure(task, cs), n,
                           task_key=st.task.task.key, target=target_key, records=_NoReplay(log), progress=False,
                           timing=timing)
                st.exhausted = res.measured_now == 0
                _account(st, res, st.space)
                spent += res.measured_now
                bar.update(res.measured_now)
                sched.update(i, (st.report.final_ms or math.inf) / 1e3)
                st.report.curve.append((spent, st.report.final_ms or math.inf))
                objective.append((spent, _objective(states)))
                bar.set_postfix(objective_ms=f"{objective[-1][1]:.2f}")
        finally:
            bar.close()
            log.close()
    best = {s.report.key: s.best[1] for s in states
            if s.best[1] is not None and (s.report.default_ms is None or s.best[0] * 1e3 < s.report.default_ms)}
    return TuningResult(best, [s.report for s in states], spent, objective, scheduler, searcher,
                        time.perf_counter() - t0)


def _account(st: _State, res, space) -> None:
    st.report.trials += res.trials  # the replay call: stored ones; later rounds: measured now
    if res.best_config is not None and res.best_latency_s and res.best_latency_s < st.best[0]:
        st.best = (res.best_latency_s, res.best_config)
        st.report.best_ms = res.best_latency_s * 1e3
