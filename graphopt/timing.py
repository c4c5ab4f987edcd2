"""The one whole-model timer: every end-to-end latency the project reports or decides on is taken here.

Used by the graph stage's end-to-end check (:mod:`graphopt.stage`), ``bench-model``
(:mod:`pipeline.benchmark`) and the ``bench/`` scripts, so a number in a benchmark table and the verdict
that kept or dropped a rewrite come from the same procedure.  (Per-operator timings of the measured cost
model are a different job: :func:`graphopt.cost.measured.best_time`.)

Procedure (unchanged from ``bench-model``):

* ``warmup`` untimed rounds over every runner (first-call compilation, allocator and cache warm-up);
* then ``runs`` rounds; in each round every runner is called once untimed (*priming*) and once timed,
  runner after runner.  Interleaving makes machine noise (other processes, frequency changes) hit every
  model alike instead of whichever ran last.  Priming gives each runner the steady state of back-to-back
  inference: a thread pool that just served another engine is cold (TVM's idle workers sleep), and
  whichever engine ran right after onnxruntime measured 2-5x slower than the same build placed after
  another TVM engine;
* the median of the timed calls is the headline, the minimum the floor.

A runner is a callable that runs its model once and returns when the result is ready (synchronise the
device inside it).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, TypeVar

K = TypeVar("K", bound=Hashable)

WARMUP = 3


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call of one runner."""

    median_ms: float
    min_ms: float


def time_interleaved(runners: Mapping[K, Callable[[], object]], runs: int,
                     warmup: int = WARMUP) -> dict[K, Timing]:
    """Median and minimum milliseconds per call of each runner, timed interleaved (see module docstring).

    Each runner is called ``warmup + 2 * runs`` times in all (at least one timed run is taken)."""
    for _ in range(warmup):
        for run in runners.values():
            run()
    samples: dict[K, list[float]] = {k: [] for k in runners}
    for _ in range(max(1, runs)):
        for key, run in runners.items():
            run()  # priming: the steady state of back-to-back inference
            t0 = time.perf_counter()
            run()
            samples[key].append((time.perf_counter() - t0) * 1e3)
    return {k: Timing(statistics.median(v), min(v)) for k, v in samples.items()}


@dataclass(frozen=True)
class Comparison:
    """A candidate timed against a baseline in several interleaved blocks (see :func:`compare`)."""

    baseline_ms: float  # median over blocks of the baseline's per-block median
    candidate_ms: float
    ratios: tuple[float, ...]  # candidate / baseline median, per block
    margin: float

    @property
    def ratio(self) -> float:
        """The median of the per-block ratios: one disturbed block cannot decide."""
        return statistics.median(self.ratios)

    @property
    def faster(self) -> bool:
        """The candidate is faster than the baseline by more than the margin."""
        return self.ratio <= 1.0 - self.margin

    @property
    def slower(self) -> bool:
        """The candidate is slower than the baseline by more than the margin."""
        return self.ratio >= 1.0 + self.margin


def compare(baseline: Callable[[], object], candidate: Callable[[], object], margin: float, blocks: int = 3,
            runs: int = 10, warmup: int = WARMUP,
            timer: Callable[..., Mapping[str, Timing]] | None = None) -> Comparison:
    """Time ``candidate`` against ``baseline``: ``blocks`` rounds of :func:`time_interleaved` (``runs`` timed
    calls each), the order of the two swapped from block to block so that neither always runs first.

    A decision taken on the result never hangs on one noisy timing: each block's ratio is a ratio of
    medians, the verdict takes the median of the blocks' ratios, and ``faster`` / ``slower`` need it beyond
    ``margin``.  ``timer`` replaces :func:`time_interleaved` (tests)."""
    timer = timer or time_interleaved
    ratios, base, cand = [], [], []
    for b in range(max(1, blocks)):
        order = (("baseline", baseline), ("candidate", candidate))
        t = timer(dict(order if b % 2 == 0 else order[::-1]), runs, warmup)
        base.append(t["baseline"].median_ms)
        cand.append(t["candidate"].median_ms)
        ratios.append(t["candidate"].median_ms / t["baseline"].median_ms)
    return Comparison(statistics.median(base), statistics.median(cand), tuple(ratios), margin)
