"""The tuning loop of one task: the searcher proposes a batch, the measurer measures it, records are
appended, the searcher observes.

Resuming is a re-execution, not a replay of the file into the searcher: a resumed run runs the same loop
again, and every config the searcher proposes is first looked up in the records (:class:`ResultCache`);
only what is missing is measured.  Searchers are deterministic functions of their seed and of the
(propose, observe) calls they receive, so with the same seed the rerun proposes exactly the configs the
interrupted run proposed, finds their results in the file, and carries on from where the kill struck: its
searcher state, trial counts and best config are the uninterrupted run's.  (Replaying stored records
through ``observe`` alone would not do: N-A2C learns from its own rollouts, which a replay never makes.)
Records the rerun does not propose (another seed or searcher wrote them) are not used.  Rerunning a
finished command measures nothing.

The warm start: ``warm_start`` (the template's default config) is measured first, recorded like any trial
and observed by the searcher, so every searcher starts from the same known-good point and "best found"
can never be worse than the default it would replace.

Stopping: the loop ends when the trial budget is spent, and earlier at a ``--timeout`` or when every task
has stopped improving (``--early-stop``): :mod:`kerneltune.stopping`; :class:`Stopped` says which.

Failures (:mod:`kerneltune.failures`): config failures are recorded and final; environmental ones are
recorded as such, are not taken from the records on resume (measured again), and a run whose measurements
keep failing for environmental reasons stops with one line (:class:`EnvFailureGuard`) instead of spending
its budget on nothing.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from graphopt.console import progress_bar
from graphopt.errors import UserError
from kerneltune.failures import ENVIRONMENT, classify_batch
from kerneltune.records import Record, RecordLog
from kerneltune.searchers.base import Searcher
from kerneltune.space import Config, SearchSpace
from kerneltune.stopping import Deadline, Patience, StopReason, StopRule

log = logging.getLogger(__name__)

# A measurer that raises (instead of reporting per-config failures) this many batches in a row is broken.
MAX_CONSECUTIVE_MEASURE_CRASHES = 3
# Environmental failures in a row (no config ran in between) after which a run stops: two batches' worth.
ENV_FAILURE_LIMIT = 16
# Relative disagreement between a record's GFLOP/s and the task's FLOPs / its latency that marks it forged.
GFLOPS_CONSISTENCY = 1e-3

Measure = Callable[[list[Config]], Sequence[Any]]   # results with .gflops, .latency_s, .error (+ .build_s, .run_s)


@dataclass
class TuneResult:
    best_config: Config | None
    best_gflops: float
    best_latency_s: float | None
    trials: int                 # configs measured in total for this task, resumed ones included
    measured_now: int           # of which measured by this call
    curve: list[float] = field(default_factory=list)   # best GFLOPS so far after each trial, in order
    failures: int = 0
    warm_start_latency_s: float | None = None   # the warm start's (default config's) latency, if it ran
    stop_reason: StopReason = StopReason.BUDGET
    early_stopped: bool = False   # the task stopped improving (--early-stop) before the budget was spent


@dataclass
class _Failed:
    """Stand-in result for a batch whose measurer raised."""

    error: str
    gflops: float = 0.0
    latency_s: float | None = None


@dataclass(frozen=True)
class Outcome:
    """One trial's result as the loop uses it (measured now or taken from the records)."""

    gflops: float
    latency_s: float | None
    error: str | None
    failure: str | None


def record_problem(rec: Record, flops: float | None, ceiling: float | None) -> str | None:
    """Why a (well-formed) record cannot be a result of this task, or None: GFLOP/s inconsistent with the
    task's FLOPs and the recorded latency, or above what the target can possibly reach."""
    if rec.gflops <= 0:
        return None
    if flops:
        expected = flops / rec.latency_s / 1e9
        if abs(expected - rec.gflops) > GFLOPS_CONSISTENCY * max(expected, rec.gflops):
            return (f"gflops {rec.gflops:.4g} disagrees with the task's {flops:.4g} FLOPs in "
                    f"{rec.latency_s:.4g} s ({expected:.4g})")
    if ceiling and rec.gflops > ceiling:
        return f"gflops {rec.gflops:.4g} is above the target's ceiling of {ceiling:.4g} GFLOP/s"
    return None


class ResultCache:
    """What the records already hold for one task: config -> its first usable record.

    Not usable (and so measured again if proposed): environmental failures, records whose config is not a
    point of this task's space (the space changed), and records inconsistent with the task
    (:func:`record_problem`, warned about once each)."""

    def __init__(self, space: SearchSpace, records: Sequence[Record], flops: float | None = None,
                 ceiling: float | None = None, task_key: str = ""):
        self._by_config: dict[Config, Record] = {}
        foreign = 0
        for rec in records:
            try:
                c = space.from_dict(rec.config)
            except (KeyError, TypeError):
                c = None
            if c is None or not space.contains(c):
                foreign += 1
                continue
            if rec.environmental or c in self._by_config:
                continue
            why = record_problem(rec, flops, ceiling)
            if why:
                log.warning("warning: a stored record of %s is not believable (%s); ignored", task_key or "a task",
                            why)
                continue
            self._by_config[c] = rec
        if foreign:
            log.warning("warning: %d stored records do not fit this task's search space (space changed?); ignored",
                        foreign)

    def get(self, config: Config) -> Record | None:
        return self._by_config.get(config)

    def best(self, accept: Callable[[Config], bool] | None = None) -> tuple[Config, Record] | None:
        """The fastest config that ran (among those ``accept`` takes) and its record; None when none did.
        Ties go to the earlier record."""
        ran = [(rec.latency_s, i, c) for i, (c, rec) in enumerate(self._by_config.items())
               if rec.error is None and rec.latency_s and (accept is None or accept(c))]
        if not ran:
            return None
        config = min(ran)[2]
        return config, self._by_config[config]

    def __len__(self) -> int:
        return len(self._by_config)


class EnvFailureGuard:
    """Stops a run whose measurements fail for environmental reasons: :data:`ENV_FAILURE_LIMIT` in a row, or
    every measurement of the run (a tuning run that measured nothing is an error, not a success).  One guard
    may watch many tasks (a model's run)."""

    def __init__(self, limit: int = ENV_FAILURE_LIMIT):
        self.limit = limit
        self.in_a_row = 0
        self.measured = 0
        self.environmental = 0
        self.last: str | None = None

    def update(self, outcomes: Sequence[Outcome]) -> None:
        for o in outcomes:
            self.measured += 1
            if o.failure == ENVIRONMENT:
                self.environmental += 1
                self.in_a_row += 1
                self.last = o.error
            elif o.error is None:
                self.in_a_row = 0
        if self.in_a_row >= self.limit:
            raise UserError(f"{self.in_a_row} measurements in a row failed for reasons outside the configs "
                            f"(last: {self._last()}); fix the machine or the --rpc device and rerun the same "
                            "command: these trials are measured again")

    def check_end(self) -> None:
        """A UserError when every measurement of the run failed environmentally."""
        if self.measured and self.environmental == self.measured:
            raise UserError(f"all {self.measured} measurements failed for reasons outside the configs "
                            f"(last: {self._last()}); fix the machine or the --rpc device and rerun the same "
                            "command: these trials are measured again")

    def _last(self) -> str:
        return (self.last or "?").splitlines()[0][:160]


@dataclass(frozen=True)
class TaskRecords:
    """Where one task's trials are recorded and how the stored ones are read back: the task's key, the target
    (its TVM string), the records file (None: nothing recorded), the ``timing`` the measurer takes latencies
    with (``Measurer.timing``: only records of the same timing are resumed), and the task's FLOPs and the
    target's GFLOP/s ceiling, which a stored record must agree with to be believed (:func:`record_problem`)."""

    task_key: str
    target: str
    log: RecordLog | None = None
    timing: str = "warm"
    flops: float | None = None
    ceiling: float | None = None


class TaskTuner:
    """One task's tuning state across batches: its searcher, the results its records already hold, the best
    config so far, and the counts.  :func:`run_rounds` drives one per task, for :func:`tune` (one task) and
    :func:`kerneltune.tune_tasks.tune_tasks` (many, batch by batch as the task scheduler decides).  ``stop``:
    its ``early_stop`` ends the task once that many trials in a row brought no gain beyond the noise margin
    (:class:`kerneltune.stopping.Patience`)."""

    def __init__(self, space: SearchSpace, searcher: Searcher, measure: Measure, records: TaskRecords,
                 stored: Sequence[Record] | None = None, guard: EnvFailureGuard | None = None,
                 stop: StopRule | None = None):
        self.space, self.searcher, self.measure = space, searcher, measure
        self.task_key, self.target, self.records, self.timing = (records.task_key, records.target, records.log,
                                                                 records.timing)
        if stored is None and records.log is not None:
            records.log.acquire()  # one tuner per file, before its contents are trusted
            stored = records.log.load(records.task_key, records.target, records.timing)
        self.cache = ResultCache(space, stored or [], records.flops, records.ceiling, records.task_key)
        self.guard = guard or EnvFailureGuard()
        self.best: tuple[float, Config | None, float | None] = (0.0, None, None)  # (GFLOPS, config, latency)
        self.curve: list[float] = []
        self.failures = 0
        self.measured_now = 0
        self.from_records = 0
        self.exhausted = False
        self.warm_start_latency_s: float | None = None
        self.patience = Patience(stop.early_stop, stop.noise) if stop else Patience()
        self._crashes = 0

    @property
    def trials(self) -> int:
        return len(self.curve)

    @property
    def early_stopped(self) -> bool:
        """Its last ``--early-stop`` trials brought no gain beyond noise: it proposes nothing more."""
        return self.patience.stopped

    @property
    def done(self) -> bool:
        """Nothing more to propose: the space is exhausted or the task stopped improving."""
        return self.exhausted or self.early_stopped

    def warm_start(self, config: Config) -> None:
        """Measure (or look up) ``config`` first and let the searcher observe it (one trial)."""
        config = tuple(tuple(v) if isinstance(v, list) else v for v in config)
        if not self.space.contains(config):
            log.warning("warning: the warm-start config of %s is not in its search space; not used", self.task_key)
            return
        outcome = self.run([config])[0]
        self.warm_start_latency_s = outcome.latency_s if outcome.gflops > 0 else None

    def step(self, n: int) -> int:
        """One batch of up to ``n`` new configs from the searcher; returns how many (0: space exhausted)."""
        configs = self.searcher.propose(n)
        if not configs:
            log.info("the search space of %s is exhausted after %d configs", self.task_key, self.trials)
            self.exhausted = True
            return 0
        self.run(configs)
        return len(configs)

    def run(self, configs: list[Config]) -> list[Outcome]:
        """Look each config up in the records, measure the missing ones as one batch, record them, let the
        searcher observe the whole batch (in order), and account for it."""
        stored = [self.cache.get(c) for c in configs]
        todo = [c for c, r in zip(configs, stored) if r is None]
        fresh = iter(self._measure(todo) if todo else [])
        outcomes = [Outcome(r.gflops, r.latency_s if r.gflops > 0 else None, r.error, r.failure)
                    if r is not None else next(fresh) for r in stored]
        self.from_records += len(configs) - len(todo)
        self.searcher.observe(configs, [o.gflops for o in outcomes])
        was_stopped = self.early_stopped
        for c, o in zip(configs, outcomes):
            if o.gflops > self.best[0]:
                self.best = (o.gflops, c, o.latency_s)
            self.failures += o.gflops <= 0
            self.curve.append(self.best[0])
            self.patience.observe(o.latency_s)
        if self.early_stopped and not was_stopped:
            log.info("%s stopped improving: %d trials in a row within %.0f%% of its best (--early-stop); its "
                     "remaining trials go to the other tasks", self.task_key, self.patience.flat,
                     self.patience.noise * 100)
        return outcomes

    def _measure(self, configs: list[Config]) -> list[Outcome]:
        try:
            results = list(self.measure(configs))
            if len(results) != len(configs):
                raise RuntimeError(f"measurer returned {len(results)} results for {len(configs)} configs")
            self._crashes = 0
            raised = False
        except UserError:
            raise
        except Exception as exc:   # noqa: BLE001 - one bad batch must not end a long tuning run
            self._crashes += 1
            if self._crashes >= MAX_CONSECUTIVE_MEASURE_CRASHES:
                raise
            log.warning("warning: measuring a batch failed (%s: %s); recorded as failures", type(exc).__name__, exc)
            results = [_Failed(f"measurer raised {type(exc).__name__}: {exc}") for _ in configs]
            raised = True  # MAX_CONSECUTIVE_MEASURE_CRASHES, not the guard, decides when that is fatal
        gflops = [max(0.0, float(getattr(r, "gflops", 0.0) or 0.0)) for r in results]
        errors = [None if g > 0 else (getattr(r, "error", None) or "no result") for r, g in zip(results, gflops)]
        failures = classify_batch(errors)
        outcomes = [Outcome(g, getattr(r, "latency_s", None) if g > 0 else None, e, f)
                    for r, g, e, f in zip(results, gflops, errors, failures)]
        if self.records is not None:
            self.records.append(Record(
                task=self.task_key, target=self.target, config=self.space.as_dict(c), gflops=o.gflops,
                latency_s=o.latency_s, error=o.error, time=time.time(), timing=self.timing, failure=o.failure,
                extra={k: getattr(r, k) for k in ("build_s", "run_s") if getattr(r, k, None) is not None},
            ) for c, r, o in zip(configs, results, outcomes))
        self.measured_now += len(configs)
        if not raised:
            self.guard.update(outcomes)
        return outcomes

    def result(self) -> TuneResult:
        return TuneResult(best_config=self.best[1], best_gflops=self.best[0], best_latency_s=self.best[2],
                          trials=self.trials, measured_now=self.measured_now, curve=list(self.curve),
                          failures=self.failures, warm_start_latency_s=self.warm_start_latency_s,
                          early_stopped=self.early_stopped)


class Rounds:
    """How :func:`run_rounds` picks the task of each batch after round 0, and what it tells its driver; this
    base class serves one task (always task 0, nothing told).  :func:`kerneltune.tune_tasks.tune_tasks` puts
    its task scheduler and its report behind these methods."""

    def warmed(self, index: int) -> None:
        """Task ``index``'s warm start (round 0) has run."""

    def start(self) -> None:
        """Round 0 is over: the scheduler can start from the warm starts' latencies."""

    def next_task(self) -> int:
        return 0

    def stepped(self, index: int, spent: int) -> None:
        """Task ``index`` ran a batch; ``spent`` trials are spent in all."""

    def update(self, index: int) -> None:
        """Task ``index`` had its turn (it may have been exhausted)."""

    def retire(self, index: int) -> None:
        """Task ``index`` proposes nothing more (exhausted, or stopped improving): pick the others from now on."""


@dataclass(frozen=True)
class Stopped:
    """How :func:`run_rounds` ended: the trials spent and why it stopped."""

    spent: int
    reason: StopReason


def stop_reason(tuners: Sequence[TaskTuner], spent: int, trials: int, deadline: Deadline) -> StopReason | None:
    """Why the loop must stop now, or None: the budget first (a run that spent it did all it was asked), then
    every task done, then the deadline."""
    if spent >= trials:
        return StopReason.BUDGET
    if all(t.done for t in tuners):
        return StopReason.EARLY_STOP if any(t.early_stopped for t in tuners) else StopReason.EXHAUSTED
    if deadline.passed:
        return StopReason.TIMEOUT
    return None


def run_rounds(tuners: Sequence[TaskTuner], trials: int, warm_starts: Sequence[Config | None], bar: Any,
               rounds: Rounds | None = None, deadline: Deadline | None = None) -> Stopped:
    """The tuning loop, one task's and a model's alike.  Round 0: each task's warm start (None: none), in task
    order, while the budget and the time last; then, until ``trials`` configs are spent, every task is done
    (exhausted or early-stopped) or ``deadline`` has passed (:func:`stop_reason`), the task ``rounds`` picks
    runs one batch (its searcher's size, within the budget).  A task that is done is retired from the
    scheduler, so its share goes to the others.  Advances ``bar`` by the trials."""
    rounds = rounds or Rounds()
    deadline = deadline or Deadline()
    spent = 0
    for i, (tuner, start) in enumerate(zip(tuners, warm_starts)):
        if spent >= trials or deadline.passed:
            break
        if start is not None:
            tuner.warm_start(start)
        rounds.warmed(i)
        spent += tuner.trials
        bar.update(tuner.trials)
    rounds.start()
    for i, tuner in enumerate(tuners):
        if tuner.done:
            rounds.retire(i)
    while (reason := stop_reason(tuners, spent, trials, deadline)) is None:
        i = rounds.next_task()
        tuner = tuners[i]
        if not tuner.done:
            n = tuner.step(min(tuner.searcher.batch_size, trials - spent))
            spent += n
            bar.update(n)
            rounds.stepped(i, spent)
            if tuner.done:
                rounds.retire(i)
        rounds.update(i)
    return Stopped(spent, reason)


class _BestGflops(Rounds):
    """One task: the progress bar shows its best GFLOP/s after each batch."""

    def __init__(self, tuner: TaskTuner, bar: Any):
        self.tuner, self.bar = tuner, bar

    def stepped(self, index: int, spent: int) -> None:
        self.bar.set_postfix(best_gflops=f"{self.tuner.best[0]:.1f}")


def tune(space: SearchSpace, searcher: Searcher, measure: Measure, trials: int, records: TaskRecords, *,
         warm_start: Config | None = None, progress: bool = True, desc: str = "tuning") -> TuneResult:
    """Spend ``trials`` distinct configs in total (the warm start and those found in the records included)
    and return the best.  ``records`` says where the trials are recorded and how stored ones are checked
    before they are believed (:class:`TaskRecords`); batches are the searcher's size.
    """
    return run_task(TaskTuner(space, searcher, measure, records), trials, warm_start=warm_start,
                    progress=progress, desc=desc)


def run_task(tuner: TaskTuner, trials: int, *, warm_start: Config | None = None, deadline: Deadline | None = None,
             progress: bool = True, desc: str = "tuning") -> TuneResult:
    """:func:`tune` on a tuner made by the caller (its ``stop`` rule set: ``--early-stop``), within
    ``deadline`` (``--timeout``); the result says why it stopped."""
    bar = progress_bar(progress, total=trials, desc=desc, dynamic_ncols=True)
    try:
        stopped = run_rounds([tuner], trials, [warm_start], bar, _BestGflops(tuner, bar), deadline)
    finally:
        bar.close()
    if tuner.from_records:
        log.info("resumed %d measured configs from %s", tuner.from_records,
                 tuner.records.path if tuner.records else "records")
    tuner.guard.check_end()
    result = tuner.result()
    result.stop_reason = stopped.reason
    return result
