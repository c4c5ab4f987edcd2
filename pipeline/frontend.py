"""What TVM's Relax ONNX importer cannot take, and graphopt's rewrite of it into ops it can.

graphopt knows no backend, so the pipeline tells it which op types to lower (:func:`frontend_gaps`): those
missing from the importer's converter table, read from the installed TVM so the list follows TVM releases,
plus :data:`MISHANDLED`, converters that exist but fail on a case graphopt rewrites.  Whatever is still
unsupported after :func:`graphopt.legalize.legalize` is a one-line error naming the op types.

Shape arithmetic on static shapes is folded (:func:`graphopt.cleanup.fold_shapes`): the importer converts it
into symbolic shape expressions that its Expand and Reshape converters then reject.  It is folded before the
lowerings too when a node to lower has no static input shape yet: an LSTM behind a Reshape to a computed
shape (``x.view(t // 8, b, 8)`` exports Shape -> Gather -> Div -> Concat, which ONNX shape inference does
not evaluate) is unrolled only once the user's input shapes reached it.

An operand that sets a shape (:data:`VALUE_SHAPED`) and is computed from the values of a runtime input (not its
shape) is refused first, in one line naming the node: the output's size would change with the input's values,
and the build has fixed sizes.  (A single integer there, a setting, is specialized on its ``--inputs`` value
before this: :mod:`graphopt.specialize`.)
"""
from __future__ import annotations

from graphopt.cleanup import fold_shapes
from graphopt.errors import UserError
from graphopt.ir import Graph
from graphopt.legalize import LOWERINGS, Legalized, legalize
from graphopt.onnx_io import DEFAULT_DOMAINS
from graphopt.specialize import SHAPE_ONLY, SHAPE_OPERANDS

# Converters TVM has but that fail on a case graphopt rewrites (its lowering declines every other case):
# ConstantOfShape with an empty shape, i.e. a scalar, which TorchScript exports of HF transformers contain.
MISHANDLED = frozenset({"ConstantOfShape"})
# Op types that cannot stay inside an If branch: graphopt rewrites them for TVM at the top level only, so an If
# holding one is folded to its branch on the value of its condition (graphopt.specialize).
BRANCH_BLOCKERS = frozenset(LOWERINGS)
# Shape operands whose value TVM's importer needs when it converts the model.  Computed from a runtime input's
# values, each failed inside TVM: Expand with an internal AttributeError ('ExternFunc' object has no attribute
# 'name': Relax's FastMathTransform reads the name of every call, and the importer's dynamic Expand calls the
# packed function vm.builtin.tensor_to_shape), ConstantOfShape with an AssertionError, Tile with a kernel of
# symbolic shape, Reshape with a TypeError.
VALUE_SHAPED = {op: SHAPE_OPERANDS[op] for op in ("Expand", "ConstantOfShape", "Tile", "Reshape")}


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


def _unshaped_lowering(graph: Graph, ops: set[str]) -> bool:
    """A node of ``ops`` that graphopt lowers reads a tensor whose shape is not static (yet)."""
    return any(n.op_type in ops and n.op_type in LOWERINGS and n.domain in ("", "ai.onnx")
               and not all(graph.tensor(t) is not None and graph.tensor(t).is_static for t in n.inputs if t)
               for n in graph.nodes)


def _runtime_values(graph: Graph) -> dict[str, str]:
    """{tensor: the runtime input its values are computed from} for every tensor of ``graph`` (nodes in
    topological order) computed from the values of a runtime input; Shape and Size read only its shape."""
    origin = {i.name: i.name for i in graph.inputs if i.name not in graph.initializers}
    for n in graph.nodes:
        if n.op_type in SHAPE_ONLY and n.domain in DEFAULT_DOMAINS:
            continue
        source = next((origin[t] for t in n.inputs if t in origin), None)
        if source is not None:
            origin.update((o, source) for o in n.outputs if o)
    return origin


def _check_value_shapes(graph: Graph) -> None:
    """UserError naming the first node whose shape operand (:data:`VALUE_SHAPED`) is computed from the values of
    a runtime input, and that input."""
    origin = _runtime_values(graph)
    for n in graph.nodes:
        operands = VALUE_SHAPED.get(n.op_type, {}) if n.domain in DEFAULT_DOMAINS else {}
        for k, operand in operands.items():
            if k < len(n.inputs) and n.inputs[k] in origin:
                raise UserError(f"{n.op_type} node {n.name!r} takes its {operand} from the values of input "
                                f"{origin[n.inputs[k]]!r}, so its output's size changes with them, and model.so is "
                                f"built for fixed sizes: compute the {operand} from constants or from tensor shapes "
                                "(Shape) in the exporting framework")


def legalize_for_tvm(graph: Graph) -> Legalized:
    """Rewrite what TVM's importer cannot take into primitive ops and fold static shape arithmetic (module
    docstring); UserError naming what still cannot be imported."""
    _check_value_shapes(graph)
    source, before = graph, 0
    if _unshaped_lowering(graph, frontend_gaps(graph)):
        graph = graph.copy()  # the caller's graph is not modified
        before = fold_shapes(graph)
    result = legalize(graph, frontend_gaps(graph))
    lowered, after = result.graph, 0
    if any(n.op_type in ("Shape", "Size") for n in lowered.nodes):
        g = lowered.copy()  # neither the caller's graph nor the unfolded one is modified
        after = fold_shapes(g)
        if after:
            result = Legalized(g, result.lowered)
    if before or after:  # dynamic_model restores the folded constants from the graph they were computed in
        result = Legalized(result.graph, result.lowered, before + after, unfolded=source if before else lowered)
    missing = sorted(frontend_gaps(result.graph) - MISHANDLED)
    if missing:
        domains = {n.op_type: n.domain for n in result.graph.nodes if n.op_type in missing}
        names = ", ".join(f"{op} ({domains[op]})" if domains.get(op) not in (None, "", "ai.onnx") else op
                          for op in missing)
        raise UserError(f"TVM's ONNX importer has no converter for {names}, and graphopt has no rewrite for "
                        f"{'it' if len(missing) == 1 else 'them'}: replace {'it' if len(missing) == 1 else 'them'} "
                        "in the exporting framework (or export with another opset)")
    return result
