"""Register tiles past a symbolic end skipped: a kernel serving a range of lengths computes no padding tile.

A kernel whose rows are symbolic (:mod:`pipeline.symbolic`) is scheduled with the tiles of its instance at a
representative length, its rows padded to a whole number of its fixed tiles (``cpu._symbolic_tiles``): the
register tile (S3) and the tiles repeated down the rows inside one k-block (S2, ``matmul_row_repeat``).  At a
length under S2 x S3 rows that padding is computed as if it were rows: GPT-2 served over 2..512 tokens, run at
8, computed 16 rows in each of its matmuls (S2 = 2, S3 = 8 on an Intel Xeon; S2 = 4 would be 32 on a Zen 5);
its LM head (8 x 768 x 50272) took 15.0-17.0 ms against 10.4-14.6 for the static kernel of 8 rows.

:func:`guard` wraps the body of that S2 loop in ``if <the tile's first row> < <the length>``: a tile wholly
past the end is skipped (its rows are cropped at the write-back, so nothing reads what it would have
computed).  The test is one comparison per tile and k-block, outside the register tile's loops.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from ..tir_rewrite import rebuilt_loop, rewrite_stmts


def guard(func: tirx.PrimFunc, loop_var: tirx.Var, axis: int, extent) -> tirx.PrimFunc:
    """``func`` with the body of the loop over ``loop_var`` (an S2 loop of a symbolic spatial axis) run only for
    tiles whose first index along the anchor's iterator ``axis`` is below ``extent`` (the axis' length)."""
    def wrap(stmt):
        if not (isinstance(stmt, tirx.For) and stmt.loop_var.same_as(loop_var)):
            return None
        first = _first_index(stmt.body, axis)
        if first is None:
            return stmt  # not the nest it was scheduled as: left as it is
        return rebuilt_loop(stmt, tirx.IfThenElse(first < extent, stmt.body, None))

    body, changed = rewrite_stmts(func.body, wrap)
    return func.with_body(body) if changed else func


def _first_index(body, axis: int):
    """The anchor block's ``axis`` binding at the first iteration of the loops between the guarded loop and
    the block (a perfect nest), or None when ``body`` is not such a nest."""
    inner = tvm.sym.Analyzer()
    s = body
    while isinstance(s, tirx.For):
        inner.bind(s.loop_var, s.min)
        s = s.body
    if not isinstance(s, s_tir.SBlockRealize) or axis >= len(s.iter_values):
        return None
    return inner.simplify(s.iter_values[axis])
