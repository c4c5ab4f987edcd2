"""Clean-up passes on a whole graph, run around the search (see :func:`graphopt.stage.finish`):

* :func:`fold_constants` - weight-only subgraphs become initializers (evaluated with onnxruntime);
* :func:`fold_shapes` - ``Shape``/``Size`` of statically shaped tensors become constants, and the shape
  arithmetic computed from them is folded too;
* :func:`eliminate_common_subexpressions` - identical nodes on identical inputs computed once;
* :func:`split_conv_bias` / :func:`fuse_conv_bias` - ``Conv(x,w,b)`` to ``Conv(x,w)`` + bias add (the form the
  rules are written in) before the search, and back afterwards so the export keeps ONNX's usual spelling.
"""
from __future__ import annotations

import numpy as np

from graphopt.cost.analysis import constant_tensors, foldable
from graphopt.feeds import run_ort
from graphopt.ir import Graph, Node, TensorInfo, attrs_key
from graphopt.onnx_io import export_onnx


# ---- constant folding ------------------------------------------------------------------------------------

def fold_constants(graph: Graph) -> int:
    """Replace every weight-only subgraph by initializers holding its values, then drop what no output
    needs; returns the number of nodes folded.

    Evaluated with onnxruntime on the extracted subgraph (so any ONNX operator folds exactly as it would
    run).  Results that are graph outputs stay computed by their node: an initializer cannot be a graph
    output in every runtime.
    """
    constants = constant_tensors(graph)
    outputs = set(graph.output_names)
    fold = [n for n in graph.nodes if foldable(n, graph, constants) and not any(o in outputs for o in n.outputs)]
    if not fold:
        graph.remove_unused()
        return 0
    fold_names = {n.name for n in fold}
    produced = {o for n in fold for o in n.outputs if o}
    needed = []
    for n in graph.nodes:
        if n.name in fold_names:
            continue
        needed.extend(t for t in n.inputs if t in produced and t not in needed)
    if needed:
        read = {t for n in fold for t in n.inputs if t and t not in produced}
        sub = Graph(nodes=fold, inputs=[], initializers={t: graph.initializers[t] for t in read},
                    outputs=[graph.tensor(t) or TensorInfo(t, "float32", None) for t in needed],
                    value_info={}, opset_imports=dict(graph.opset_imports), ir_version=graph.ir_version,
                    functions=list(graph.functions))
        values = run_ort(export_onnx(sub, check=False), {})
        for t, v in zip(needed, values):
            graph.initializers[t] = np.asarray(v)
    graph.nodes = [n for n in graph.nodes if n.name not in fold_names]
    graph.remove_unused()
    return len(fold)


def fold_shapes(graph: Graph, max_rounds: int = 32) -> int:
    """Replace ``Shape`` and ``Size`` of tensors whose shape is static by constants, fold everything computed
    only from constants (:func:`fold_constants`), re-infer the shapes, and repeat until nothing changes;
    returns the number of nodes removed.  ``graph`` is modified in place.

    Why: exporters write shape arithmetic so the model works for any input size (TorchScript: Shape ->
    Gather -> ConstantOfShape -> Equal/Where -> Expand for a broadcast, Reshape to a computed shape; dynamo:
    Range over a Shape-derived length for position ids and masks).  Once the input shapes are fixed these
    compute fixed values, but ONNX shape inference cannot see through them (a Reshape to a computed shape has
    unknown dimensions, so the next Shape is not static), and a frontend that imports them node by node (TVM's
    Relax ONNX importer) turns them into symbolic shape expressions, loses the static shape of everything
    downstream, and a later converter fails (Expand to a symbolic dimension, Reshape(-1) of a tensor whose
    size it cannot prove).  Each round's folded constants let the next inference resolve more shapes.
    ``start``/``end`` of Shape (opset 15) slice like Python, clamped, as the ONNX spec defines them.
    """
    from graphopt.onnx_io import import_onnx  # the IR's own importer re-infers the shapes

    total = 0
    for _ in range(max_rounds):
        removed = _fold_static_shapes(graph)
        if not removed:
            break
        total += removed
        # Stale symbolic types would be kept by inference: drop them, then infer again from the constants.
        graph.value_info = {k: v for k, v in graph.value_info.items() if v.is_static}
        again = import_onnx(export_onnx(graph, check=False), require_static=False)
        graph.nodes, graph.initializers, graph.value_info = again.nodes, again.initializers, again.value_info
        graph.inputs, graph.outputs = again.inputs, again.outputs
    return total


def _fold_static_shapes(graph: Graph) -> int:
    """One round of :func:`fold_shapes`: Shape/Size of static tensors to constants, then constant folding;
    returns the number of nodes removed."""
    outputs = set(graph.output_names)
    replaced = 0
    kept: list[Node] = []
    for n in graph.nodes:
        shape = graph.shape(n.inputs[0]) if n.op_type in ("Shape", "Size") and n.inputs else None
        static = shape is not None and all(isinstance(d, int) for d in shape)
        if not static or n.domain not in ("", "ai.onnx") or n.outputs[0] in outputs:
            kept.append(n)
            continue
        dims = list(shape)  # type: ignore[arg-type]
        if n.op_type == "Shape":
            value = np.array(dims[slice(n.attr("start", 0), n.attr("end"))], dtype=np.int64)
        else:
            value = np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
        graph.initializers[n.outputs[0]] = value
        replaced += 1
    graph.nodes = kept
    # Also when no Shape was replaced: the last inference may have typed a node over constants (a Reshape of
    # a folded shape) that the previous round could not fold without its output's size.
    return replaced + fold_constants(graph)


# ---- canonical form around the search ---------------------------------------------------------------------

def split_conv_bias(graph: Graph) -> int:
    """``Conv(x, w, b)`` -> ``Conv(x, w)`` + ``Add(., b[C,1,1])`` so the rules see a plain conv2d and a
    bias_add (TASO's conv has no bias; this is what lets parallel convolutions with biases merge).
    :func:`fuse_conv_bias` undoes it after the search.  Returns the number of convolutions split."""
    count = 0
    nodes: list[Node] = []
    for n in graph.nodes:
        b = n.inputs[2] if n.op_type == "Conv" and n.domain in ("", "ai.onnx") and len(n.inputs) == 3 else ""
        out_shape = graph.shape(n.outputs[0]) if b else None
        if not b or not graph.is_constant(b) or graph.initializers[b].ndim != 1 or out_shape is None \
                or len(out_shape) != 4:
            nodes.append(n)
            continue
        bias = graph.fresh_name(f"{b}_c11")
        graph.initializers[bias] = graph.initializers[b].reshape(-1, 1, 1)
        t = graph.fresh_name(f"{n.outputs[0]}_nobias")
        info = graph.tensor(n.outputs[0])
        graph.value_info[t] = TensorInfo(t, info.dtype if info else "float32", tuple(out_shape))
        nodes.append(Node("Conv", n.inputs[:2], [t], dict(n.attrs), n.name, n.domain, dict(n.attr_types)))
        nodes.append(Node("Add", [t, bias], list(n.outputs), name=graph.fresh_name(f"{n.name}/bias")))
        count += 1
    graph.nodes = nodes
    return count


def fuse_conv_bias(graph: Graph) -> int:
    """``Conv(x, w)`` + ``Add(., b[C,1,1])`` (either operand order) -> ``Conv(x, w, b)`` when the conv's output
    has no other reader; returns the number fused."""
    producers = graph.producers()
    consumers = graph.consumers()
    outputs = set(graph.output_names)
    drop: set[int] = set()
    replace: dict[int, Node] = {}
    for add in graph.nodes:
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
            continue
        for t, b in (add.inputs, add.inputs[::-1]):
            conv = producers.get(t, (None, 0))[0]
            if conv is None or conv.op_type != "Conv" or len(conv.inputs) != 2 or id(conv) in replace:
                continue
            if t in outputs or len(consumers.get(t, [])) != 1 or not graph.is_constant(b):
                continue
            w_shape, bias = graph.shape(conv.inputs[1]), graph.initializers[b]
            if w_shape is None or bias.shape not in ((w_shape[0], 1, 1), (1, w_shape[0], 1, 1)):
                continue
            name = graph.fresh_name(f"{conv.name}_bias")
            graph.initializers[name] = bias.reshape(-1)
            replace[id(conv)] = Node("Conv", [conv.inputs[0], conv.inputs[1], name], list(add.outputs),
                                     dict(conv.attrs), conv.name, conv.domain, dict(conv.attr_types))
            drop.add(id(add))
            break
    graph.nodes = [replace.get(id(n), n) for n in graph.nodes if id(n) not in drop]
    graph.remove_unused()
    return len(replace)


def eliminate_common_subexpressions(graph: Graph) -> int:
    """Merge nodes that compute the same op with the same attributes on the same inputs (rewrites applied
    independently, e.g. one merge per RNN gate, each build their own ``concat(x0, x1)``); returns the
    number of nodes removed.  Nodes producing graph outputs keep their names and are left alone."""
    outputs = set(graph.output_names)
    seen: dict[tuple, Node] = {}
    rename: dict[str, str] = {}
    kept: list[Node] = []
    for n in graph.nodes:
        if rename and any(t in rename for t in n.inputs):
            n = Node(n.op_type, [rename.get(t, t) for t in n.inputs], list(n.outputs), n.attrs, n.name, n.domain,
                     n.attr_types)
        deterministic = not n.op_type.startswith("Random") and n.inputs and not any(
            hasattr(v, "node") and hasattr(v, "initializer") for v in n.attrs.values())
        key = (n.domain, n.op_type, attrs_key(n.attrs), tuple(n.inputs), len(n.outputs))
        first = seen.get(key) if deterministic else None
        if first is not None and not any(o in outputs for o in n.outputs):
            rename.update({o: f for o, f in zip(n.outputs, first.outputs) if o})
            continue
        if deterministic:
            seen.setdefault(key, n)
        kept.append(n)
    removed = len(graph.nodes) - len(kept)
    graph.nodes = kept
    graph.remove_unused()
    return removed
