"""The search space every searcher and every schedule template shares.

A space is an ordered set of named knobs of three kinds, each with the topology OpEvo's mutation walks on
(ALGORITHMS.md section 2):

* :class:`FactorKnob` ``[product, n]``: ordered n-tuples of positive ints whose product is ``product``
  (a loop split into n levels).  Neighbours move one prime factor from slot i to slot j.
* :class:`DiscreteKnob`: sorted numbers; neighbours are the adjacent values.
* :class:`ChoiceKnob`: categorical; every other value is a neighbour (complete graph).

A config is a tuple with one value per knob, in knob order (hashable, so it is its own key).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Union

Value = Any
Config = tuple  # one value per knob, knob order


def prime_factors(n: int) -> list[int]:
    """Prime factors of n with multiplicity, ascending."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, built from its prime factors: O(sqrt n) for the factoring instead of a
    scan of 1..n, which spun for minutes on a 99999999999-long axis.  (Extents are bounded by memory before
    they get here - graphopt.validate.check_memory - so sqrt n stays small.)"""
    out = [1]
    factors = prime_factors(n)
    for p in sorted(set(factors)):
        out = [d * p**k for d in out for k in range(factors.count(p) + 1)]
    return sorted(out)


def factorizations(product: int, n: int) -> list[tuple[int, ...]]:
    """All ordered n-tuples of positive ints whose product is ``product``."""
    if n == 1:
        return [(product,)]
    return [(d,) + rest for d in divisors(product) for rest in factorizations(product // d, n - 1)]


@dataclass(frozen=True)
class FactorKnob:
    """Split of a loop of extent ``product`` into ``n`` ordered factors (outermost first)."""

    name: str
    product: int
    n: int

    @cached_property
    def values(self) -> list[tuple[int, ...]]:
        return factorizations(self.product, self.n)

    def neighbours(self, v: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Move one prime factor p of slot i to slot j (i != j)."""
        out = []
        for i, vi in enumerate(v):
            for p in sorted(set(prime_factors(vi))):  # a fixed order: searchers replay exactly
                for j in range(self.n):
                    if j != i:
                        w = list(v)
                        w[i] //= p
                        w[j] *= p
                        out.append(tuple(w))
        return out

    def untiled(self) -> tuple[int, ...]:
        """``[product, 1, ..., 1]``: the start point of G-BFS."""
        return (self.product,) + (1,) * (self.n - 1)


@dataclass(frozen=True)
class DiscreteKnob:
    """An ordered numeric knob (e.g. unroll depth); neighbours are the adjacent values."""

    name: str
    values: tuple[int | float, ...]

    def neighbours(self, v: Value) -> list[Value]:
        i = self.values.index(v)
        return [self.values[j] for j in (i - 1, i + 1) if 0 <= j < len(self.values)]


@dataclass(frozen=True)
class ChoiceKnob:
    """A categorical knob (e.g. which loop to vectorize); every other value is a neighbour."""

    name: str
    values: tuple[Any, ...]

    def neighbours(self, v: Value) -> list[Value]:
        return [x for x in self.values if x != v]


Knob = Union[FactorKnob, DiscreteKnob, ChoiceKnob]


@dataclass
class SearchSpace:
    """Ordered knobs; configs are tuples of knob values."""

    knobs: list[Knob] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def size(self) -> int:
        total = 1
        for k in self.knobs:
            total *= len(k.values)
        return total

    def sample(self, rng: random.Random) -> Config:
        return tuple(rng.choice(k.values) for k in self.knobs)

    def neighbours(self, config: Config, knob: int) -> list[Value]:
        return self.knobs[knob].neighbours(config[knob])

    def as_dict(self, config: Config) -> dict[str, Any]:
        return {k.name: v for k, v in zip(self.knobs, config)}

    def from_dict(self, d: dict[str, Any]) -> Config:
        """Inverse of :meth:`as_dict` (JSON turns tuples into lists; turn them back)."""
        return tuple(tuple(d[k.name]) if isinstance(d[k.name], list) else d[k.name] for k in self.knobs)

    def contains(self, config: Config) -> bool:
        return len(config) == len(self.knobs) and all(
            (tuple(v) if isinstance(v, list) else v) in k.values for k, v in zip(self.knobs, config))

    @property
    def factor_only(self) -> bool:
        """G-BFS and N-A2C are defined on factor knobs only."""
        return all(isinstance(k, FactorKnob) for k in self.knobs)
