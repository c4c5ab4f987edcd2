"""What a template's default needs to know about the CPU that no description of it says: measured once per CPU
and target, cached with the other per-CPU prices, read back ever after (the same command makes the same build).

The one fact today: how many times the matmul template's register tile repeats down the rows inside one
k-block (its S2 tile).  It trades L1 reuse of the B block against the A rows it streams and against how the
rows split between the cores, and the right value differs between cores with the same vector width and
register count: on a Zen 5, 4 (128x768x768, 1 thread: 157 vs 135 GFLOP/s for 2); on an Intel Xeon (2
threads, cold weights) 1-2 (ViT-B/16's 197-token MLP matmuls 242-262 vs 185-209 GFLOP/s for 4; the model
untuned 168 vs 204 ms; BERT-base 104 vs 108 ms).  So it is measured: each candidate on a BERT-base and a
ViT-B/16 MLP matmul, cold weights, interleaved rounds; a candidate replaces the static choice only when it
is faster by more than :data:`MARGIN` on the geometric mean.  A target this machine cannot run (a cross
build, an ``-mcpu`` with features this CPU lacks) gets the static choice.
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache

import numpy as np

log = logging.getLogger(__name__)

VERSION = 1
STATIC_ROW_REPEAT = 4  # the choice without a measurement (tuned on a Zen 5)
ROW_REPEATS = (4, 2, 1)  # candidates, preferred first on ties
SHAPES = ((128, 768, 3072), (197, 768, 3072))  # BERT-base's and ViT-B/16's first MLP matmul
ROUNDS, REPEAT = 3, 9
MARGIN = 0.03


def row_repeat(target) -> int:
    """The matmul template's S2 rows tile for ``target`` (a TVM llvm target): measured here once per CPU and
    target (see the module docstring), or :data:`STATIC_ROW_REPEAT` when the target does not run here."""
    from kerneltune.targets import missing_cpu_features

    if str(target.kind.name) != "llvm" or "mtriple" in target.attrs or missing_cpu_features(target):
        return STATIC_ROW_REPEAT
    return _measured_row_repeat(_target_key(target))


def _target_key(target) -> str:
    """What the measurement depends on: the code's CPU and features and the thread count."""
    attrs = target.attrs
    mattr = ",".join(str(a) for a in attrs["mattr"]) if "mattr" in attrs else ""
    cores = int(attrs["num-cores"]) if "num-cores" in attrs else 1
    return f"{attrs['mcpu'] if 'mcpu' in attrs else ''}|{mattr}|t{cores}"


@lru_cache(maxsize=None)
def _measured_row_repeat(key: str) -> int:
    from graphopt.cost.cache import CostCache, cache_dir
    from kerneltune.targets import host_cpu

    cache = CostCache(cache_dir() / f"calibration-{host_cpu()}.json")
    entry = f"v{VERSION}|matmul_row_repeat|{key}"
    hit = cache.get(entry)
    if hit is not None:
        return int(hit)
    mcpu, mattr, cores = key.split("|")
    choice = _measure(mcpu, mattr, int(cores[1:]))
    cache.put(entry, float(choice))
    cache.flush()
    return choice


def _measure(mcpu: str, mattr: str, cores: int) -> int:
    """Seconds of each candidate on :data:`SHAPES` (min over rounds of each round's median), compared."""
    import tvm

    from kerneltune import prepack, templates
    from kerneltune.task import build_func, make_task
    from kerneltune.templates import cpu

    spec: dict = {"kind": "llvm", "num-cores": cores}
    if mcpu:
        spec["mcpu"] = mcpu
    if mattr:
        spec["mattr"] = mattr.split(",")
    target = tvm.target.Target(spec)
    dev = tvm.cpu()
    timers: dict[int, list] = {s2: [] for s2 in ROW_REPEATS}
    for m, k, n in SHAPES:
        task = make_task("matmul", f"{m},{k},{n}")
        inputs = task.make_inputs(0)
        for s2 in ROW_REPEATS:
            func, packings = prepack.strip(templates.apply(task, cpu.default_config(task, target, s2), target))
            lib = build_func(func, target)
            args = ([tvm.runtime.tensor(x, dev) for x in prepack.pack_inputs(inputs, packings)]
                    + [tvm.runtime.empty(o.shape, o.dtype, dev) for o in task.outputs])
            timer = lib.time_evaluator("main", dev, number=1, repeat=REPEAT,
                                       f_preproc="cache_flush_cpu_non_first_arg")
            timers[s2].append((timer, args))
    best_of: dict[int, list[float]] = {s2: [math.inf] * len(SHAPES) for s2 in ROW_REPEATS}
    for _ in range(ROUNDS):  # interleaved: a noisy moment slows every candidate alike
        for s2 in ROW_REPEATS:
            for i, (timer, args) in enumerate(timers[s2]):
                best_of[s2][i] = min(best_of[s2][i], float(np.median(timer(*args).results)))
    score = {s2: math.exp(float(np.mean(np.log(best_of[s2])))) for s2 in ROW_REPEATS}
    best = min(ROW_REPEATS, key=lambda s2: (score[s2], ROW_REPEATS.index(s2)))
    choice = best if score[best] < score[STATIC_ROW_REPEAT] * (1 - MARGIN) else STATIC_ROW_REPEAT
    log.info("calibrated the matmul rows tile for %s: %s (geometric mean ms: %s)", mcpu or "llvm", choice,
             {s2: round(v * 1e3, 3) for s2, v in score.items()})
    return choice
