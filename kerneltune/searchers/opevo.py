"""OpEvo (Gao et al., "OpEvo: An Evolutionary Method for Tensor Operator Optimization"), as in NNI's opevo.py.

Every evaluated config is kept ranked by fitness (GFLOPS, failures 0).  While no config has a fitness of at
least 1e-3 (nothing has built yet), children are uniformly random.  Afterwards the top ``parents_size``
configs with a fitness are parents; each knob of a child is inherited from a parent drawn with probability
proportional to its *raw* fitness (no rank shaping: the paper notes meaningful fitnesses are sparse), then
every knob mutates by a q-random walk on its topology: ``while rand() < q: move to a uniform random
neighbour``.  A child that was already sampled is mutated again until it is new, because measurements are
nearly noise-free and a repeat wastes a trial.

Warm start (beyond NNI): NNI's example waits for ``parents_size`` random results before it evolves.  Here the
population is whatever has a fitness, so a searcher that observed the template's default config first
(:func:`kerneltune.tune.tune`'s ``warm_start``) evolves from it at once - its first children are mutations
of the default - instead of spending its first generation on random configs (4-13 GFLOP/s on ResNet-50's
convolutions, where the default reaches several times that).  Without a warm start the first batch is
random as in NNI, and from the second on (``offspring_size`` = ``parents_size`` results) the two agree.
"""
from __future__ import annotations

import bisect

from kerneltune.searchers.base import Searcher
from kerneltune.space import Config, SearchSpace

# Re-mutations tried before deciding the neighbourhood of a child is exhausted and drawing a random config.
MAX_REMUTATIONS = 500


class OpEvo(Searcher):
    name = "opevo"

    def __init__(self, space: SearchSpace, seed: int = 0, parents_size: int = 8, offspring_size: int = 8,
                 q: float = 0.5):
        super().__init__(space, seed)
        if not 0.0 <= q < 1.0:
            raise ValueError("OpEvo mutation rate q must be in [0, 1)")
        self.parents_size = parents_size
        self.batch_size = offspring_size
        self.q = q
        # (-fitness, -arrival, config): ascending order = best first, newest first among equals (as NNI's
        # insert-at-front-and-bubble-down population does).
        self._ranked: list[tuple[float, int, Config]] = []
        self._arrivals = 0

    @property
    def ranked(self) -> list[tuple[Config, float]]:
        """All evaluated configs, best first."""
        return [(c, -f) for f, _, c in self._ranked]

    def _observe(self, configs: list[Config], results: list[float]) -> None:
        for c, r in zip(configs, results):
            self._arrivals += 1
            bisect.insort(self._ranked, (-r, -self._arrivals, c))

    def mutate(self, config: Config) -> Config:
        """q-random walk on every knob independently."""
        out = list(config)
        for i in range(len(out)):
            while self.rng.random() < self.q:
                nbrs = self.space.neighbours(tuple(out), i)
                if not nbrs:
                    break
                out[i] = self.rng.choice(nbrs)
        return tuple(out)

    def recombine(self, parents: list[Config], weights: list[float]) -> Config:
        """Each knob from a parent drawn with probability proportional to its raw fitness."""
        return tuple(self.rng.choices(parents, weights=weights)[0][i] for i in range(len(self.space.knobs)))

    def _propose(self, n: int) -> list[Config]:
        alive = [(f, c) for f, _, c in self._ranked[: self.parents_size] if -f >= 1e-3]
        if not alive:
            return self.random_unsampled(n)
        parents = [c for _, c in alive]
        weights = [-f for f, _ in alive]
        children: list[Config] = []
        taken: set[Config] = set()
        for _ in range(n):
            child = self.mutate(self.recombine(parents, weights))
            tries = 0
            while child in self.sampled or child in taken or not self.space.valid(child):  # recombined tiles
                tries += 1
                if tries > MAX_REMUTATIONS:
                    fallback = self.random_unsampled(1, exclude=taken)
                    child = fallback[0] if fallback else None
                    break
                child = self.mutate(child)
            if child is None:  # the whole space has been sampled
                break
            children.append(child)
            taken.add(child)
        return children
