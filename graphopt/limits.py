"""What this machine allows one run, checked before any long work: a thread count, and the memory a set of
tensors needs against this machine's memory (a 1e6 x 1e6 MatMul or a 130 GB Expand is refused up front
instead of being attempted).

No ONNX and no TVM here: :mod:`graphopt.validate` sizes a model's tensors and checks them with
:func:`check_memory`; kerneltune's single-operator mode checks an operator's shapes and its ``--threads`` /
``--workers`` without loading the ONNX importer.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphopt.errors import UserError


def check_threads(threads: int | None, option: str = "--threads") -> int | None:
    """A positive thread count this machine can sensibly run (a huge one makes TVM's pool and onnxruntime
    start that many threads); None stays None (the caller's default)."""
    limit = 4 * (os.cpu_count() or 1)
    if threads is not None and not 1 <= threads <= limit:
        raise UserError(f"{option} {threads}: give a number from 1 to {limit} (4 x this machine's cores)")
    return threads


@dataclass(frozen=True)
class TensorSize:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "weight" | "input" | "value"

    @property
    def bytes(self) -> int:
        itemsize = 1 if self.dtype == "bool" else np.dtype(self.dtype).itemsize if self.dtype != "bfloat16" else 2
        return math.prod(self.shape) * itemsize


def memory_limit_bytes() -> int:
    """This machine's memory for one process: physical memory, or the cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def format_bytes(n: int) -> str:
    """``1.5 GB`` / ``120 MB``: a size in the refusals' words."""
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def check_memory(sizes: list[TensorSize], limit: int | None = None, hint: str = "pass smaller --input-shape "
                 "values") -> int:
    """Refuse a model whose tensors cannot fit this machine's memory; returns the estimate in bytes.

    The estimate is a lower bound on the peak of any run: every weight and input, plus the largest other
    tensor twice (an operator reads at least one tensor while it writes another; runtimes reuse the rest).
    A model above it would be killed by the kernel's OOM killer after minutes of work, or spin in loops
    over impossible extents."""
    limit = limit or memory_limit_bytes()
    if not sizes:
        return 0
    biggest = max(sizes, key=lambda t: t.bytes)
    if biggest.bytes > limit:
        raise UserError(f"tensor {biggest.name!r} of shape {list(biggest.shape)} ({biggest.dtype}) alone needs "
                        f"{format_bytes(biggest.bytes)}, more than this machine's {format_bytes(limit)} of memory: "
                        f"{hint}, or check the model's sizes")
    fixed = sum(t.bytes for t in sizes if t.kind in ("weight", "input"))
    values = [t for t in sizes if t.kind == "value"]
    largest = max((t.bytes for t in values), default=0)
    need = fixed + 2 * largest
    if need > limit:
        raise UserError(f"the model needs at least {format_bytes(need)} of memory (weights and inputs "
                        f"{format_bytes(fixed)}, largest intermediate {format_bytes(largest)} twice), more than this "
                        f"machine's {format_bytes(limit)}: {hint}")
    return need
