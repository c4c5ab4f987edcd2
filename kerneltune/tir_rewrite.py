"""Statements of a TIR function rebuilt where a rewrite changes them: TVM 0.27's Python has no statement
mutator.  Used on scheduled kernels (the templates' post-passes: :mod:`.templates.common`'s padded-read clamp,
:mod:`.templates.prefetch`, :mod:`.templates.full_tiles`) and on lowered ones (:mod:`.stack_locals`)."""
from __future__ import annotations

from tvm import s_tir, tirx


def rewrite_stmts(stmt, replace):
    """``(stmt rebuilt along the paths to the statements ``replace`` rewrites, whether any was)``.  ``replace``
    returns a statement's replacement, or None to search inside it: a loop's, a block's or an attribute's body,
    each statement of a sequence, both branches of a condition.  Other statements are searched no further."""
    new = replace(stmt)
    if new is not None:
        return new, True
    if isinstance(stmt, tirx.For):
        body, changed = rewrite_stmts(stmt.body, replace)
        return (rebuilt_loop(stmt, body), True) if changed else (stmt, False)
    if isinstance(stmt, tirx.SeqStmt):
        seq = [rewrite_stmts(s, replace) for s in stmt.seq]
        return (tirx.SeqStmt([s for s, _ in seq]), True) if any(c for _, c in seq) else (stmt, False)
    if isinstance(stmt, s_tir.SBlockRealize):
        body, changed = rewrite_stmts(stmt.block.body, replace)
        return (rebuilt_realize(stmt, body), True) if changed else (stmt, False)
    if isinstance(stmt, tirx.AttrStmt):
        body, changed = rewrite_stmts(stmt.body, replace)
        return (tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body, stmt.span), True) if changed \
            else (stmt, False)
    if isinstance(stmt, tirx.IfThenElse):
        then, c1 = rewrite_stmts(stmt.then_case, replace)
        other, c2 = rewrite_stmts(stmt.else_case, replace) if stmt.else_case is not None else (None, False)
        return (tirx.IfThenElse(stmt.condition, then, other, stmt.span), True) if c1 or c2 else (stmt, False)
    return stmt, False


def rebuilt_loop(loop: tirx.For, body) -> tirx.For:
    """``loop`` over ``body``."""
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, loop.annotations)


def rebuilt_realize(realize: s_tir.SBlockRealize, body, predicate=None) -> s_tir.SBlockRealize:
    """``realize``'s block over ``body`` (under ``predicate``, else its own)."""
    b = realize.block
    block = s_tir.SBlock(iter_vars=b.iter_vars, reads=b.reads, writes=b.writes, name_hint=b.name_hint, body=body,
                         init=b.init, alloc_buffers=b.alloc_buffers, match_buffers=b.match_buffers,
                         annotations=b.annotations)
    return s_tir.SBlockRealize(realize.iter_values, realize.predicate if predicate is None else predicate, block)
