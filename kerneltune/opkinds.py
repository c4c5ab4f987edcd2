"""The tunable operator kinds: the one table every stage reads (CLI options and checks, task selection,
reports).  Importing it loads no TVM, so the CLIs validate ``--op`` / ``--shape`` / ``--kernels`` at once.

What a kind *is* lives next to it: :mod:`kerneltune.task` recognises it in a fused PrimFunc
(``_classify_*``) and builds a standalone one (``_BUILDERS``); the templates schedule it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from graphopt.errors import UserError


@dataclass(frozen=True)
class OpKind:
    name: str
    shape: str  # the SHAPE of a standalone task, e.g. "M,K,N" (A is MxK, B is KxN)
    options: tuple[str, ...] = ()  # the standalone options that apply to it (tune-kernels --transpose-a ...)

    @property
    def arity(self) -> int:
        return len(self.shape.split(","))


OP_KINDS: dict[str, OpKind] = {k.name: k for k in (
    OpKind("matmul", "M,K,N", ("transpose_a", "transpose_b")),
    OpKind("batch_matmul", "B,M,K,N", ("transpose_a", "transpose_b")),
    OpKind("conv2d", "N,C,H,W,F,KH,KW", ("stride", "pad", "groups")),
)}
KINDS = tuple(OP_KINDS)
# Kinds only met in a model's fused kernels, as a layout of an op kind (no standalone --op of their own):
# ``--kernels conv2d`` selects them too.  conv2d_nchwc: :mod:`kerneltune.templates.conv_nchwc`; conv2d_nhwc: an
# int8 conv as an implicit GEMM (:mod:`kerneltune.templates.int8`).
VARIANTS: dict[str, str] = {"conv2d_nchwc": "conv2d", "conv2d_nhwc": "conv2d"}


def base_kind(kind: str) -> str:
    """The op kind a task kind belongs to (``conv2d_nchwc`` -> ``conv2d``; others are their own)."""
    return VARIANTS.get(kind, kind)


def op_kind(name: str) -> OpKind:
    if name not in OP_KINDS:
        raise UserError(f"unknown op {name!r}; use one of {', '.join(KINDS)}")
    return OP_KINDS[name]


def parse_shape(kind: str, shape: str | Sequence[int]) -> tuple[int, ...]:
    """``"128,768,768"`` -> (128, 768, 768), checking the arity of ``kind``'s SHAPE."""
    k = op_kind(kind)
    try:
        dims = tuple(int(s) for s in shape.split(",")) if isinstance(shape, str) else tuple(int(s) for s in shape)
    except ValueError:
        raise UserError(f"bad shape {shape!r}: comma-separated integers expected") from None
    if len(dims) != k.arity or min(dims) <= 0:
        raise UserError(f"bad shape {shape!r} for {kind}: expected {k.arity} positive integers {k.shape}")
    return dims


def operand_shapes(kind: str, dims: Sequence[int], stride: int = 1, pad: int = 0,
                   groups: int = 1) -> dict[str, tuple[int, ...]]:
    """The operand and result shapes of a standalone ``kind`` task (for the memory estimate), checking
    that a conv2d's options make sense for its shape."""
    if kind == "matmul":
        m, k, n = dims
        return {"A": (m, k), "B": (k, n), "C": (m, n)}
    if kind == "batch_matmul":
        b, m, k, n = dims
        return {"A": (b, m, k), "B": (b, k, n), "C": (b, m, n)}
    n, c, h, w, f, kh, kw = dims
    if stride < 1 or pad < 0 or groups < 1:
        raise UserError(f"conv2d needs --stride >= 1, --pad >= 0 and --groups >= 1 (got {stride}, {pad}, {groups})")
    if c % groups or f % groups:
        raise UserError(f"conv2d --groups {groups} must divide both C={c} and F={f}")
    oh, ow = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    if oh < 1 or ow < 1:
        raise UserError(f"conv2d kernel {kh}x{kw} is larger than the padded input {h + 2 * pad}x{w + 2 * pad}: "
                        "give a smaller KH,KW or more --pad")
    return {"data": (n, c, h, w), "weight": (f, c // groups, kh, kw), "output": (n, f, oh, ow)}
