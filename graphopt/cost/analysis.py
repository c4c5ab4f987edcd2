"""What does not run: weight-only nodes (folded into initializers before export) and element-wise epilogues
fused into their producer's kernel.  Every cost model prices these at zero, in a graph
(:func:`foldable`, :func:`fused_epilogue`) and in a rule's target pattern before the search builds it
(:func:`free_targets`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from graphopt import ops
from graphopt.ir import Graph, Node
from graphopt.match import _ref

# ---- constant folding -------------------------------------------------------------------------------------

FOLD_MAX_GROWTH = 4  # fold only when the result is at most this many times the inputs' size (no Expand blow-ups)
FOLD_SMALL_ELEMS = 1 << 16  # ... or small anyway


def numel(shape: Sequence[Any] | None) -> int | None:
    """Element count of a static shape, None when a dimension is unknown."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return int(math.prod(shape))


def foldable(node: Node, graph: Graph, constants: set[str]) -> bool:
    """True when ``node`` computes only from weights, so it can be evaluated once and stored.

    Nodes with no inputs (random generators), control flow, and nodes whose result would be much larger than
    what they read (Expand/Tile of a small constant) are kept as they are.
    """
    real = [t for t in node.inputs if t]
    if not real or any(t not in constants for t in real):
        return False
    if any(hasattr(v, "node") and hasattr(v, "initializer") for v in node.attrs.values()):
        return False  # a GraphProto attribute: control flow
    if node.op_type.startswith("Random") or node.domain not in ("", "ai.onnx"):
        return False
    n_in = sum(numel(graph.shape(t)) or 0 for t in real)
    for o in node.outputs:
        n_out = numel(graph.shape(o)) if o else 0
        if n_out is None or (n_out > FOLD_MAX_GROWTH * max(n_in, 1) and n_out > FOLD_SMALL_ELEMS):
            return False
    return True


def constant_tensors(graph: Graph) -> set[str]:
    """Weights plus every tensor computed by foldable nodes from them (nodes must be topologically ordered)."""
    const = {t for t in graph.initializers if t not in set(graph.input_names)}
    for n in graph.nodes:
        if foldable(n, graph, const):
            const.update(o for o in n.outputs if o)
    return const


# ---- fusion -----------------------------------------------------------------------------------------------

# Both backends run an element-wise op that reads the single-use output of a conv, matmul or another
# element-wise op inside the producer's kernel (TVM's FuseOps epilogues; onnxruntime's Conv/MatMul + Add /
# activation fusions), so it costs (almost) nothing there.  Pricing it separately would make the search
# blind to what a rewrite does to fusion: merging two Conv+bias+Relu branches into one conv followed by a
# Split turns two free epilogues into real kernels, because a split output cannot be fused back.
ELEMENTWISE_ONNX = frozenset({"Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Neg", "Sqrt",
                              "Pow", "Clip", "LeakyRelu", "HardSigmoid", "Abs"})
FUSION_ANCHORS_ONNX = frozenset({"MatMul", "Conv", "Gemm"}) | ELEMENTWISE_ONNX
# The same roles among the operator library's ops (rule patterns), from their specs (OpSpec.fusion).
KERNEL_OPS = frozenset(name for name, spec in ops.REGISTRY.items() if spec.fusion == "anchor")
ELEMENTWISE_OPS = frozenset(name for name, spec in ops.REGISTRY.items() if spec.fusion == "elementwise")
FUSION_ANCHOR_OPS = KERNEL_OPS | ELEMENTWISE_OPS


def fused_epilogue(node: Node, index: Any) -> bool:
    """Is ``node`` an element-wise op reading the only use of a fusable producer's output?
    (``index`` is a :class:`graphopt.match.GraphIndex` of the node's graph.)"""
    if node.op_type not in ELEMENTWISE_ONNX or node.domain not in ("", "ai.onnx"):
        return False
    for t in node.inputs:
        prod = index.producer.get(t) if t else None
        if prod is None:
            continue
        p = index.nodes[prod[0]]
        if (p.op_type in FUSION_ANCHORS_ONNX and p.domain in ("", "ai.onnx") and t not in index.graph_outputs
                and len(index.consumers.get(t, ())) == 1):
            return True
    return False


# ---- a rule's target pattern, priced before it is built ----------------------------------------------------

def weight_only_targets(pattern: Any, weight_inputs: set[str]) -> list[bool]:
    """Per node of a rule's target ``pattern`` (a :class:`graphopt.rules.Pattern` whose references
    :func:`graphopt.rewrite.target_plan` checked): does it compute only from weights - the pattern inputs
    in ``weight_inputs`` and target values computed from them; an operator's shape inputs do not count - so
    that it is folded before export?"""
    out: list[bool] = []
    for pn in pattern.nodes:
        shape_only = set(getattr(ops.REGISTRY.get(pn.op), "shape_inputs", ()) or ())
        refs = [(_ref(r), r) for k, r in enumerate(pn.inputs) if k not in shape_only]
        out.append(all(out[ref[0]] if ref is not None else r in weight_inputs for ref, r in refs))
    return out


def fused_target(pattern: Any, j: int) -> bool:
    """Target node ``j`` is element-wise and reads the only use of a fusable target node's output (the
    pattern-local version of :func:`fused_epilogue`)."""
    if pattern.nodes[j].op not in ELEMENTWISE_OPS:
        return False
    uses: dict[str, int] = {}
    for pn in pattern.nodes:
        for r in pn.inputs:
            uses[r] = uses.get(r, 0) + 1
    for r in pattern.nodes[j].inputs:
        ref = _ref(r)
        if (ref is not None and pattern.nodes[ref[0]].op in FUSION_ANCHOR_OPS and uses[r] == 1
                and r not in pattern.outputs):
            return True
    return False


def free_targets(pattern: Any, weight_inputs: set[str], fusion: bool) -> list[bool]:
    """Per node of a rule's target ``pattern``: does it cost nothing once built (weight-only, or, with
    ``fusion``, a fused element-wise epilogue)?"""
    weight_only = weight_only_targets(pattern, weight_inputs)
    return [w or (fusion and fused_target(pattern, j)) for j, w in enumerate(weight_only)]
