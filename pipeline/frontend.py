"""What TVM's Relax ONNX importer cannot take, and graphopt's rewrite of it into ops it can.

graphopt knows no backend, so the pipeline tells it which op types to lower (:func:`frontend_gaps`): those
missing from the importer's converter table, read from the installed TVM so the list follows TVM releases,
plus :data:`MISHANDLED`, converters that exist but fail on a case graphopt rewrites.  Whatever is still
unsupported after :func:`graphopt.legalize.legalize` is a one-line error naming the op types.

Shape arithmetic on static shapes is folded first (:func:`graphopt.cleanup.fold_shapes`): the importer
converts it into symbolic shape expressions that its Expand and Reshape converters then reject.
"""
from __future__ import annotations

from graphopt.cleanup import fold_shapes
from graphopt.errors import UserError
from graphopt.ir import Graph
from graphopt.legalize import LOWERINGS, Legalized, legalize

# Converters TVM has but that fail on a case graphopt rewrites (its lowering declines every other case):
# ConstantOfShape with an empty shape, i.e. a scalar, which TorchScript exports of HF transformers contain.
MISHANDLED = frozenset({"ConstantOfShape"})


def _tvm_converters() -> frozenset[str] | None:
    """Op types TVM's ONNX importer converts (its own pre-check reads the same table), None if unreadable."""
    try:
        from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map
    except ImportError:
        return None
    return frozenset(_get_convert_map()) | {"If", "Constant"}  # handled outside the table


def frontend_gaps(graph: Graph) -> set[str]:
    """Op types of ``graph`` that TVM's importer lacks, plus those it mishandles (:data:`MISHANDLED`)."""
    ops = {n.op_type for n in graph.nodes}
    known = _tvm_converters()
    lacking = (ops & set(LOWERINGS)) if known is None else ops - known
    return lacking | (ops & MISHANDLED)


def legalize_for_tvm(graph: Graph) -> Legalized:
    """Rewrite what TVM's importer cannot take into primitive ops and fold static shape arithmetic (module
    docstring); UserError naming what still cannot be imported."""
    result = legalize(graph, frontend_gaps(graph))
    if any(n.op_type in ("Shape", "Size") for n in result.graph.nodes):
        g = result.graph.copy()  # neither the caller's graph nor the unfolded one is modified
        folded = fold_shapes(g)
        if folded:
            result = Legalized(g, result.lowered, folded, unfolded=result.graph)
    missing = sorted(frontend_gaps(result.graph) - MISHANDLED)
    if missing:
        domains = {n.op_type: n.domain for n in result.graph.nodes if n.op_type in missing}
        names = ", ".join(f"{op} ({domains[op]})" if domains.get(op) not in (None, "", "ai.onnx") else op
                          for op in missing)
        raise UserError(f"TVM's ONNX importer has no converter for {names}, and graphopt has no rewrite for "
                        f"{'it' if len(missing) == 1 else 'them'}: replace {'it' if len(missing) == 1 else 'them'} "
                        "in the exporting framework (or export with another opset)")
    return result
