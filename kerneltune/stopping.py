"""When a tuning run stops before its trial budget: a wall-clock ``--timeout`` on the whole run, and
``--early-stop N``, a task that has stopped improving.

Early stopping is MetaSchedule's / AutoTVM's ``early_stopping``: a task whose last N trials (measured now or
found in the records, failures included) none beat its best latency by more than :data:`EARLY_STOP_NOISE`
stops; the task scheduler gives the trials it would have had to the other tasks
(:meth:`kerneltune.scheduler.TaskScheduler.retire`).  The margin is there because on a shared machine two
timings of one kernel differ by about a percent: a "gain" inside it is the same kernel timed twice, and
counting it as progress would keep a converged task busy on noise.  Counting records too keeps a resumed run's
decisions those of the uninterrupted run (:mod:`kerneltune.tune`).

The timeout is checked before each batch: a batch already measuring finishes (seconds), nothing new is
proposed after the deadline, and what was measured is kept, so the best configs so far ship.  Unlike the
other stops it depends on the machine's speed, so a run it stopped is not reproduced exactly on resume.

No TVM here: the command lines read these options before anything loads it.
"""
from __future__ import annotations

import enum
import math
import numbers
import time
from dataclasses import dataclass
from typing import Callable

from graphopt.errors import UserError

# A trial "improves" a task only if it beats its best latency by more than this fraction (timing noise).
EARLY_STOP_NOISE = 0.01


class StopReason(enum.Enum):
    """Why a tuning run ended; the value is what report.json and ``--json`` record."""

    BUDGET = "budget"  # --trials spent
    TIMEOUT = "timeout"  # --timeout reached: the best configs so far are used
    EARLY_STOP = "early_stop"  # every task stopped, at least one by --early-stop (the others exhausted)
    EXHAUSTED = "exhausted"  # every task's search space measured whole

    @property
    def phrase(self) -> str:
        """The reason in words, for the lines the command lines print."""
        return {StopReason.BUDGET: "the --trials budget was spent",
                StopReason.TIMEOUT: "the --timeout stopped it",
                StopReason.EARLY_STOP: "every task stopped improving (--early-stop)",
                StopReason.EXHAUSTED: "every task's search space was measured whole"}[self]


@dataclass(frozen=True)
class StopRule:
    """The stops besides the trial budget: ``timeout_s`` on the whole run, ``early_stop`` trials in a row
    without a gain beyond ``noise`` for one task (None: that stop is off)."""

    timeout_s: float | None = None
    early_stop: int | None = None
    noise: float = EARLY_STOP_NOISE

    def invalid(self) -> str | None:
        """The first value no run can take (``timeout_s`` or ``early_stop``), or None; :meth:`validate` words it
        for the command line, the Python API names its own argument."""
        if self.timeout_s is not None and not (isinstance(self.timeout_s, numbers.Real)
                                               and 0 < self.timeout_s < math.inf):
            return "timeout_s"
        if self.early_stop is not None and not (isinstance(self.early_stop, numbers.Integral)
                                                and self.early_stop >= 1):
            return "early_stop"
        return None

    def validate(self) -> StopRule:
        """This rule, or a one-line UserError naming the wrong option as the command lines spell it."""
        bad = self.invalid()
        if bad == "timeout_s":
            raise UserError(f"--timeout {self.timeout_s}: give a positive number of seconds (e.g. --timeout 600), "
                            "or leave it out for no time limit")
        if bad == "early_stop":
            raise UserError(f"--early-stop {self.early_stop}: give a positive number of trials (e.g. --early-stop "
                            "32), or leave it out to spend the whole budget")
        return self

    def deadline(self, clock: Callable[[], float] = time.monotonic) -> Deadline:
        """The run's deadline, counted from now."""
        return Deadline(None if self.timeout_s is None else clock() + self.timeout_s, clock)


@dataclass(frozen=True)
class Deadline:
    """A point on ``clock`` after which no new batch starts (None: never)."""

    at: float | None = None
    clock: Callable[[], float] = time.monotonic

    @property
    def passed(self) -> bool:
        return self.at is not None and self.clock() >= self.at


class Patience:
    """One task's early-stop count: trials in a row that did not beat the best latency by more than the noise
    margin.  ``limit`` None: never stops."""

    def __init__(self, limit: int | None = None, noise: float = EARLY_STOP_NOISE):
        self.limit, self.noise = limit, noise
        self.best_s: float | None = None
        self.flat = 0  # trials since the last real gain

    def observe(self, latency_s: float | None) -> None:
        """One trial's latency (None: it failed)."""
        if latency_s and (self.best_s is None or latency_s < self.best_s * (1 - self.noise)):
            self.flat = 0
        else:
            self.flat += 1
        if latency_s and (self.best_s is None or latency_s < self.best_s):
            self.best_s = latency_s

    @property
    def stopped(self) -> bool:
        return self.limit is not None and self.flat >= self.limit
