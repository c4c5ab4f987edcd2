"""A reshape over a symbolic size legalized as groups of dimensions, so its kernel indexes without dividing.

TOPI's reshape flattens the output index and unflattens it into the input's shape.  Over fixed sizes the
arithmetic simplifier folds those divisions away; over a symbolic size ``n`` (a build serving a range of
lengths, :mod:`pipeline.symbolic`) it cannot (it has no rule for ``x % n`` with ``0 <= x < n``), so the
attention heads' reshape of ``(1, n, 384)`` to ``(1, n, 12, 32)`` read ``x[0, ((h * 32 + d) // 384 + t) % n, ...]``.
AnnotateTIROpPattern then calls it opaque and nothing fuses with it; fused anyway, the keys' reshape,
transpose, reshape, transpose chain divided by ``n`` several times per element: MiniLM served at 384 tokens
(Intel Xeon, 2 threads) spent 0.79 ms per layer there, against 0.14 for a build of that length.

Most reshapes of a transformer split or merge neighbouring dimensions of fixed size and carry each symbolic
dimension over unchanged: ``(1, n, 384) -> (1, n, 12, 32)``, ``(1, 12, n, 32) -> (12, n, 32)``.  Such a
reshape is a list of groups, each a run of input dimensions and a run of output dimensions of the same size;
the kernel indexes each group on its own (fixed sizes: divisions by constants, which fold; a symbolic
dimension alone in its group: the same index).  Its kernel is then injective to fusion as the fixed-size one
is.  Any other reshape keeps TOPI's legalization.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx

LEGALIZE = "FLegalize"


def groups(src: list, dst: list) -> list[tuple[list[int], list[int]]] | None:
    """The groups of a reshape from ``src`` to ``dst`` (TIR extents): (input dims, output dims) per group, every
    dimension of size 1 left out (its index is 0), or None when a symbolic dimension is not carried alone."""
    a = [i for i, d in enumerate(src) if not _is(d, 1)]
    b = [j for j, d in enumerate(dst) if not _is(d, 1)]
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        x, y = src[a[i]], dst[b[j]]
        if not isinstance(x, tirx.IntImm) or not isinstance(y, tirx.IntImm):
            if not tvm.sym.Analyzer().can_prove_equal(x, y):
                return None
            out.append(([a[i]], [b[j]]))
            i, j = i + 1, j + 1
            continue
        gi, gj, pi, pj = [a[i]], [b[j]], int(x), int(y)
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                if i >= len(a) or not isinstance(src[a[i]], tirx.IntImm):
                    return None
                gi.append(a[i])
                pi *= int(src[a[i]])
                i += 1
            else:
                if j >= len(b) or not isinstance(dst[b[j]], tirx.IntImm):
                    return None
                gj.append(b[j])
                pj *= int(dst[b[j]])
                j += 1
        out.append((gi, gj))
    return out if i == len(a) and j == len(b) else None


def _is(extent, value: int) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == value


def grouped_reshape(x: te.Tensor, shape: list, plan: list[tuple[list[int], list[int]]]) -> te.Tensor:
    """``x`` reshaped to ``shape`` group by group (``plan``: :func:`groups`)."""
    src = list(x.shape)

    def read(*index):
        where = [tirx.const(0, "int64")] * len(src)
        for gi, gj in plan:
            if len(gi) == 1 and len(gj) == 1:
                where[gi[0]] = index[gj[0]]
                continue
            flat = tirx.const(0, "int64")
            for j in gj:
                flat = flat * int(shape[j]) + index[j]
            for k, i in enumerate(gi):
                inner = math.prod(int(src[m]) for m in gi[k + 1:])
                value = tirx.floordiv(flat, inner) if inner > 1 else flat
                where[i] = tirx.floormod(value, int(src[i])) if k > 0 else value
        return x(*where)

    return te.compute(shape, read, name="T_reshape", tag="injective")


def legalize_reshape(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """LegalizeOps' rule for ``relax.reshape``: :func:`grouped_reshape` where the shape is symbolic and the
    reshape is groups of dimensions, else TOPI's."""
    x = call.args[0]
    src = list(getattr(getattr(x.ty, "shape", None), "values", None) or [])
    dst = list(getattr(getattr(call.ty, "shape", None), "values", None) or [])
    static = all(isinstance(d, tirx.IntImm) for d in src + dst)
    plan = None if static or not src or not dst else groups(src, dst)
    if plan is None:
        return tvm.ir.Op.get("relax.reshape").get_attr(LEGALIZE)(bb, call)
    return bb.call_te(grouped_reshape, x, dst, plan, primfunc_name_hint="reshape")
