"""Run one of our Relax call rewrites (a ``PyExprMutator``) over every Relax function of a module: the body
of the module passes that swap an operator for a vectorizable TE version before LegalizeOps
(:mod:`pipeline.fast_sigmoid`, :mod:`pipeline.lane_softmax`)."""
from __future__ import annotations

import tvm
from tvm import relax


def rewrite_functions(mod: tvm.IRModule, mutator_class) -> tvm.IRModule:
    """``mod`` with each Relax function visited by ``mutator_class(mod)`` (TIR functions kept as they are)."""
    m = mutator_class(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(func))
    return m.builder_.get()
