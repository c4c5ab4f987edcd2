"""Facts about the CPU that a template's default needs and no description of the CPU gives: measured once per
CPU and target, cached with the other per-CPU prices, read back ever after (the same command makes the same
build).  A target this machine cannot run (a cross build, an ``-mcpu`` with features this CPU lacks) is not
measured: it gets the template's static choice.

This module owns the cache and the rule for when to measure; each template owns what it measures (the
matmul rows tile: :func:`kerneltune.templates.cpu.time_row_repeats`), so nothing here imports a template.
"""
from __future__ import annotations

import logging
from typing import Callable

from kerneltune.targets.host import runs_here

log = logging.getLogger(__name__)

# 2: the matmul register tile grew to 24 accumulators on AVX-512 (the rows tile is measured with it)
VERSION = 2


def target_key(target) -> str:
    """What a measurement depends on besides the host CPU: the code's CPU and features and the threads."""
    from kerneltune.targets.host import num_cores

    attrs = target.attrs
    mattr = ",".join(str(a) for a in attrs["mattr"]) if "mattr" in attrs else ""
    return f"{attrs['mcpu'] if 'mcpu' in attrs else ''}|{mattr}|t{num_cores(target)}"


# (fact, target key) -> value, for this process: default configs are asked for thousands of times.
_VALUES: dict[tuple[str, str], int] = {}


def calibrated(fact: str, target, static: int, measure: Callable[[object], int]) -> int:
    """The value of ``fact`` for ``target``: read from the cache, else ``measure(target)``-d now and cached;
    ``static`` when the target does not run here."""
    if not runs_here(target):
        return static
    key = (fact, target_key(target))
    if key not in _VALUES:
        _VALUES[key] = _read_or_measure(fact, key[1], lambda: measure(target))
    return _VALUES[key]


def _read_or_measure(fact: str, key: str, measure: Callable[[], int]) -> int:
    from graphopt.cost.cache import CostCache, cache_dir, whole
    from kerneltune.targets.host import host_cpu

    cache = CostCache(cache_dir() / f"calibration-{host_cpu()}.json")
    entry = f"v{VERSION}|{fact}|{key}"
    hit = cache.get(entry, whole)  # a value of another shape (an edited file) is measured again
    if hit is not None:
        return int(hit)
    value = int(measure())
    cache.put(entry, float(value))
    cache.flush()
    log.info("calibrated %s for %s: %s", fact, key, value)
    return value
