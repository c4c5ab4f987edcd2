"""Legalization: rewrite operators a backend lacks into primitive ONNX ops every stage understands.

A backend's importer covers most of ONNX but not all of it (TVM's Relax importer has no LSTM, GRU, RNN or
ReverseSequence converter, and its ConstantOfShape fails on a scalar output).  Rather than giving up on such
a model, :func:`legalize` replaces each of those nodes by an equivalent subgraph of primitive ops (MatMul,
Add, Sigmoid, Gather, Concat, ...), computing exactly what onnxruntime computes.  The graph search then sees
the primitive ops too, and can optimize across what used to be one opaque node.

Which op types to lower is the caller's decision (``ops``): graphopt does not know any backend, and the
pipeline asks TVM's converter table, so the list follows the installed TVM (a future TVM with an LSTM
converter stops the lowering by itself).  A lowering may decline a node it was asked for (returns None) when
that node needs no rewrite, e.g. a ConstantOfShape that produces a non-scalar tensor.

Lowerings live beside this file, one module per family (:mod:`.rnn`, :mod:`.sequence`,
:mod:`.constants`, :mod:`.quantized`); each registers itself with :func:`register` (:mod:`.registry`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from graphopt.ir import Graph, Node
from graphopt.legalize import constants, quantized, rnn, sequence  # noqa: F401  (each registers its lowerings)
from graphopt.legalize.builder import Builder
from graphopt.legalize.registry import LOWERINGS, Lowering, register  # noqa: F401  (the package's API)

@dataclass
class Legalized:
    """The rewritten graph, how many nodes of each op type were lowered (sorted by op type), and how many
    shape-arithmetic nodes a caller folded into constants (:func:`graphopt.cleanup.fold_shapes`)."""

    graph: Graph
    lowered: dict[str, int] = field(default_factory=dict)
    folded: int = 0
    # The graph before its shape arithmetic was folded: what computes the folded constants from the inputs
    # (graphopt.dynamic restores them from it so the exported model runs at other sizes).
    unfolded: Graph | None = None

    @property
    def changed(self) -> bool:
        return bool(self.lowered) or self.folded > 0


def legalize(graph: Graph, ops: Iterable[str] | None = None) -> Legalized:
    """Lower every default-domain node whose op type is in ``ops`` (default: every op with a lowering).

    Returns a new graph (the input is not modified; it is returned as is when it has nothing to lower) in
    topological order, with dead nodes removed and every new tensor typed.  Op types in ``ops`` without a
    lowering are left alone: the caller decides what an op that is still unsupported means.  Raises
    :class:`~graphopt.errors.UserError` (one line, naming the node and the attribute) for a node whose
    attributes make it impossible to lower, e.g. a dynamic sequence length.
    """
    wanted = set(LOWERINGS) if ops is None else set(ops) & set(LOWERINGS)
    if not any(n.op_type in wanted and n.domain in ("", "ai.onnx") for n in graph.nodes):
        return Legalized(graph)
    g = graph.copy()
    nodes: list[Node] = []
    lowered: dict[str, int] = {}
    b = None
    for n in g.nodes:
        if n.op_type not in wanted or n.domain not in ("", "ai.onnx"):
            nodes.append(n)
            continue
        b = Builder(g) if b is None else b
        b.prefix = Builder.clean_prefix(n.name or n.op_type)
        start = len(b.nodes)
        replaced = LOWERINGS[n.op_type](n, b)
        if replaced is None:
            del b.nodes[start:]
            nodes.append(n)
            continue
        new_nodes = b.nodes[start:]
        _bind_outputs(b, new_nodes, replaced)
        nodes.extend(new_nodes)
        lowered[n.op_type] = lowered.get(n.op_type, 0) + 1
    if not lowered:  # every lowering declined
        return Legalized(graph)
    g.nodes = nodes
    g.topo_sort()
    g.remove_unused()
    return Legalized(g, dict(sorted(lowered.items())))


def _bind_outputs(b: Builder, new_nodes: list[Node], replaced: dict[str, str]) -> None:
    """Make the lowered subgraph write the original output names, so no reader of the node changes.

    The tensor computing an output is renamed to the output's name when a new node produced it; otherwise
    (a weight, a graph input, or a tensor already bound to another output) an Identity copies it.
    """
    producer = {o: n for n in new_nodes for o in n.outputs}
    rename: dict[str, str] = {}
    for original, tensor in replaced.items():
        if tensor in producer and tensor not in rename:
            rename[tensor] = original
        else:
            b.nodes.append(Node("Identity", [tensor], [original], name=b.fresh("Identity")))
            new_nodes.append(b.nodes[-1])
    for n in new_nodes:
        n.inputs = [rename.get(t, t) for t in n.inputs]
        n.outputs = [rename.get(t, t) for t in n.outputs]
    vi = b.graph.value_info
    for tensor, original in rename.items():
        info = vi.pop(tensor, None)
        if info is not None and original not in vi:
            info.name = original
            vi[original] = info

