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
