"""Searchers behind one interface, and a registry so comparing them is one line:
``make_searcher("opevo", space, seed=0)``.

``fixed=`` lets G-BFS / N-A2C (factor knobs only) run on a space with other knobs: they search the factor
knobs while the others stay at the given config (typically the template's ``default_config``).
"""
from __future__ import annotations

from typing import Any

from graphopt.errors import UserError
from kerneltune.searchers.base import Searcher
from kerneltune.searchers.fixed import FixedKnobs
from kerneltune.searchers.gbfs import GBFS
from kerneltune.searchers.na2c import NA2C
from kerneltune.searchers.opevo import OpEvo
from kerneltune.searchers.random_search import RandomSearch
from kerneltune.space import Config, SearchSpace

SEARCHERS: dict[str, type[Searcher]] = {c.name: c for c in (OpEvo, GBFS, NA2C, RandomSearch)}
FACTOR_ONLY = {"gbfs", "na2c"}


def check_searcher(name: str) -> None:
    """The one check of a searcher name (the CLIs, the Python API and :func:`make_searcher` call it)."""
    if name not in SEARCHERS:
        raise UserError(f"unknown searcher {name!r}; use one of {', '.join(sorted(SEARCHERS))}")


def make_searcher(name: str, space: SearchSpace, seed: int = 0, fixed: Config | None = None,
                  **opts: Any) -> Searcher:
    """Build searcher ``name``; with ``fixed`` and a factor-only searcher, non-factor knobs stay at ``fixed``."""
    check_searcher(name)
    cls = SEARCHERS[name]
    if name in FACTOR_ONLY and fixed is not None and not space.factor_only:
        return FixedKnobs(space, fixed, lambda sub: cls(sub, seed, **opts), seed)
    return cls(space, seed, **opts)


__all__ = ["FACTOR_ONLY", "SEARCHERS", "FixedKnobs", "GBFS", "NA2C", "OpEvo", "RandomSearch", "Searcher",
           "check_searcher", "make_searcher"]
