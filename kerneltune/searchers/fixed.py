"""Run a searcher on the factor knobs of a space while the other knobs stay fixed.

G-BFS and N-A2C only know prime-factor moves.  When a template's space also has discrete/choice knobs
(unroll depth, vectorize choice), the fair way to still compare them is to search the factor sub-space with
the remaining knobs pinned at the template's default config; the benchmark says when it does this.
"""
from __future__ import annotations

from typing import Callable

from kerneltune.searchers.base import Searcher
from kerneltune.space import Config, FactorKnob, SearchSpace


class FixedKnobs(Searcher):
    def __init__(self, space: SearchSpace, fixed: Config, make_inner: Callable[[SearchSpace], Searcher],
                 seed: int = 0):
        super().__init__(space, seed)
        if not space.contains(fixed):
            raise ValueError("FixedKnobs: the fixed config is not in the space")
        self.fixed = tuple(fixed)
        self.free = [i for i, k in enumerate(space.knobs) if isinstance(k, FactorKnob)]
        self.sub = SearchSpace([space.knobs[i] for i in self.free])
        self.inner = make_inner(self.sub)
        self.name = f"{self.inner.name}(factor knobs; others fixed)"
        self.batch_size = self.inner.batch_size

    def embed(self, sub: Config) -> Config:
        out = list(self.fixed)
        for i, v in zip(self.free, sub):
            out[i] = v
        return tuple(out)

    def project(self, config: Config) -> Config | None:
        """The sub-config, or None when a pinned knob differs (a replayed record from another searcher)."""
        if any(config[i] != self.fixed[i] for i in range(len(config)) if i not in self.free):
            return None
        return tuple(config[i] for i in self.free)

    def _propose(self, n: int) -> list[Config]:
        return [self.embed(c) for c in self.inner.propose(n)]

    def _observe(self, configs: list[Config], results: list[float]) -> None:
        pairs = [(p, r) for p, r in ((self.project(c), r) for c, r in zip(configs, results)) if p is not None]
        if pairs:
            self.inner.observe([p for p, _ in pairs], [r for _, r in pairs])
