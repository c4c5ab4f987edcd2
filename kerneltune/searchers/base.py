"""The interface every searcher implements, plus the bookkeeping they all share.

A searcher is a pure proposal engine: ``propose(n)`` returns up to ``n`` configs it has never proposed or
observed before, ``observe(configs, results)`` feeds back their fitness (GFLOPS; 0 for a failed build/run).
It never measures anything itself, so the same object drives real TVM measurements, a synthetic objective
in the tests, or a replay of records on resume (configs it did not propose are accepted by ``observe``).

Contract every searcher keeps: it is a deterministic function of its seed and of the sequence of
(propose, observe) calls it receives - a resumed run re-executes the search and looks the proposals up in
the records (:mod:`kerneltune.tune`), so the same calls must give the same proposals (seeded RNGs only, no
iteration over sets whose order can vary).  Configs observed before the first proposal are the warm start
(the template's default config): a searcher starts from the best of them.
"""
from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from typing import Sequence

from graphopt.errors import UserError
from kerneltune.space import Config, FactorKnob, SearchSpace

# Spaces up to this many configs may be enumerated to find the last unsampled ones.
ENUMERATE_LIMIT = 200_000
# Rejection-sampling attempts before falling back to enumeration (or giving up on a huge space).
SAMPLE_ATTEMPTS = 1_000


class Searcher(ABC):
    """Base class: tracks every config ever proposed or observed so no config is measured twice."""

    name = "base"
    #: Natural batch size (what one generation / expansion produces); the tuner asks for this many.
    batch_size = 8

    def __init__(self, space: SearchSpace, seed: int = 0):
        if not space.knobs:
            raise UserError("search space has no knobs; nothing to tune")
        self.space = space
        self.seed = seed
        self.rng = random.Random(seed)
        self.sampled: set[Config] = set()        # proposed or observed: never propose these again
        self.fitness: dict[Config, float] = {}   # observed results only

    # ----------------------------------------------------------------- interface
    def propose(self, n: int) -> list[Config]:
        """Up to ``n`` new configs; fewer only when (nearly) the whole space has been sampled."""
        out = self._propose(n)
        for c in out:
            assert c not in self.sampled, "searcher proposed a config twice"
            self.sampled.add(c)
        return out

    def observe(self, configs: Sequence[Config], results: Sequence[float]) -> None:
        """Record results (GFLOPS, 0 = failure) for configs, proposed by this searcher or replayed."""
        if len(configs) != len(results):
            raise ValueError("observe: configs and results differ in length")
        configs = [tuple(c) for c in configs]
        results = [max(0.0, float(r)) for r in results]
        for c, r in zip(configs, results):
            self.sampled.add(c)
            self.fitness[c] = r
        self._observe(configs, results)

    @abstractmethod
    def _propose(self, n: int) -> list[Config]: ...

    def _observe(self, configs: list[Config], results: list[float]) -> None:
        """Searcher-specific learning; the base class has already updated ``sampled``/``fitness``."""

    # ----------------------------------------------------------------- helpers
    @property
    def best(self) -> tuple[Config | None, float]:
        if not self.fitness:
            return None, 0.0
        c = max(self.fitness, key=self.fitness.__getitem__)
        return c, self.fitness[c]

    def random_unsampled(self, n: int, exclude: set[Config] | frozenset = frozenset()) -> list[Config]:
        """Up to n uniformly random configs not yet sampled (nor in ``exclude``).

        Rejection sampling first; when it keeps hitting sampled configs the space is nearly exhausted, so
        small spaces are enumerated to find the remaining ones (huge spaces cannot be exhausted in
        practice, so giving up there only happens on pathological inputs).
        """
        out: list[Config] = []
        taken = set(exclude)
        misses = 0
        while len(out) < n and misses < SAMPLE_ATTEMPTS:
            c = self.space.sample(self.rng)
            if c in self.sampled or c in taken:
                misses += 1
                continue
            out.append(c)
            taken.add(c)
        if len(out) < n and self.space.size() <= ENUMERATE_LIMIT:
            rest = [c for c in itertools.product(*(k.values for k in self.space.knobs))
                    if c not in self.sampled and c not in taken and self.space.valid(c)]
            self.rng.shuffle(rest)
            out.extend(rest[: n - len(out)])
        return out


def require_factor_only(space: SearchSpace, searcher: str) -> None:
    """G-BFS and N-A2C act by moving prime factors between tile levels: other knob kinds have no actions."""
    if not space.factor_only:
        bad = [k.name for k in space.knobs if not isinstance(k, FactorKnob)]
        raise UserError(f"searcher '{searcher}' handles factor knobs only, but the space has non-factor knobs "
                        f"{bad}; fix them (make_searcher(..., fixed=default_config)) or use opevo/random")


def untiled(space: SearchSpace) -> Config:
    """The configuration without multi-level tiling, ``[product, 1, ..., 1]`` per factor knob."""
    return tuple(k.untiled() for k in space.knobs)
