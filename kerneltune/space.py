"""The search space every searcher and every schedule template shares.

A space is an ordered set of named knobs of three kinds, each with the topology OpEvo's mutation walks on
(ALGORITHMS.md section 2):

* :class:`FactorKnob` ``[product, n]``: ordered n-tuples of positive ints whose product is ``product``
  (a loop split into n levels).  Neighbours move one prime factor from slot i to slot j.
* :class:`DiscreteKnob`: sorted numbers; neighbours are the adjacent values.
* :class:`ChoiceKnob`: categorical; every other value is a neighbour (complete graph).

A config is a tuple with one value per knob, in knob order (hashable, so it is its own key).

A space may also carry constraints between knobs (:class:`ProductLimit`: a register tile's accumulators):
configs that break one are not points of the space - :meth:`SearchSpace.sample` never draws them,
:meth:`SearchSpace.neighbours` never steps onto them, :meth:`SearchSpace.contains` refuses them - so the
searchers spend no trial on a config the template would refuse anyway.  ``size()`` still counts the
unconstrained product (an upper bound).
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
    they get here - graphopt.limits.check_memory - so sqrt n stays small.)"""
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

# Draws before :meth:`SearchSpace.sample` gives up on satisfying the constraints (and returns the last draw).
SAMPLE_TRIES = 1000


@dataclass(frozen=True)
class ProductLimit:
    """The product of some factor-knob slots (``(knob name, slot index)``; a knob the space lacks counts 1),
    times ``scale``, must be at most ``limit``: e.g. a register tile's ``oc x rows x cols`` vector
    accumulators, which spill beyond the register file."""

    terms: tuple[tuple[str, int], ...]
    limit: int
    scale: int = 1

    def holds(self, values: dict[str, Any]) -> bool:
        product = self.scale
        for name, slot in self.terms:
            if name in values:
                product *= values[name][slot]
        return product <= self.limit


@dataclass
class SearchSpace:
    """Ordered knobs; configs are tuples of knob values."""

    knobs: list[Knob] = field(default_factory=list)
    constraints: tuple[ProductLimit, ...] = ()

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def size(self) -> int:
        total = 1
        for k in self.knobs:
            total *= len(k.values)
        return total

    def valid(self, config: Config) -> bool:
        """Whether ``config`` meets every constraint (its knob values are not checked here)."""
        if not self.constraints:
            return True
        values = self.as_dict(config)
        return all(c.holds(values) for c in self.constraints)

    def sample(self, rng: random.Random) -> Config:
        """A uniformly random valid config (rejection sampling; without constraints one draw per knob)."""
        for _ in range(SAMPLE_TRIES):
            config = tuple(rng.choice(k.values) for k in self.knobs)
            if self.valid(config):
                break
        return config

    def neighbours(self, config: Config, knob: int) -> list[Value]:
        """The knob's neighbouring values that keep ``config`` valid."""
        out = self.knobs[knob].neighbours(config[knob])
        if not self.constraints:
            return out
        return [v for v in out if self.valid(config[:knob] + (v,) + config[knob + 1:])]

    def as_dict(self, config: Config) -> dict[str, Any]:
        return {k.name: v for k, v in zip(self.knobs, config)}

    def from_dict(self, d: dict[str, Any]) -> Config:
        """Inverse of :meth:`as_dict` (JSON turns tuples into lists; turn them back)."""
        return tuple(tuple(d[k.name]) if isinstance(d[k.name], list) else d[k.name] for k in self.knobs)

    def contains(self, config: Config) -> bool:
        return len(config) == len(self.knobs) and all(
            (tuple(v) if isinstance(v, list) else v) in k.values for k, v in zip(self.knobs, config)) and self.valid(
            tuple(config))

    @property
    def factor_only(self) -> bool:
        """G-BFS and N-A2C are defined on factor knobs only."""
        return all(isinstance(k, FactorKnob) for k in self.knobs)
