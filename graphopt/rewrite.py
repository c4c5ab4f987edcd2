"""Apply a match: replace the matched nodes by the rule's target pattern.

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

Constant folding (:func:`graphopt.cleanup.fold_constants`) runs once on the final graph, not per rewrite:
during search the concatenation of two weights stays a node (so later rules can match on it, e.g. a third
matmul joining the merged pair) but costs nothing, since the cost model prices weight-only nodes at zero.

Rewriting knows nothing of cost (as egg keeps cost in ``extract.rs``, out of ``rewrite.rs``): what a
target pattern will cost once built - which of its nodes are folded or fused - is the cost side's
(:meth:`graphopt.cost.base.CostModel.pattern_cost`), which the search asks when it prices a candidate.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from graphopt import ops
from graphopt.ir import Graph, Node, TensorInfo
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


@dataclass
class Plan:
    """The target pattern instantiated on a match's bindings, before anything is built."""

    nodes: list[TargetNode]
    dtype: str
    src_outputs: list[str] = field(default_factory=list)


def target_plan(match: Match, index: GraphIndex) -> Plan:
    """Shapes of every target node; raises :class:`RewriteError` if invalid."""
    rule, graph = match.rule, index.graph
    bind = match.binding()
    src_outputs = [match.tensor(o, index) for o in rule.src.outputs]
    out_info = graph.tensor(src_outputs[0]) if src_outputs else None
    dtype = out_info.dtype if out_info is not None else "float32"
    shapes: dict[str, Shape] = {}
    for x, t in bind.items():
        s = graph.shape(t)
        if s is None or not all(isinstance(d, int) for d in s):
            raise RewriteError(f"input {t} has no static shape")
        shapes[x] = tuple(s)  # type: ignore[arg-type]
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
        for k, s in enumerate(outs):
            shapes[f"n{j}:{k}"] = s
        nodes.append(TargetNode(pn.op, params, in_shapes, outs))
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
