"""A masked write-back split into its whole tiles and the rest: the mask tested once per tile, not per lane.

A kernel whose vector axis is symbolic (attention's ``Q K^T`` in a build serving a range of lengths:
:mod:`pipeline.symbolic`) is computed in padded register tiles and written back under a block predicate
(``j < sequence``) on the vector lanes.  TVM's vectorizer cannot vectorize a store guarded by a condition
on the lane, so it emits the whole write-back scalar, every tile, including the tiles that lie inside the
output (all of them at 384 tokens).  BERT-base served at 384 tokens on an Intel Xeon (2 threads): its
``Q K^T`` + mask kernel took 1.9 ms against 1.0 for a static build's; with the predicate removed, 1.0.

:func:`hoist` rewrites each such write-back nest into ``if <the whole tile is inside> { the nest without
the predicate } else { the nest as it was }``.  The whole-tile condition is the predicate at the nest's last
iteration, derived term by term only where that is sound: a term free of the nest's loops stays, a bound
``a < b`` whose left side provably grows with those loops is tested at their ends, and a disjunction keeps
its loop-free side (a stronger test, never a weaker one).  Any other term leaves the nest as it is.  The
kernel computes what it did; the whole tiles run in vectors.

TVM 0.27's Python has no statement mutator, so the nest is rebuilt node by node
(:func:`kerneltune.tir_rewrite.rewrite_stmts`), and the copy's loop and block variables are new ones, substituted
through the analyzer (``bind``), so that each is defined once.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from ..tir_rewrite import rewrite_stmts


def hoist(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every predicated vector write-back nest split into whole tiles and the rest."""
    body, changed = rewrite_stmts(func.body, lambda s: _split_nest(s) if isinstance(s, tirx.For) else None)
    return func.with_body(body) if changed else func


def _split_nest(top: tirx.For):
    """The ``if whole-tile`` statement for a perfect loop nest ending in a vectorized loop over one predicated
    block whose predicate reads the vector lane; None for any other nest."""
    loops, s = [], top
    while isinstance(s, tirx.For):
        loops.append(s)
        s = s.body
    if not (isinstance(s, s_tir.SBlockRealize) and loops[-1].kind == tirx.ForKind.VECTORIZED):
        return None
    lane = loops[-1].loop_var
    if not any(v.same_as(lane) for v in tirx.analysis.undefined_vars(s.predicate)):
        return None
    whole = _whole_condition(s.predicate, loops)
    if whole is None:
        return None
    block = s.block
    if not isinstance(block.body, tirx.BufferStore) or block.init is not None or block.alloc_buffers:
        return None  # a write-back is one store; anything else is left as it is
    # the copy's loops and block iterators take new variables (each variable is defined once in a kernel),
    # substituted into its iterator values, regions and store (the analyzer binds each old variable to its new)
    loop_vars, iter_vars = tvm.sym.Analyzer(), tvm.sym.Analyzer()
    renamed = []
    for loop in loops:
        var = tirx.Var(f"{loop.loop_var.name}_whole", loop.loop_var.ty)
        loop_vars.bind(loop.loop_var, var)
        renamed.append((loop, var))
    ivs = []
    for iv in block.iter_vars:
        var = tirx.Var(f"{iv.var.name}_whole", iv.var.ty)
        iter_vars.bind(iv.var, var)
        ivs.append(tirx.IterVar(iv.dom, var, iv.iter_type, iv.thread_tag))
    sub = iter_vars.simplify
    regions = lambda rs: [type(r)(r.source, [tvm.ir.Range.from_min_extent(sub(x.min), sub(x.extent))  # noqa: E731
                                             for x in r.region], r.ty) for r in rs]
    store = block.body
    copy = s_tir.SBlock(iter_vars=ivs, reads=regions(block.reads), writes=regions(block.writes),
                        name_hint=block.name_hint,
                        body=tirx.BufferStore(store.buffer, sub(store.value), [sub(i) for i in store.indices]),
                        annotations=block.annotations)
    inner = s_tir.SBlockRealize([loop_vars.simplify(v) for v in s.iter_values], tirx.const(True, "bool"), copy)
    for loop, var in reversed(renamed):
        inner = tirx.For(var, loop.min, loop.extent, loop.kind, inner, loop.thread_binding, loop.annotations)
    return tirx.IfThenElse(whole, inner, top)


def _whole_condition(predicate, loops: list[tirx.For]):
    """A condition free of ``loops`` under which ``predicate`` holds at every iteration of them (None when
    one of its terms has no such form)."""
    inner = [loop.loop_var for loop in loops]
    ranges = tvm.sym.Analyzer()
    last = tvm.sym.Analyzer()
    for loop in loops:
        ranges.bind(loop.loop_var, tvm.ir.Range.from_min_extent(loop.min, loop.extent))
        last.bind(loop.loop_var, loop.min + loop.extent - 1)

    def free(e) -> bool:
        return not any(v.same_as(u) for v in tirx.analysis.undefined_vars(e) for u in inner)

    def term(c):
        if free(c):
            return c
        if isinstance(c, tirx.Or):
            return c.a if free(c.a) else c.b if free(c.b) else None
        if isinstance(c, (tirx.LT, tirx.LE)) and free(c.b):
            at_end = last.simplify(c.a)
            if free(at_end) and ranges.can_prove(c.a <= at_end):
                return type(c)(at_end, c.b)
        return None

    conjuncts, stack = [], [predicate]
    while stack:
        c = stack.pop()
        if isinstance(c, tirx.And):
            stack += [c.a, c.b]
        else:
            conjuncts.append(c)
    kept = [term(c) for c in conjuncts]
    if any(k is None for k in kept):
        return None
    out = kept[0]
    for k in kept[1:]:
        out = tirx.And(out, k)
    return tvm.sym.Analyzer().simplify(out)
