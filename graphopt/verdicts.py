"""The one store of whole-model verdicts: the evidence each keep-or-reject decision between two builds was
taken on, so that the same command decides the same way again without timing.

Three decisions rest on timing two whole builds against each other with :func:`graphopt.timing.decide`: the
graph stage keeping a rewrite (:func:`graphopt.stage.check_end_to_end`), the layout search keeping its
blocks over the heuristic ones (:func:`pipeline.layout.search.check_against_heuristic`) and tuning shipping
the tuned build (:func:`pipeline.tuning.pick_build`).  A timing never repeats exactly, so a rerun must not
time again: it replays what was recorded.

What is stored is the evidence, not the verdict: both builds' medians and the candidate/baseline ratio of
every block (:class:`Evidence`).  A rerun judges those blocks by today's rule and today's margin
(:func:`graphopt.timing.replay`), so one meaning holds for every decision, the margin is not part of the key,
and a changed keep rule reaches recorded evidence too.  A decision the deadline cut short
(:attr:`graphopt.timing.Decision.cut_short`) is not evidence and is not kept.

Keys name the decision and where it was measured (``scope``: the kind of decision, the engine, the target
and threads) and both builds (structural hashes or fingerprints).  One file per CPU and tool version in the
cache folder (:func:`graphopt.cost.cache.cache_dir`), merged and written atomically like every cache there;
an entry that is not evidence (a string, a negative or infinite ratio, no blocks, more blocks than
:data:`graphopt.timing.MAX_BLOCKS`) is ignored, dropped at the next write, and measured again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from graphopt.console import version
from graphopt.cost.cache import CostCache, cache_dir, cpu_id
from graphopt.timing import MAX_BLOCKS, Decision, replay


@dataclass(frozen=True)
class Evidence:
    """What one :func:`graphopt.timing.decide` run measured: both builds' medians (ms) and the
    candidate/baseline ratio of each block, in the order they were timed."""

    baseline_ms: float
    candidate_ms: float
    ratios: tuple[float, ...]

    @classmethod
    def of(cls, decision: Decision) -> Evidence:
        c = decision.comparison
        return cls(c.baseline_ms, c.candidate_ms, tuple(c.ratios))

    def judge(self, margin: float) -> tuple[bool, str]:
        """Whether the candidate is faster by ``margin`` on these blocks, and why (today's rule)."""
        return replay(self.ratios, margin)

    def to_list(self) -> list[float]:
        return [self.baseline_ms, self.candidate_ms, *self.ratios]


def _evidence(value: object) -> list[float] | None:
    """A stored entry that is evidence: ``[baseline_ms, candidate_ms, ratio, ...]`` (:meth:`Evidence.to_list`),
    every number finite and positive, 1 to MAX_BLOCKS ratios; None for anything else."""
    if not isinstance(value, list) or not 3 <= len(value) <= 2 + MAX_BLOCKS:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return None
    numbers = [float(v) for v in value]
    if not all(math.isfinite(v) and v > 0 for v in numbers):
        return None
    return numbers


def _any(_: object) -> bool:
    return True  # entries are checked as they are read (_evidence)


class VerdictStore:
    """Evidence per key, on disk (see the module docstring)."""

    def __init__(self, path: Path):
        self.cache = CostCache(path, entry=_evidence)

    def recall(self, key: str) -> Evidence | None:
        stored = self.cache.get(key, _any)  # checked as it was read (_evidence) or written (record)
        return None if stored is None else Evidence(stored[0], stored[1], tuple(stored[2:]))  # type: ignore[index]

    def record(self, key: str, decision: Decision) -> Evidence | None:
        """Keep ``decision``'s evidence under ``key`` (written at once: a run killed later keeps it), unless
        the deadline cut it short; returns what was kept."""
        if decision.cut_short:
            return None
        evidence = Evidence.of(decision)
        self.cache.put(key, evidence.to_list())
        self.cache.flush()
        return evidence


def store_path() -> Path:
    """This machine's verdict file: one per CPU (:func:`~graphopt.cost.cache.cpu_id`) and tool version; the
    target and threads are in each key."""
    return cache_dir() / f"verdicts-{cpu_id()}-v{version()}.json"


@lru_cache(maxsize=4)
def _store(path: Path) -> VerdictStore:
    return VerdictStore(path)


def default_store() -> VerdictStore:
    """The process's store for :func:`store_path` (one object per file, so every decision sees the others')."""
    return _store(store_path())


def verdict_key(scope: str, *builds: str) -> str:
    """The key of a decision of kind and place ``scope`` between ``builds`` (baseline first)."""
    return "|".join((scope, *builds))


@dataclass(frozen=True)
class Verdicts:
    """The store as one kind of decision in one place sees it: every key is ``scope|baseline|candidate``
    (:func:`verdict_key`), so a caller names only the two builds."""

    store: VerdictStore
    scope: str

    def key(self, baseline: str, candidate: str) -> str:
        return verdict_key(self.scope, baseline, candidate)

    def recall(self, baseline: str, candidate: str) -> Evidence | None:
        return self.store.recall(self.key(baseline, candidate))

    def record(self, baseline: str, candidate: str, decision: Decision) -> Evidence | None:
        return self.store.record(self.key(baseline, candidate), decision)
