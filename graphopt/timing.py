"""The one whole-model timer: every end-to-end latency the project reports or decides on is taken here.

Used by the graph stage's end-to-end check (:mod:`graphopt.stage`), ``bench-model``
(:mod:`pipeline.benchmark`), ``optimize-model``'s tuned-vs-default check and the ``bench/`` scripts, so a
number in a benchmark table and the verdict that kept or dropped a rewrite come from the same procedure.
(Per-operator timings of the measured cost model are a different job: :func:`graphopt.cost.measured.best_time`.)

Procedure: **alternating blocks**.  In each of ``rounds`` rounds every runner gets one block: an idle gap
(none where a reversed round gives the same runner two blocks in a row), ``warmup`` untimed calls, then
consecutive timed calls.  The runner order is reversed every other round.
The median of all timed calls is the headline, the minimum the floor, and each block's median is kept so a
comparison can take a ratio per round (:func:`compare`).

Why blocks and not call-by-call alternation (what this module did before): two engines' thread pools share
the cores.  After a parallel region TVM's workers spin for a while before they sleep, and onnxruntime's do
the same; alternating call by call made each engine run beside the other's spinning workers, and stopping
onnxruntime's spinning after every run (``session.force_spinning_stop``) made onnxruntime wake its pool
for every operator.  On 2 cores MobileNet-v2 in onnxruntime measured 16.5 ms that way against 5.0 ms alone
in a fresh process, so our speed-up looked 3x larger than it was.  In a block an engine runs back to back,
as it runs in production; the idle gap lets the previous engine's workers stop spinning before the next
block starts, and the warm-up calls wake this engine's pool and caches.  Alternating the blocks (rather
than timing one engine after the other once) still spreads slow drifts of a shared machine over every
engine.  ``bench/timer_check.py`` checks that each engine's figure here is within 5% of the same engine
timed alone in a fresh process.

A runner is a callable that runs its model once and returns when the result is ready (synchronise the
device inside it).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Hashable, Mapping, Sequence, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)

WARMUP = 3  # untimed calls at the start of every block
ROUNDS = 5  # blocks per runner
# Idle time before every block: longer than either engine's workers spin after a run.  Measured on 2 cores
# (SqueezeNet, TVM timed right after a block of onnxruntime runs): 11.3 ms with no gap, 9.5 ms after 0.1 s,
# 7.3 ms after 0.5 s, 7.1 ms after 1 s, against 7.5 ms with no onnxruntime session in the process.
GAP_S = 0.5


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call of one runner."""

    median_ms: float
    min_ms: float
    blocks_ms: tuple[float, ...] = field(default=(), compare=False)  # each block's median, in round order
    samples_ms: tuple[float, ...] = field(default=(), compare=False, repr=False)  # every timed call
    timed_s: float = field(default=0.0, compare=False)  # wall time of the timed calls (warm-up and gaps excluded)

    @property
    def latency(self) -> "Latency":
        """The distribution of the timed calls (percentiles, mean, throughput), as :func:`latency` reports one:
        bench-model prints the same figures as run-model.  A Timing made without samples (tests) gives its
        median for every percentile."""
        samples = list(self.samples_ms) or [self.median_ms]
        return latency_of(samples, self.timed_s or None)


@dataclass(frozen=True)
class Plan:
    """How long to time: ``runs`` timed calls, or as many as fit in ``duration_s`` seconds when that is set
    (a fixed count makes a 0.1 ms model's figure noise and a 2 s model's run long; a duration suits both);
    ``warmup`` untimed calls first (per block in :func:`time_blocks`)."""

    runs: int = 30
    warmup: int = WARMUP
    duration_s: float | None = None


def time_blocks(runners: Mapping[K, Callable[[], object]], runs: int, warmup: int = WARMUP,
                rounds: int = ROUNDS, gap_s: float = GAP_S,
                sleep: Callable[[float], object] = time.sleep, duration_s: float | None = None) -> dict[K, Timing]:
    """Median and minimum milliseconds per call of each runner, timed in alternating blocks (see the module
    docstring).  ``runs`` timed calls per runner in all (at least one per block), split over ``rounds``
    blocks; with ``duration_s``, instead, each runner is timed for about that many seconds in all (each of
    ``rounds`` blocks calls it until its share has passed, at least once).  Each block also makes ``warmup``
    untimed calls.  The idle gap is for runners of different engines (each engine's workers spin after its
    block), so it comes before every block but a runner's second in a row (the turn of a reversed round);
    runners of one engine pass ``gap_s=0``.  ``sleep`` is replaced in tests."""
    rounds = max(1, rounds if duration_s is not None else min(rounds, runs))
    per_block = max(1, math.ceil(runs / rounds))
    order = list(runners)
    samples: dict[K, list[float]] = {k: [] for k in order}
    blocks: dict[K, list[float]] = {k: [] for k in order}
    walls: dict[K, float] = {k: 0.0 for k in order}
    previous = None
    for r in range(rounds):
        for key in (order if r % 2 == 0 else order[::-1]):
            run = runners[key]
            if key != previous:  # after its own block a runner's workers spinning is how it runs in production
                sleep(gap_s)
            previous = key
            for _ in range(warmup):
                run()
            block, wall = _timed_calls(run, per_block, None if duration_s is None else duration_s / rounds)
            samples[key].extend(block)
            blocks[key].append(statistics.median(block))
            walls[key] += wall
    return {k: Timing(statistics.median(v), min(v), tuple(blocks[k]), tuple(v), walls[k]) for k, v in samples.items()}


def _timed_calls(run: Callable[[], object], calls: int, seconds: float | None) -> tuple[list[float], float]:
    """Milliseconds of each of ``calls`` back-to-back calls (with ``seconds``: of the calls made until that
    long has passed, at least one), and the wall seconds they took together (for the throughput)."""
    samples: list[float] = []
    start = time.perf_counter()
    end = start + seconds if seconds is not None else None
    while (len(samples) < calls) if end is None else (not samples or time.perf_counter() < end):
        t0 = time.perf_counter()
        run()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples, time.perf_counter() - start


@dataclass(frozen=True)
class Comparison:
    """A candidate timed against a baseline in several blocks (see :func:`decide`)."""

    baseline_ms: float  # median over blocks of the baseline's per-block median
    candidate_ms: float
    ratios: tuple[float, ...]  # candidate / baseline median, per block
    margin: float


def compare(baseline: Callable[[], object], candidate: Callable[[], object], margin: float,
            runs: int = 10, warmup: int = WARMUP, timer: Callable[..., Mapping[str, Timing]] | None = None,
            deadline: float | None = None, gap_s: float = GAP_S) -> "Decision":
    """Is ``candidate`` faster than ``baseline`` (two runners) by ``margin``?  :func:`decide` over blocks of
    :func:`time_blocks` with one round (``runs`` timed calls per build), the order of the two swapped from
    block to block so that neither always runs first.  ``gap_s`` as in :func:`time_blocks` (0 for two builds
    of one engine: no other engine's workers to wait out).  ``timer`` replaces the one-round
    :func:`time_blocks` (tests)."""
    timer = timer or partial(time_blocks, rounds=1, gap_s=gap_s)

    def block(b: int) -> tuple[float, float]:
        order = (("baseline", baseline), ("candidate", candidate))
        t = timer(dict(order if b % 2 == 0 else order[::-1]), runs, warmup)
        return t["baseline"].median_ms, t["candidate"].median_ms

    return decide(block, margin, deadline=deadline)


MIN_BLOCKS = 3
MAX_BLOCKS = 7
# One-sided sign-test level for "faster": the chance that a candidate no faster than the baseline wins 3
# blocks of 3 (each block a fair coin under that hypothesis).
SIGN_LEVEL = 0.125


def sign_test_p(wins: int, blocks: int) -> float:
    """P(at least ``wins`` of ``blocks`` fair coin flips come up heads): the one-sided sign test's p-value."""
    return sum(math.comb(blocks, k) for k in range(wins, blocks + 1)) / 2 ** blocks


def judge(ratios: Sequence[float], margin: float, min_blocks: int = MIN_BLOCKS) -> tuple[bool | None, str]:
    """:func:`decide`'s rule on the blocks timed so far (candidate / baseline per block): ``(True, why)``
    faster, ``(False, why)`` not faster, ``(None, "")`` when more blocks are needed.  Pure, so a recorded run of
    blocks can be judged again (:func:`replay`)."""
    if len(ratios) < max(1, min_blocks):
        return None, ""
    fast = sum(r <= 1.0 - margin for r in ratios)
    p = sign_test_p(fast, len(ratios))
    if p <= SIGN_LEVEL:
        return True, f"faster by the margin in {fast} of {len(ratios)} blocks (sign test p = {p:.3f})"
    if 2 * fast <= len(ratios):
        return False, f"faster by the margin in {fast} of {len(ratios)} blocks"
    return None, ""


def replay(ratios: Sequence[float], margin: float, min_blocks: int = MIN_BLOCKS) -> tuple[bool, str]:
    """Today's rule on blocks recorded by an earlier run, as :func:`decide` would have walked them: the first
    verdict reached on a prefix; undecided (not faster) when the recorded blocks run out first.  A rerun thus
    needs no timing, stays deterministic, and a changed rule applies to recorded evidence too (the every-block
    rule's "undecided" on 6 of 7 faster blocks becomes "faster" under the sign test)."""
    for n in range(1, len(ratios) + 1):
        verdict, reason = judge(ratios[:n], margin, min_blocks)
        if verdict is not None:
            return verdict, reason
    fast = sum(r <= 1.0 - margin for r in ratios)
    return False, f"undecided: faster by the margin in {fast} of {len(ratios)} recorded blocks"


@dataclass(frozen=True)
class Decision:
    """Whether a candidate is faster than a baseline beyond a margin, from repeated interleaved blocks."""

    comparison: Comparison
    faster: bool
    reason: str
    cut_short: bool = False  # the deadline ended the blocks before the rule or MAX_BLOCKS did: not evidence to keep


def decide(block: Callable[[int], tuple[float, float]], margin: float, min_blocks: int = MIN_BLOCKS,
           max_blocks: int = MAX_BLOCKS, deadline: float | None = None) -> Decision:
    """Keep-or-reject on repeated measurement, never on one noisy timing.

    ``block(b)`` times one interleaved block (the caller swaps the order on odd ``b``) and returns the
    baseline's and the candidate's milliseconds.  The candidate is *faster* when the blocks in which it is
    faster by at least ``margin`` pass a one-sided sign test at level :data:`SIGN_LEVEL` (at least
    ``min_blocks`` blocks): 3 of 3, 4 of 4, 5 of 5 or 6, 6 of 7.  Blocks are added, up to ``max_blocks``,
    while more than half but too few for the test are faster; when at most half are, or the blocks run out,
    or ``deadline`` (a :func:`time.perf_counter` value) passes, the baseline is kept.  A candidate near the
    margin therefore loses consistently instead of winning on a lucky run.  (Before, every block had to be
    faster: a ResNet-50 build tuned with 2000 trials, faster by 5-18% in six blocks of seven and by 1.4% in
    the seventh, was judged undecided although 6 of 7 is the stronger evidence than the 3 of 3 it accepted.)"""
    base: list[float] = []
    cand: list[float] = []
    ratios: list[float] = []
    reason = ""
    faster = cut_short = False
    while True:
        if len(ratios) < max(1, min_blocks) and deadline is not None and ratios and time.perf_counter() >= deadline:
            reason, cut_short = f"time limit after {len(ratios)} of {min_blocks} blocks", True
            break
        b, c = block(len(ratios))
        base.append(b)
        cand.append(c)
        ratios.append(c / b if b > 0 else math.inf)
        verdict, reason = judge(ratios, margin, min_blocks)
        if verdict is not None:
            faster = verdict
            break
        if len(ratios) >= max_blocks or (deadline is not None and time.perf_counter() >= deadline):
            fast = sum(r <= 1.0 - margin for r in ratios)
            cut_short = len(ratios) < max_blocks
            reason = f"undecided: faster by the margin in {fast} of {len(ratios)} blocks" + (
                " (time limit)" if cut_short else "")
            break
    comparison = Comparison(statistics.median(base), statistics.median(cand), tuple(ratios), margin)
    return Decision(comparison, faster, reason, cut_short)


@dataclass(frozen=True)
class Latency:
    """The latency distribution of back-to-back calls of one model (what ``run-model`` reports), and the
    throughput those calls reached (inferences per second over their wall time: a deployed model's capacity,
    which the percentiles of single calls do not give once the timer's and the caller's overhead count)."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    runs: int
    throughput: float  # inferences per second
    timed_s: float  # seconds the timed calls took, warm-up excluded


def latency(run: Callable[[], object], runs: int, warmup: int = WARMUP, duration_s: float | None = None) -> Latency:
    """Time ``runs`` back-to-back calls of ``run`` (with ``duration_s``: as many as fit in that many seconds,
    at least one) after ``warmup`` untimed ones: a deployed model serves requests one after another, so unlike
    :func:`time_blocks` there is no other engine to interleave with and each call is timed (the tail
    percentiles are what a service level is written against)."""
    for _ in range(warmup):
        run()
    samples, wall = _timed_calls(run, max(1, runs), duration_s)
    return latency_of(samples, wall)


def latency_of(samples_ms: Sequence[float], timed_s: float | None = None) -> Latency:
    """The distribution of per-call milliseconds, and the throughput over ``timed_s`` wall seconds (None:
    the calls' own sum, as for a remote device's own timer, which leaves the network out)."""
    xs = np.asarray(samples_ms, dtype=np.float64)
    p50, p90, p99 = (float(v) for v in np.percentile(xs, [50, 90, 99]))
    wall = timed_s if timed_s else float(xs.sum()) / 1e3
    return Latency(p50_ms=p50, p90_ms=p90, p99_ms=p99, mean_ms=float(xs.mean()), min_ms=float(xs.min()), runs=len(xs),
                   throughput=len(xs) / wall if wall > 0 else 0.0, timed_s=wall)
