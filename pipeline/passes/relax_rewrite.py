"""Run one of our Relax call rewrites (a ``PyExprMutator``) over every Relax function of a module: the body
of the module passes that swap an operator for a vectorizable TE version before LegalizeOps
(:mod:`pipeline.passes.fast_sigmoid`, :mod:`pipeline.passes.lane_softmax`)."""
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


def is_op(expr, name: str) -> bool:
    """Whether ``expr`` is a call of the Relax operator ``name`` (``"relax.nn.softmax"``)."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def static_shape(expr) -> tuple[int, ...] | None:
    """The static shape of a Relax expression's tensor type; None when it is not a tensor of known sizes."""
    try:
        return tuple(int(d) for d in expr.ty.shape)
    except (TypeError, AttributeError, ValueError):
        return None
