"""The untuned build's sanity floor: no templated kernel ships at a pathological speed.

A template's default config is a heuristic, and one that falls to a pathological schedule on a shape no one
profiled sinks the whole model: ViT-B/16's 197 tokens once gave its MLP matmuls 1-row register tiles, 15
GFLOP/s of a 466 GFLOP/s CPU, and the model ran 14x onnxruntime.  So after the untuned build every templated
kernel is timed in place (one profiled run of the model, :mod:`pipeline.pricing.profile`) and its rate compared with
its roofline on this CPU: the lower of the practical FMA peak and the memory bandwidth times the kernel's
arithmetic intensity (a matrix-vector product streams its weight; its GFLOP/s are the bandwidth's).  A kernel
under :data:`FLOOR` of its roofline, taking at least :data:`MIN_SHARE` of the model's kernel time and
:data:`MIN_MS` per run, is flagged, and its default raced against :data:`CANDIDATES` configs of
its template's space drawn with the build's seed, each timed alone with cold operands
(:mod:`kerneltune.measure`) over :data:`ROUNDS` interleaved rounds; the fastest replaces the default only when
it is :data:`MARGIN` times faster, so no choice hangs on one noisy timing.

The CPU's two facts are measured once and cached with the other per-CPU facts (:mod:`kerneltune.calibrate`):
the peak as what the matmul template's default reaches on a cache-resident product (the rate a healthy kernel
gets here, not a datasheet's), the bandwidth as one thread streaming a buffer far larger than the caches.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kerneltune import templates
from kerneltune.calibrate import calibrated
from pipeline.partition import Partition
from pipeline.pricing.profile import KernelTime, by_task_name

FLOOR, CANDIDATES, ROUNDS, MARGIN = 0.05, 12, 2, 1.5
# Only a kernel that costs the model something is judged: a 1x256x10 classifier (5 KFLOP) runs at 0.2 GFLOP/s
# because a call costs ~25 us whatever the schedule, and racing configs for it gained nothing.  Both bounds
# hold: a share of the model, and a time per run beyond a few calls' fixed cost (a 2x8x16 matmul alone in a
# model is all of it, at 4 us; racing 13 configs for it took 12 s of its 24 s build, Intel Xeon).
MIN_SHARE = 0.01
MIN_MS = 0.05
PEAK_SHAPE = (192, 256, 256)  # fits every L2: the template's inner loop alone, no memory stream
STATIC_PEAK_GFLOPS, STATIC_BANDWIDTH_GBS = 50, 5  # a target that does not run here (nothing is measured then)


@dataclass
class KernelRate:
    """One templated kernel's rate in the model against its roofline."""

    index: int
    name: str
    ms: float  # per model run, all calls
    gflops: float
    roofline_gflops: float
    flagged: bool
    replaced: bool = False
    replacement_ms: float | None = None  # per call, timed alone, cold
    default_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def measure_peak(target) -> int:
    """GFLOP/s the matmul template's default reaches on :data:`PEAK_SHAPE` with warm caches (best of 5)."""
    from kerneltune.prepack import kernel_timer
    from kerneltune.task import make_task

    task = make_task("matmul", ",".join(map(str, PEAK_SHAPE)))
    timer = kernel_timer(templates.apply(task, templates.default_config(task, target), target), task,
                         task.make_inputs(0), target, number=20, repeat=5, cold=False)
    return max(1, int(task.flops / min(timer()) / 1e9))


def measure_bandwidth(_target) -> int:
    """GB/s one thread reads a 256 MiB buffer at (best of 3)."""
    a = np.ones(64 << 20, dtype=np.float32)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return max(1, int(best))


def kernel_bytes(shapes, dtype: str) -> int:
    """The bytes a kernel reads and writes once: every argument and its output, of ``dtype``."""
    return sum(math.prod(s) for s in shapes) * np.dtype(dtype).itemsize


def roofline(flops: float, nbytes: float, peak_gflops: float, bandwidth_gbs: float) -> float:
    """GFLOP/s a kernel of ``flops`` reading and writing ``nbytes`` once can reach."""
    return min(peak_gflops, bandwidth_gbs * flops / max(nbytes, 1.0))


def kernel_rates(part: Partition, profile: list[KernelTime], peak_gflops: float,
                 bandwidth_gbs: float) -> list[KernelRate]:
    """The rate of every templated task that ran in ``profile`` (its kernels' times summed: a pre-packed
    kernel counts for its task: :func:`pipeline.pricing.profile.by_task_name`)."""
    ms = by_task_name(profile)
    model_ms = sum(k.ms for k in profile)
    out = []
    for t in part.tasks:
        total = sum(ms.get(n, 0.0) for n in t.names)
        if t.task is None or total <= 0:
            continue
        nbytes = kernel_bytes(t.shapes, t.dtype)
        gflops = t.flops * t.weight / (total * 1e6)
        line = roofline(t.flops, nbytes, peak_gflops, bandwidth_gbs)
        costs = total >= max(MIN_SHARE * model_ms, MIN_MS)
        out.append(KernelRate(t.index, t.name, total, gflops, line, gflops < FLOOR * line and costs))
    return out


def replace_slow(part: Partition, rates: list[KernelRate], target, seed: int) -> dict[str, Any]:
    """Configs replacing the flagged kernels' defaults (task key -> config); ``rates`` are updated in place."""
    from kerneltune.measure import Measurer

    by_index = {t.index: t for t in part.tasks}
    flagged = [r for r in rates if r.flagged]
    configs: dict[str, Any] = {}
    if not flagged:
        return configs
    with Measurer(target, cache_flush=True) as m:
        for rate in flagged:
            task = by_index[rate.index].task
            space = templates.space_for(task, target)
            default = templates.default_config(task, target)
            rng = random.Random(f"{seed}:{task.key}")
            candidates = [default] + [c for c in (space.sample(rng) for _ in range(CANDIDATES)) if c != default]
            best = [float("inf")] * len(candidates)
            for _ in range(ROUNDS):  # interleaved: a noisy moment slows every candidate alike
                for i, r in enumerate(m.measure(task, candidates)):
                    if r.latency_s is not None:
                        best[i] = min(best[i], r.latency_s)
            pick = min(range(len(candidates)), key=lambda i: (best[i], i))
            rate.default_ms = best[0] * 1e3 if best[0] != float("inf") else None
            if pick and best[pick] * MARGIN <= best[0]:
                configs[task.key] = candidates[pick]
                rate.replaced, rate.replacement_ms = True, best[pick] * 1e3
    return configs


def cpu_facts(target) -> tuple[float, float]:
    """(practical peak GFLOP/s, bandwidth GB/s) of this CPU for ``target``, measured once and cached."""
    return (float(calibrated("practical_peak_gflops", target, STATIC_PEAK_GFLOPS, measure_peak)),
            float(calibrated("read_bandwidth_gbs", target, STATIC_BANDWIDTH_GBS, measure_bandwidth)))
