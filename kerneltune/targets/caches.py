"""The data caches a target's kernels are blocked for, and the cache budgets every CPU template derives its
blocks from: one place, so a CPU with another L1 or L2 gets other blocks without a constant edited.

The sizes come from the OS (Linux's sysfs: size and the CPUs sharing each cache) when the target's code runs
on this machine; a build for another machine (a cross build, an ``-mcpu`` this CPU cannot run) gets
:data:`PORTABLE`, the smallest caches of the x86 cores in service, so the same command builds the same
kernels wherever it is run from (as :mod:`kerneltune.calibrate` does for what it measures).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tvm

CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
CACHE_LINE = 64


@dataclass(frozen=True)
class Caches:
    """Bytes of each data cache one core can count on: a cache shared by several cores (an L3; an L2 shared
    by a cluster of efficiency cores) divided among them."""
    l1d: int
    l2: int
    l3: int


# 32 KiB L1d (Skylake, Zen 2-4), 1 MiB L2 (Skylake-SP, Zen 4-5), 2 MiB of L3 a core (Skylake-SP, Zen 5 server)
PORTABLE = Caches(l1d=32 * 2**10, l2=2**20, l3=2 * 2**20)


def _size(text: str) -> int:
    return int(text[:-1]) * _SIZE_UNITS[text[-1]] if text[-1] in _SIZE_UNITS else int(text)


def _cpus(cpu_list: str) -> int:
    """CPUs in a sysfs list (``0-3,8-11`` -> 8)."""
    count = 0
    for part in cpu_list.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def _levels(root: Path) -> list[tuple[str, int, int]]:
    """(name, bytes, CPUs sharing it) of each cache of the first core: ``("L1d", 49152, 1)``."""
    out = []
    for index in sorted(root.glob("index*")):
        level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        shared = index / "shared_cpu_list"
        sharers = _cpus(shared.read_text().strip()) if shared.exists() else 1
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        out.append((f"L{level}{suffix}", _size(size), sharers))
    return out


def host_caches(root: Path = CACHE_DIR) -> dict[str, int]:
    """The first core's caches in bytes by level (``{"L1d": 49152, "L1i": 32768, "L2": 2097152, ...}``), as
    Linux's sysfs lists them ({} elsewhere): a latency means little without them (a model whose weights fit
    in L2 on one CPU and not on another)."""
    try:
        return {name: size for name, size, _ in _levels(root)}
    except (OSError, ValueError):
        return {}


def read_caches(root: Path = CACHE_DIR) -> Caches | None:
    """This machine's per-core shares (:class:`Caches`), or None where the OS does not say (or leaves out a
    level: a cache this machine lacks is not guessed)."""
    try:
        share = {name: size // max(1, sharers) for name, size, sharers in _levels(root)}
    except (OSError, ValueError):
        return None
    if not {"L1d", "L2"} <= share.keys():
        return None
    return Caches(l1d=share["L1d"], l2=share["L2"], l3=share.get("L3", 0))


@lru_cache(maxsize=None)
def _host() -> Caches:
    return read_caches(CACHE_DIR) or PORTABLE


def target_caches(target: "tvm.target.Target") -> Caches:
    """The caches ``target``'s kernels run with: this machine's where its code runs here, else
    :data:`PORTABLE`."""
    from .host import runs_here

    return _host() if runs_here(target) else PORTABLE


# ---------------------------------------------------------------------------------------- the derived budgets
# Fitted on two CPUs with a 48 KiB L1d (an Intel Xeon and a Zen 5), where the templates' blocks were swept.

def l1_block_bytes(target: "tvm.target.Target") -> int:
    """Bytes of L1 that one k-block's operand panels may take: a third of L1d, the rest left to the other
    operand's rows, the write-back tile and the lines the prefetchers bring (16 KiB on a 48 KiB L1d, where
    the matmul's and the NCHW[x]c conv's blocks were measured)."""
    return target_caches(target).l1d // 3


def k_block_depth(target: "tvm.target.Target") -> int:
    """Reduction depth of one fp32 k-block: the depth at which a panel as wide as the widest register tile
    row (4 cache lines: 64 fp32 lanes of AVX-512) fills :func:`l1_block_bytes` (64 on a 48 KiB L1d)."""
    return max(8, l1_block_bytes(target) // (4 * CACHE_LINE))

