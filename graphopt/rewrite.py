"""Apply a match: replace the matched nodes by the rule's target pattern, then fold weight-only subgraphs.

Application is a local edit on a copy of the graph:

1. the target pattern's shapes are inferred from the bound inputs (:func:`target_plan`); a target whose
   shapes are invalid or whose outputs differ in shape from the source outputs is rejected - rules hold
   for all shapes where both sides are defined, so this is where "defined" is checked;
2. the matched nodes are removed and the target nodes emitted through :func:`graphopt.ops.to_onnx`;
   a target output takes over the *name* of the source output it replaces whenever it can, so consumers
   and graph outputs need no rewiring; otherwise consumers are rewired, and a graph output whose value is
   now an existing tensor gets an ``Identity`` so the model's interface keeps its names;
3. the result is topologically sorted, which rejects rewrites that would create a cycle (e.g. merging two
   matmuls where one's weight depends on the other's output).

Constant folding (:func:`fold_constants`) runs once on the final graph, not per rewrite: during search the
concatenation of two weights stays a node (so later rules can match on it, e.g. a third matmul joining the
merged pair) but costs nothing, since the cost model prices weight-only nodes at zero.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphopt.cost.analysis import ELEMENTWISE_OPS, FUSION_ANCHOR_OPS, constant_tensors, foldable
from graphopt.ir import Graph, Node, TensorInfo, attrs_key
from graphopt.match import GraphIndex, Match, _ref

Shape = tuple[int, ...]

_COUNTER = itertools.count()


class RewriteError(ValueError):
    """The match cannot be applied (shape mismatch, cycle, unmapped value); the search skips it."""


@dataclass
class TargetNode:
    op: str
    params: dict[str, Any]
    in_shapes: list[Shape]
    out_shapes: list[Shape]
    constant: bool  # computes only from weights: folded before export, so it costs nothing
    fused: bool = False  # element-wise op on the single use of a fusable target node's output


@dataclass
class Plan:
    """The target pattern instantiated on a match's bindings, before anything is built."""

    nodes: list[TargetNode]
    dtype: str
    src_outputs: list[str] = field(default_factory=list)


def target_plan(match: Match, index: GraphIndex, constants: set[str] | None = None) -> Plan:
    """Shapes (and weight-only-ness) of every target node; raises :class:`RewriteError` if invalid."""
    from graphopt import ops

    rule, graph = match.rule, index.graph
    bind = match.binding()
    constants = constants or set()
    src_outputs = [match.tensor(o, index) for o in rule.src.outputs]
    out_info = graph.tensor(src_outputs[0]) if src_outputs else None
    dtype = out_info.dtype if out_info is not None else "float32"
    shapes: dict[str, Shape] = {}
    const: dict[str, bool] = {}
    for x, t in bind.items():
        s = graph.shape(t)
        if s is None or not all(isinstance(d, int) for d in s):
            raise RewriteError(f"input {t} has no static shape")
        shapes[x] = tuple(s)  # type: ignore[arg-type]
        const[x] = t in constants
    nodes: list[TargetNode] = []
    for j, pn in enumerate(rule.dst.nodes):
        refs = []
        for r in pn.inputs:
            if r not in shapes:
                raise RewriteError(f"target reads {r}, which the source does not bind")
            refs.append(r)
        params = ops.bind_params(pn.param_dict, shapes)
        in_shapes = [shapes[r] for r in refs]
        try:
            outs = [tuple(s) for s in ops.infer_shape(pn.op, params, in_shapes)]
        except ValueError as exc:
            raise RewriteError(str(exc)) from None
        shape_only = set(getattr(ops.REGISTRY.get(pn.op), "shape_inputs", ()) or ())
        is_const = all(const[r] for k, r in enumerate(refs) if k not in shape_only)
        for k, s in enumerate(outs):
            shapes[f"n{j}:{k}"] = s
            const[f"n{j}:{k}"] = is_const
        nodes.append(TargetNode(pn.op, params, in_shapes, outs, is_const, _fused_in_target(rule.dst, j)))
    for r, t in zip(rule.dst.outputs, src_outputs):
        have = graph.shape(t)
        if r not in shapes or have is None or tuple(have) != shapes[r]:
            raise RewriteError(f"target output {r} has shape {shapes.get(r)}, source {have}")
    return Plan(nodes, dtype, src_outputs)


def creates_cycle(match: Match, index: GraphIndex) -> bool:
    """Would the target read a value that depends on the matched nodes themselves?

    The target reads only the bound pattern inputs, so the rewrite is cyclic exactly when one of them is
    computed (transitively) from a matched node.  Only values produced after the first matched node can
    be, so the backward walk stays inside that window - cheap next to building and sorting the graph.
    """
    matched = set(match.nodes)
    first = min(index.pos[n] for n in matched)
    stack = [index.producer[t][0] for _, t in match.bindings if t in index.producer]
    seen: set[str] = set()
    while stack:
        n = stack.pop()
        if n in matched:
            return True
        if n in seen or index.pos[n] < first:
            continue
        seen.add(n)
        stack.extend(index.producer[t][0] for t in index.nodes[n].inputs if t in index.producer)
    return False


def _fused_in_target(pattern, j: int) -> bool:
    """Target node ``j`` is element-wise and reads the only use of a fusable target node's output (the
    pattern-local version of :func:`graphopt.cost.analysis.fused_epilogue`, for estimating a rewrite's cost)."""

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


@dataclass
class Rewrite:
    """A rewritten graph and what changed, which the search uses to re-match only locally."""

    graph: Graph
    removed: list[str]
    added: list[str]
    rewired: list[str]


def _fresh(base: str, taken) -> str:
    while True:
        name = f"go{next(_COUNTER)}_{base}"
        if not taken(name):
            return name


def _edit_copy(graph: Graph) -> Graph:
    """Copy for a rewrite: node objects are shared (a rewrite replaces nodes, never edits them in place),
    the containers a rewrite changes are not."""
    g = copy.copy(graph)
    g.nodes = list(graph.nodes)
    g.inputs = list(graph.inputs)
    g.outputs = list(graph.outputs)
    g.initializers = dict(graph.initializers)
    g.value_info = dict(graph.value_info)
    return g


def apply_match(match: Match, index: GraphIndex, plan: Plan | None = None) -> Rewrite:
    """Build the graph with ``match`` replaced by the rule's target; raises :class:`RewriteError`."""
    from graphopt import ops

    graph = index.graph
    plan = plan or target_plan(match, index)
    rule = match.rule
    bind = match.binding()
    g = _edit_copy(graph)
    removed = set(match.nodes)

    def taken(name: str) -> bool:
        return (name in index.producer or name in index.nodes or name in g.initializers
                or name in g.value_info or name in graph.input_names)

    # Name the target's tensors: a target output takes over its source output's name when it is a fresh
    # value claimed by no earlier output.
    names: dict[str, str] = dict(bind)
    claimed: dict[str, str] = {}  # target ref -> source output whose name it took
    for r, src_r, src_t in zip(rule.dst.outputs, rule.src.outputs, plan.src_outputs):
        if (_ref(r) is not None and _ref(src_r) is not None and r not in claimed
                and src_t not in claimed.values()):
            claimed[r] = src_t
            names[r] = src_t
    for j, tn in enumerate(plan.nodes):
        for k in range(len(tn.out_shapes)):
            names.setdefault(f"n{j}:{k}", _fresh(tn.op, taken))

    new_nodes: list[Node] = []
    # Graph.fresh_name scans the whole graph; the op mappings call it for every weight they add, so give
    # them the index-backed version for the duration of the rewrite.
    g.fresh_name = lambda base: base if not taken(base) else _fresh(base, taken)  # type: ignore[method-assign]
    try:
        for j, (pn, tn) in enumerate(zip(rule.dst.nodes, plan.nodes)):
            outs = [names[f"n{j}:{k}"] for k in range(len(tn.out_shapes))]
            for o, s in zip(outs, tn.out_shapes):
                g.value_info[o] = TensorInfo(o, plan.dtype, s)
            emitted = ops.to_onnx(pn.op, tn.params, [names[r] for r in pn.inputs], outs, g)
            for n in emitted:
                n.name = _fresh(n.op_type, taken)
            new_nodes.extend(emitted)
    finally:
        del g.fresh_name

    # Values the target computes as an existing tensor (or as a value another output already names).
    rename: dict[str, str] = {}
    outputs = set(g.output_names)
    for r, src_t in zip(rule.dst.outputs, plan.src_outputs):
        new_t = names[r]
        if new_t == src_t:
            continue
        if src_t in outputs:
            new_nodes.append(Node("Identity", [new_t], [src_t], name=_fresh("Identity", taken)))
        else:
            rename[src_t] = new_t
    rewired: list[str] = []
    kept: list[Node] = []
    for n in g.nodes:
        if n.name in removed:
            continue
        if rename and any(t in rename for t in n.inputs):
            n = Node(n.op_type, [rename.get(t, t) for t in n.inputs], list(n.outputs), n.attrs, n.name,
                     n.domain, n.attr_types)
            rewired.append(n.name)
        kept.append(n)
    for t in rename:
        g.value_info.pop(t, None)
    g.nodes = _insert(kept, new_nodes, match, index, g, plan.src_outputs)
    return Rewrite(g, sorted(removed), [n.name for n in new_nodes], rewired)


def _insert(kept: list[Node], new_nodes: list[Node], match: Match, index: GraphIndex, g: Graph,
            src_outputs: list[str]) -> list[Node]:
    """Place the target nodes right after the last producer of what they read, when every reader of the
    values they replace comes later (then the order is topological and no cycle is possible); otherwise
    sort the whole graph, which also detects cycles."""
    removed = set(match.nodes)
    produced_new = {o for n in new_nodes for o in n.outputs}
    after = max((index.pos[index.producer[t][0]] for n in new_nodes for t in n.inputs
                 if t and t not in produced_new and t in index.producer), default=-1)
    before = min((index.pos[c] for t in src_outputs for c in index.consumers.get(t, []) if c not in removed),
                 default=len(index.pos))
    if after < before:
        at = sum(1 for n in kept if index.pos.get(n.name, after + 1) <= after)
        return kept[:at] + new_nodes + kept[at:]
    g.nodes = kept + new_nodes
    try:
        g.topo_sort()
    except ValueError:
        raise RewriteError("rewrite would create a cycle") from None
    return g.nodes


# ---- constant folding ------------------------------------------------------------------------------------

def fold_constants(graph: Graph) -> int:
    """Replace every weight-only subgraph by initializers holding its values, then drop what no output
    needs; returns the number of nodes folded.

    Evaluated with onnxruntime on the extracted subgraph (so any ONNX operator folds exactly as it would
    run).  Results that are graph outputs stay computed by their node: an initializer cannot be a graph
    output in every runtime.
    """
    from graphopt.feeds import run_ort
    from graphopt.onnx_io import export_onnx

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
