"""Multi-task tuning: spend a global trial budget over a model's tasks (MetaSchedule's task-scheduler loop).

Round 0 measures every task's default schedule (the template's ``default_config``, what ``--skip-tune``
compiles) through the same measurer as any trial - cold caches when the measurer flushes them, the fused
epilogue, the kernel as the model runs it - records it like any trial (it counts towards ``--trials``) and
lets the task's searcher observe it: the same warm start for every searcher.  A task keeps its default
unless a tuned config beats it.  Then a task scheduler (:mod:`kerneltune.scheduler`: Ansor's gradient rule
or round-robin), starting from the defaults' measured latencies, picks which task gets the next batch;
:class:`kerneltune.tune.TaskTuner` runs that batch with the task's own searcher (kept across rounds, so its
population / model carries on) and appends every measurement to the records file.  The objective is the
model's kernel time, sum of weight x best latency.

Resuming: the whole loop runs again with the same seed.  Every batch a searcher proposes is looked up in the
records first and only what is missing is measured, so the scheduler sees the same latencies in the same
order and takes the same decisions: the per-task allocation and the final configs of a run killed at any
point and resumed are those of the uninterrupted run (searchers and the scheduler are deterministic given
their seed and inputs).  Rerunning a finished command measures nothing.

Stopping early (``TuningRun.stop``, :mod:`kerneltune.stopping`): a task that stopped improving is retired from
the scheduler and its share of the budget goes to the others; at the run's ``--timeout`` no new batch starts
and the best configs so far are the result.  :attr:`TuningResult.stop_reason` says which ended the run.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from graphopt.console import progress_bar
from graphopt.errors import UserError
from kerneltune import templates
from kerneltune.records import Record, RecordLog
from kerneltune.scheduler import TaskInfo, make_scheduler
from kerneltune.searchers import FACTOR_ONLY, make_searcher
from kerneltune.stopping import Deadline, StopReason, StopRule
from kerneltune.targets.registry import TargetSpec, check_can_tune, gflops_ceiling, kind_of
from kerneltune.task import Task
from kerneltune.tune import EnvFailureGuard, Rounds, Stopped, TaskRecords, TaskTuner, run_rounds


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


@dataclass(frozen=True)
class TuningRun:
    """How a multi-task run tunes: the target, the budget, the open records file and the choices
    (``--scheduler``, ``--searcher``, seed, ``--rpc``) and the stops besides the budget (``--timeout``,
    ``--early-stop``).  Made before any long work, it checks that the target can be tuned at all: here, or on
    the ``--rpc`` device (:func:`kerneltune.targets.registry.check_can_tune`)."""

    spec: TargetSpec
    trials: int
    records: RecordLog
    scheduler: str = "gradient"
    searcher: str = "opevo"
    seed: int = 0
    rpc: str | None = None
    progress: bool = True
    stop: StopRule = field(default_factory=StopRule)

    def __post_init__(self) -> None:
        check_can_tune(self.spec, self.rpc)
        self.stop.validate()


@dataclass
class TaskTuning:
    """Per-task outcome for report.json."""

    index: int
    name: str
    key: str
    kind: str
    weight: int
    flops: float
    default_ms: float | None  # the template's default config, measured (or taken from the records) as trial 1
    best_ms: float | None  # best config measured, the default included (None when nothing ran)
    trials: int = 0  # measured for this task in total (the default and resumed ones included)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (global trials spent, best ms) per round
    early_stopped: bool = False  # it stopped improving (--early-stop); its remaining trials went to the others
    config: dict[str, Any] | None = None  # the tuned config that beat the default (None: the default is kept)

    @property
    def final_ms(self) -> float | None:
        vals = [v for v in (self.default_ms, self.best_ms) if v is not None]
        return min(vals) if vals else None


@dataclass
class TuningResult:
    best_configs: dict[str, Any]  # task key -> config (only where a tuned config beat the measured default)
    tasks: list[TaskTuning]
    trials: int
    objective: list[tuple[int, float]]  # (global trials spent, sum weight x best ms) after each round
    scheduler: str
    searcher: str
    seconds: float
    measured_now: int = 0  # trials measured by this run (the rest came from the records)
    stop_reason: StopReason = StopReason.BUDGET
    stop: StopRule = field(default_factory=StopRule)  # the run's --timeout / --early-stop

    def kernel_ms(self) -> tuple[float, float]:
        """(calls x default time, calls x shipped config's time) summed over the tuned tasks, in ms per
        inference: each kernel timed alone, as the tuner measured it."""
        return (sum(t.weight * (t.default_ms or 0) for t in self.tasks),
                sum(t.weight * (t.final_ms or 0) for t in self.tasks))


@dataclass
class _State:
    task: TuningTask
    tuner: TaskTuner
    default: Any
    report: TaskTuning

    def refresh(self) -> None:
        """Copy the tuner's counts and best into the report."""
        self.report.trials = self.tuner.trials
        self.report.early_stopped = self.tuner.early_stopped
        lat = self.tuner.best[2]
        self.report.best_ms = lat * 1e3 if lat else None

    @property
    def latency_s(self) -> float:
        return (self.report.final_ms or math.inf) / 1e3


def _objective(states: list[_State]) -> float:
    return sum(s.report.weight * (s.report.final_ms or math.inf) for s in states)


def _merge_duplicates(tasks: list[TuningTask]) -> list[TuningTask]:
    """Tasks sharing a key get one config in the compiled model: tune them once, their weights summed."""
    merged: dict[str, TuningTask] = {}
    for t in tasks:
        first = merged.get(t.task.key)
        merged[t.task.key] = t if first is None else TuningTask(first.task, first.weight + t.weight, first.index)
    return list(merged.values())


def _lazy_measurer(target, rpc: str | None):
    """The default measurer, started (and the ``--rpc`` device checked) only when a config is missing from the
    records: rebuilding from complete records starts no worker and needs no device.  Cold caches on CPUs: in
    the model a kernel's weights come from DRAM (see kerneltune.measure)."""
    # Deferred: importing the measurer loads TVM's runtime pieces; tests pass their own factory.
    from kerneltune.measure import LazyMeasurer, Measurer, timing_of
    from kerneltune.runner import check_device

    flush = kind_of(target).device == "cpu"

    def start() -> Measurer:
        check_device(rpc)  # an unreachable --rpc device: one line now, not minutes of failed trials
        return Measurer(target, rpc=rpc, cache_flush=flush)

    return LazyMeasurer(start, timing_of(flush))


def tune_tasks(tasks: list[TuningTask], run: TuningRun, measure_factory: Callable | None = None) -> TuningResult:
    """Tune ``tasks`` with ``run.trials`` measurements in total (the defaults of round 0 included).

    ``measure_factory(target, rpc)`` returns a context manager with ``measure(task, configs)``; the default
    is :class:`kerneltune.measure.Measurer` (tests pass a fake one).  Raises a UserError when the records
    file is held by another tuner, or when the measurements fail for environmental reasons
    (:class:`kerneltune.tune.EnvFailureGuard`).
    """
    if not tasks:
        raise UserError("no task to tune")
    if measure_factory is None:
        measure_factory = _lazy_measurer
    tasks = _merge_duplicates(tasks)
    target = run.spec.target
    target_key = str(target)
    ceiling = gflops_ceiling(target)
    log = run.records
    log.acquire()  # one tuner per records file, before its contents are trusted
    t0 = time.perf_counter()
    deadline = run.stop.deadline()  # --timeout counts the whole run, the measurer's start included
    guard = EnvFailureGuard()
    try:
        with measure_factory(target, run.rpc) as m:
            timing = getattr(m, "timing", "warm")
            stored: dict[str, list[Record]] = {}
            for rec in log.load(target=target_key, timing=timing):
                stored.setdefault(rec.task, []).append(rec)
            states = []
            for t in tasks:
                space = templates.space_for(t.task, target)
                default = templates.default_config(t.task, target)
                fixed = default if run.searcher in FACTOR_ONLY and not space.factor_only else None
                tuner = TaskTuner(space, make_searcher(run.searcher, space, run.seed, fixed=fixed),
                                  lambda cs, task=t.task: m.measure(task, cs),
                                  TaskRecords(t.task.key, target_key, log, timing, t.flops, ceiling),
                                  stored=stored.get(t.task.key, []), guard=guard, stop=run.stop)
                report = TaskTuning(index=t.index, name=t.name, key=t.task.key, kind=t.kind, weight=t.weight,
                                    flops=t.flops, default_ms=None, best_ms=None)
                states.append(_State(t, tuner, default, report))
            stopped, objective = _run_rounds(states, run, deadline)
    finally:
        log.close()
    guard.check_end()
    best = {}
    for s in states:
        config = s.tuner.best[1]
        if config is None or config == s.default or s.report.best_ms is None:
            continue
        # A task keeps its default unless a tuned config beats it (a default that failed to run beats nothing).
        if s.report.default_ms is None or s.report.best_ms < s.report.default_ms:
            best[s.report.key] = config
            s.report.config = s.tuner.space.as_dict(config)
    return TuningResult(best_configs=best, tasks=[s.report for s in states], trials=stopped.spent,
                        objective=objective, scheduler=run.scheduler, searcher=run.searcher,
                        seconds=time.perf_counter() - t0, measured_now=sum(s.tuner.measured_now for s in states),
                        stop_reason=stopped.reason, stop=run.stop)


class _ModelRounds(Rounds):
    """A model's tasks: the task scheduler picks each batch's task, the report follows every batch (the
    defaults' latencies, each task's curve, the objective after each round)."""

    def __init__(self, states: list[_State], scheduler: str, bar: Any):
        self.states, self.scheduler, self.bar = states, scheduler, bar
        self.objective: list[tuple[int, float]] = []
        self.sched = None
        self.spent = 0

    def warmed(self, index: int) -> None:
        s = self.states[index]
        lat = s.tuner.warm_start_latency_s
        s.report.default_ms = lat * 1e3 if lat else None
        s.refresh()
        self.spent += s.tuner.trials

    def start(self) -> None:
        self.sched = make_scheduler(self.scheduler, [TaskInfo(s.task.name, s.task.weight, s.task.flops, s.task.kind,
                                                              s.latency_s) for s in self.states])
        self.objective.append((self.spent, _objective(self.states)))

    def next_task(self) -> int:
        return self.sched.next_task()

    def stepped(self, index: int, spent: int) -> None:
        s = self.states[index]
        s.refresh()
        s.report.curve.append((spent, s.report.final_ms or math.inf))
        self.objective.append((spent, _objective(self.states)))
        self.bar.set_postfix(objective_ms=f"{self.objective[-1][1]:.2f}")

    def update(self, index: int) -> None:
        self.sched.update(index, self.states[index].latency_s)

    def retire(self, index: int) -> None:
        self.sched.retire(index)


def _run_rounds(states: list[_State], run: TuningRun, deadline: Deadline) -> tuple[Stopped, list]:
    """Round 0 (every task's default, in task order), then the scheduler's rounds until the budget is spent,
    every task is done (exhausted or early-stopped) or ``deadline`` passed (:func:`kerneltune.tune.run_rounds`).
    Returns (how it stopped, objective after each round)."""
    bar = progress_bar(run.progress, total=run.trials, desc="tuning", unit="trial")
    rounds = _ModelRounds(states, run.scheduler, bar)
    try:
        stopped = run_rounds([s.tuner for s in states], run.trials, [s.default for s in states], bar, rounds,
                             deadline)
    finally:
        bar.close()
    return stopped, rounds.objective
