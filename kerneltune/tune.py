"""The tuning loop: the searcher proposes a batch, the measurer measures it, records are appended, the
searcher observes.

Resuming is part of the loop, not an afterthought: records already in the file for this (task, target) are
replayed into the searcher's ``observe`` before anything is measured, they count towards ``trials``, and the
searcher never proposes them again (every searcher refuses to repeat an observed config).  So rerunning the
same command after a crash finishes the remaining trials, and rerunning a finished one measures nothing.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tqdm import tqdm

from kerneltune.records import Record, RecordLog
from kerneltune.searchers.base import Searcher
from kerneltune.space import Config, SearchSpace

log = logging.getLogger(__name__)

# A measurer that raises (instead of reporting per-config failures) this many batches in a row is broken.
MAX_CONSECUTIVE_MEASURE_CRASHES = 3

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


@dataclass
class _Failed:
    """Stand-in result for a batch whose measurer raised."""

    error: str
    gflops: float = 0.0
    latency_s: float | None = None


def replay(space: SearchSpace, records: list[Record]) -> list[tuple[Config, Record]]:
    """Configs of stored records that belong to this space, first occurrence only."""
    out, seen, foreign = [], set(), 0
    for rec in records:
        try:
            c = space.from_dict(rec.config)
        except (KeyError, TypeError):
            c = None
        if c is None or not space.contains(c):
            foreign += 1
            continue
        if c not in seen:
            seen.add(c)
            out.append((c, rec))
    if foreign:
        log.warning("warning: %d stored records do not fit this task's search space (space changed?); ignored",
                    foreign)
    return out


def tune(space: SearchSpace, searcher: Searcher, measure: Measure, trials: int, *, task_key: str,
         target: str, records: RecordLog | None = None, batch_size: int | None = None,
         progress: bool = True, desc: str = "tuning", timing: str = "warm") -> TuneResult:
    """Measure up to ``trials`` distinct configs in total (stored ones included) and return the best.

    ``timing`` names how ``measure`` takes latencies (``Measurer.timing``): it is stored with each record and
    only records of the same timing are resumed.
    """
    batch_size = batch_size or searcher.batch_size
    best: tuple[float, Config | None, float | None] = (0.0, None, None)
    curve: list[float] = []
    failures = 0

    def account(c: Config, gflops: float, latency: float | None) -> None:
        nonlocal best, failures
        if gflops > best[0]:
            best = (gflops, c, latency)
        failures += gflops <= 0
        curve.append(best[0])

    prior = replay(space, records.load(task_key, target, timing)) if records is not None else []
    for i in range(0, len(prior), batch_size):
        chunk = prior[i:i + batch_size]
        searcher.observe([c for c, _ in chunk], [r.gflops for _, r in chunk])
        for c, r in chunk:
            account(c, r.gflops, r.latency_s)
    if prior:
        log.info("resumed %d measured configs from %s", len(prior), records.path)

    bar = tqdm(total=trials, initial=min(len(prior), trials), desc=desc, file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    bar.set_postfix(best_gflops=f"{best[0]:.1f}")
    crashes = 0
    try:
        while len(curve) < trials:
            configs = searcher.propose(min(batch_size, trials - len(curve)))
            if not configs:
                log.info("the search space is exhausted after %d configs", len(curve))
                break
            try:
                results = list(measure(configs))
                if len(results) != len(configs):
                    raise RuntimeError(f"measurer returned {len(results)} results for {len(configs)} configs")
                crashes = 0
            except Exception as exc:   # noqa: BLE001 - one bad batch must not end a long tuning run
                crashes += 1
                if crashes >= MAX_CONSECUTIVE_MEASURE_CRASHES:
                    raise
                log.warning("warning: measuring a batch failed (%s: %s); recorded as failures",
                            type(exc).__name__, exc)
                results = [_Failed(f"measurer raised {type(exc).__name__}: {exc}") for _ in configs]
            gflops = [max(0.0, float(getattr(r, "gflops", 0.0) or 0.0)) for r in results]
            if records is not None:
                records.append(Record(
                    task=task_key, target=target, config=space.as_dict(c), gflops=g,
                    latency_s=getattr(r, "latency_s", None) if g > 0 else None,
                    error=getattr(r, "error", None), time=time.time(), timing=timing,
                    extra={k: getattr(r, k) for k in ("build_s", "run_s") if getattr(r, k, None) is not None},
                ) for c, r, g in zip(configs, results, gflops))
            searcher.observe(configs, gflops)
            for c, r, g in zip(configs, results, gflops):
                account(c, g, getattr(r, "latency_s", None) if g > 0 else None)
            bar.update(len(configs))
            bar.set_postfix(best_gflops=f"{best[0]:.1f}")
    finally:
        bar.close()
    return TuneResult(best_config=best[1], best_gflops=best[0], best_latency_s=best[2], trials=len(curve),
                      measured_now=len(curve) - len(prior), curve=curve, failures=failures)
