"""Uniform random search without repeats: the baseline every other searcher must beat."""
from __future__ import annotations

from kerneltune.searchers.base import Searcher
from kerneltune.space import Config, SearchSpace


class RandomSearch(Searcher):
    name = "random"

    def __init__(self, space: SearchSpace, seed: int = 0, batch_size: int = 8):
        super().__init__(space, seed)
        self.batch_size = batch_size

    def _propose(self, n: int) -> list[Config]:
        return self.random_unsampled(n)
