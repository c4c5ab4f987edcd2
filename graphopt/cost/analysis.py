"""What does not run: weight-only nodes (folded into initializers before export) and element-wise epilogues
fused into their producer's kernel.  Every cost model prices these at zero, and the rewriter uses the same
op sets to know which target nodes of a rule will be fused.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from graphopt import ops
from graphopt.ir import Graph, Node

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
