"""G-BFS (Zhang et al., "Compiler-Level Matrix Multiplication Optimization for Deep Learning", Alg. 1).

Greedy best-first search on the factor-move graph: start from the untiled config ``[product, 1, ..., 1]``,
then repeatedly pop the best measured config that has not been expanded and measure ``rho`` random
unvisited neighbours of it (a neighbour moves one prime factor between two tile levels of one knob).
When every measured config is expanded (the reachable graph is exhausted) the search continues with random
unvisited configs, so a trial budget is always used up.

Warm start: a searcher that has observed configs before its first proposal (the template's default, given
to every searcher alike by :func:`kerneltune.tune.tune`) starts by expanding the best of them instead of
measuring the untiled start, which is only the paper's start point for lack of a better one.
"""
from __future__ import annotations

import heapq

from kerneltune.searchers.base import Searcher, require_factor_only, untiled
from kerneltune.space import Config, SearchSpace


class GBFS(Searcher):
    name = "gbfs"

    def __init__(self, space: SearchSpace, seed: int = 0, rho: int = 5):
        require_factor_only(space, self.name)
        super().__init__(space, seed)
        self.rho = rho
        self.batch_size = rho
        self.start = untiled(space)
        self._queue: list[tuple[float, int, Config]] = []   # (-fitness, arrival, config), unexpanded only
        self._arrivals = 0

    def _observe(self, configs: list[Config], results: list[float]) -> None:
        for c, r in zip(configs, results):
            self._arrivals += 1
            heapq.heappush(self._queue, (-r, self._arrivals, c))

    def neighbours(self, config: Config) -> list[Config]:
        """All configs one prime-factor move away, across every knob."""
        out = []
        for i in range(len(config)):
            for v in self.space.neighbours(config, i):
                out.append(config[:i] + (v,) + config[i + 1:])
        return list(dict.fromkeys(out))

    def _propose(self, n: int) -> list[Config]:
        if not self.fitness and self.start not in self.sampled:
            return [self.start]              # measure s0 first (no warm start); expansion needs its result
        out: list[Config] = []
        while len(out) < n and self._queue:
            _, _, s = heapq.heappop(self._queue)
            fresh = [c for c in self.neighbours(s) if c not in self.sampled and c not in out]
            out.extend(self.rng.sample(fresh, min(self.rho, n - len(out), len(fresh))))
        if len(out) < n and not self._queue:
            out.extend(self.random_unsampled(n - len(out), exclude=set(out)))
        return out
