"""Task schedulers: which task gets the next batch of measurement trials.

A model has many tuning tasks of very different weight; spending the global trial budget evenly
(round-robin) wastes trials on tasks that are already good or that hardly matter.  The gradient scheduler
follows Ansor section 6 (ALGORITHMS.md section 3): minimise ``f = sum_i w_i * g_i`` (w_i occurrences of
task i, g_i its best latency) by giving the next batch to the task whose estimated gradient
``df/dt_i`` is most negative:

    dL/dt_i ~ w_i * ( alpha * (g_i(t_i) - g_i(t_i - dt)) / dt
                     + (1 - alpha) * min(-g_i(t_i) / t_i,  beta * C_i / max_{k in N(i)} V_k - g_i(t_i)) )

with t_i the rounds given to task i so far, dt the backward window, C_i the task's FLOPs, V_k the best
FLOP/s reached by a similar task k (same op kind, FLOPs within ``similar_ratio``; i itself included).  The
first term is the recent improvement rate, the second an optimistic guess of what is left: either the
latency keeps falling at its average rate so far, or it can reach the speed a similar task already shows.
Unlike MetaSchedule's GradientBased, the similar-task term is kept.

Start and warm-up.  Every task starts from its default schedule's measured latency (``TaskInfo.latency_s``,
round 0 of :mod:`kerneltune.tune_tasks`), so the similar-task speeds V_k are known before any search.
Ansor begins with one round-robin round so that every task has a latency; with the defaults measured that
job is done, and a task without a valid latency still goes first (its gradient is -inf), so there is no
warm-up round: at t_i = 0 the forward term is -g_i (t_i counts as 1), the first batches go to the tasks with
the largest weighted default latency, and the backward term starts with the first round.  The warm-up would
spend 8 trials on each of ResNet-50's 25 tasks - the whole of a 200-trial budget.  Simulated
(``bench/scheduler_warmup.py``: ResNet-50's 25 tasks, 200 seeds; lower = less of the default-to-attainable
gap left): without the warm-up 0.575 / 0.413 / 0.249 / 0.083 at 200 / 400 / 800 / 2000 trials, with it
0.772 / 0.447 / 0.254 / 0.084 (round-robin 0.772 / 0.582 / 0.359 / 0.118).  When similar tasks do *not*
reach similar speeds (``--independent``) both gradient variants fall behind round-robin from 800 trials on
(0.52 and 0.50 vs 0.46 at 800): the similar-task term keeps pulling at tasks that cannot follow.

Retired tasks.  A task whose search space is exhausted, or that stopped improving (``--early-stop``,
:mod:`kerneltune.stopping`), is retired (:meth:`TaskScheduler.retire`): no scheduler picks it again, so the
trials it would have had go to the others, as MetaSchedule's task scheduler does with a finished task.  Its
latency still counts in the objective and in the similar-task speeds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from graphopt.errors import UserError


@dataclass
class TaskInfo:
    """What the scheduler needs to know about a task; ``latency_s`` is its starting (untuned) latency."""

    name: str
    weight: float
    flops: float
    kind: str
    latency_s: float = math.inf


@dataclass
class _State:
    info: TaskInfo
    rounds: int = 0
    history: list[float] = field(default_factory=list)  # best latency after each round; [0] = start

    @property
    def best(self) -> float:
        return self.history[-1]


class TaskScheduler:
    """Common bookkeeping: per-task best-latency history and the weighted objective."""

    name = "base"

    def __init__(self, tasks: list[TaskInfo]):
        if not tasks:
            raise ValueError("no tasks to schedule")
        self.states = [_State(t, history=[t.latency_s]) for t in tasks]
        self.retired: set[int] = set()
        self._cursor = 0

    def next_task(self) -> int:
        raise NotImplementedError

    def update(self, task: int, best_latency_s: float) -> None:
        """Record that ``task`` got one more round and its best latency is now ``best_latency_s``."""
        s = self.states[task]
        s.rounds += 1
        s.history.append(min(s.best, best_latency_s))

    def retire(self, task: int) -> None:
        """``task`` takes no more trials (exhausted, or stopped improving): never picked again while another
        task is left."""
        self.retired.add(task)

    def active(self) -> list[int]:
        """The tasks a scheduler may pick: those not retired (all of them once every one is)."""
        live = [i for i in range(len(self.states)) if i not in self.retired]
        return live or list(range(len(self.states)))

    def objective(self) -> float:
        """sum_i w_i * g_i, in seconds; infinite while some task has no valid latency."""
        return sum(s.info.weight * s.best for s in self.states)

    def _round_robin(self) -> int:
        live = set(self.active())
        while True:  # at most one lap: some task is live
            i = self._cursor % len(self.states)
            self._cursor += 1
            if i in live:
                return i


class RoundRobinScheduler(TaskScheduler):
    """The baseline: every task in turn."""

    name = "round-robin"

    def next_task(self) -> int:
        return self._round_robin()


class GradientScheduler(TaskScheduler):
    """Ansor's gradient-based allocation (see module docstring)."""

    name = "gradient"

    def __init__(self, tasks: list[TaskInfo], alpha: float = 0.2, beta: float = 2.0, window: int = 3,
                 similar_ratio: float = 2.0):
        super().__init__(tasks)
        self.alpha, self.beta, self.window, self.similar_ratio = alpha, beta, window, similar_ratio

    def _similar(self, i: int) -> list[int]:
        me = self.states[i].info
        return [k for k, s in enumerate(self.states) if s.info.kind == me.kind and me.flops > 0 and
                max(s.info.flops, me.flops) <= self.similar_ratio * min(s.info.flops, me.flops)]

    def gradient(self, i: int) -> float:
        s = self.states[i]
        g = s.best
        if not math.isfinite(g):
            return -math.inf  # no valid kernel yet: nothing matters more
        t = s.rounds
        dt = min(self.window, t)
        backward = (g - s.history[t - dt]) / dt if dt > 0 else 0.0
        if not math.isfinite(backward):  # the first valid result came within the window
            backward = -g / max(dt, 1)
        speeds = [self.states[k].info.flops / self.states[k].best for k in self._similar(i)
                  if math.isfinite(self.states[k].best) and self.states[k].best > 0]
        reachable = self.beta * s.info.flops / max(speeds) - g if speeds else -g
        forward = min(-g / max(t, 1), reachable)
        return s.info.weight * (self.alpha * backward + (1 - self.alpha) * forward)

    def next_task(self) -> int:
        grads = {i: self.gradient(i) for i in self.active()}
        return min(grads, key=lambda i: (grads[i], i))


SCHEDULERS = {"gradient": GradientScheduler, "round-robin": RoundRobinScheduler}


def make_scheduler(name: str, tasks: list[TaskInfo], **opts: float) -> TaskScheduler:
    try:
        cls = SCHEDULERS[name]
    except KeyError:
        raise UserError(f"unknown scheduler {name!r}: choose one of {', '.join(SCHEDULERS)}") from None
    return cls(tasks, **opts)
