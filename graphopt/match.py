"""Find where a rule's source pattern occurs in a model graph.

A match maps every pattern node to a distinct graph node with the same operator and *equal* parameters
(the operator view :func:`graphopt.ops.from_onnx` gives of the node), binds every pattern input ``x<i>`` to
one tensor consistently, and is only valid when removing the matched nodes loses nothing: an output of a
matched node that is not one of the pattern's outputs must not be read outside the match nor be a graph
output.  Multi-output patterns (TASO's "two matmuls sharing an input") are matched like any other: the
pattern nodes need not be connected by edges, only by shared inputs.

Speed matters because the search re-matches after every rewrite of a BERT-sized graph, so:

* nodes are indexed by operator, and matching grows a partial match from its most constrained neighbour
  (a producer is unique; consumers of one tensor are few) instead of trying every node for every pattern
  node;
* :func:`find_matches` can be *anchored*: it returns only matches containing at least one of the given
  nodes, which is how the search re-matches only around what a rewrite changed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from graphopt import ops
from graphopt.ir import Graph, Node
from graphopt.memo import IdentityCache
from graphopt.rules import PNode, Pattern, Rule, _freeze


@dataclass(frozen=True)
class OpView:
    """What the matcher sees of a graph node: operator, frozen parameters, operator-level inputs."""

    op: str
    params: tuple[tuple[str, Any], ...]
    inputs: tuple[str, ...]
    n_outputs: int


class ViewCache:
    """Operator views of nodes, shared by all graphs of one search.

    A node's name identifies it across the graphs a search derives (rewrites create new names and never
    change a node's operator), but a rewrite may rewire its inputs, so the key includes them.
    """

    def __init__(self) -> None:
        self._views: dict[tuple, OpView | None] = {}

    def view(self, node: Node, graph: Graph) -> OpView | None:
        key = (node.name, node.op_type, tuple(node.inputs))
        if key not in self._views:
            self._views[key] = compute_view(node, graph)
        return self._views[key]


def compute_view(node: Node, graph: Graph) -> OpView | None:
    parsed = ops.from_onnx(node, graph)
    if parsed is None:
        return None
    op, params = parsed
    getter = getattr(ops, "op_inputs", None)
    inputs = tuple(getter(node, graph)) if getter else tuple(t for t in node.inputs if t)
    return OpView(op, freeze_params(params), inputs, len(node.outputs))


def freeze_params(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, _freeze(v)) for k, v in params.items()))


class GraphIndex:
    """Producers, consumers and operator index of one graph, built once per graph the search visits."""

    def __init__(self, graph: Graph, views: ViewCache | None = None):
        self.graph = graph
        self.views = views or ViewCache()
        self.nodes: dict[str, Node] = {}
        self.view: dict[str, OpView] = {}
        self.by_op: dict[str, list[str]] = {}
        self.producer: dict[str, tuple[str, int]] = {}
        self.consumers: dict[str, list[str]] = {}
        self.graph_outputs = set(graph.output_names)
        self.pos: dict[str, int] = {n.name: i for i, n in enumerate(graph.nodes)}
        for n in graph.nodes:
            self.nodes[n.name] = n
            for k, o in enumerate(n.outputs):
                if o:
                    self.producer[o] = (n.name, k)
            for t in dict.fromkeys(n.inputs):
                if t:
                    self.consumers.setdefault(t, []).append(n.name)
            v = self.views.view(n, graph)
            if v is not None:
                self.view[n.name] = v
                self.by_op.setdefault(v.op, []).append(n.name)


    @classmethod
    def derive(cls, parent: "GraphIndex", graph: Graph, gone: set[str], new: set[str]) -> "GraphIndex":
        """Index of ``graph`` made from its parent's: ``gone`` nodes left (or were replaced), ``new`` nodes
        came in (rewired nodes are in both).  Lists are copied only where they change."""
        ix = cls.__new__(cls)
        ix.graph, ix.views, ix.graph_outputs = graph, parent.views, parent.graph_outputs
        ix.nodes, ix.view, ix.producer = dict(parent.nodes), dict(parent.view), dict(parent.producer)
        ix.consumers, ix.by_op = dict(parent.consumers), dict(parent.by_op)
        ix.pos = {n.name: i for i, n in enumerate(graph.nodes)}
        for name in gone:
            old = ix.nodes.pop(name)
            v = ix.view.pop(name, None)
            if v is not None:
                ix.by_op[v.op] = [x for x in ix.by_op[v.op] if x != name]
            for k, o in enumerate(old.outputs):
                if o and ix.producer.get(o) == (name, k):
                    del ix.producer[o]
            for t in dict.fromkeys(old.inputs):
                if t:
                    ix.consumers[t] = [c for c in ix.consumers[t] if c != name]
        for n in graph.nodes:
            if n.name not in new:
                continue
            ix.nodes[n.name] = n
            for k, o in enumerate(n.outputs):
                if o:
                    ix.producer[o] = (n.name, k)
            for t in dict.fromkeys(n.inputs):
                if t:
                    ix.consumers[t] = ix.consumers.get(t, []) + [n.name]
            v = ix.views.view(n, graph)
            if v is not None:
                ix.view[n.name] = v
                ix.by_op[v.op] = ix.by_op.get(v.op, []) + [n.name]
        return ix


@dataclass(frozen=True)
class Match:
    """One occurrence of ``rule.src``: graph node per pattern node, tensor per pattern input."""

    rule: Rule
    nodes: tuple[str, ...]
    bindings: tuple[tuple[str, str], ...]

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        return (self.rule.name, self.nodes)

    def binding(self) -> dict[str, str]:
        return dict(self.bindings)

    def tensor(self, ref: str, index: GraphIndex) -> str:
        """Graph tensor of a source-pattern reference (``x3`` or ``n1:0``)."""
        if ref.startswith("x"):
            return self.binding()[ref]
        k, _, port = ref[1:].partition(":")
        return index.nodes[self.nodes[int(k)]].outputs[int(port or 0)]


def _is_symbolic(v: Any) -> bool:
    return isinstance(v, str) and v.startswith("x") or isinstance(v, tuple) and any(_is_symbolic(x) for x in v)


def _ref(r: str) -> tuple[int, int] | None:
    """``n2:1`` -> (2, 1); pattern inputs -> None."""
    if not r.startswith("n"):
        return None
    k, _, port = r[1:].partition(":")
    return int(k), int(port or 0)


class _Compiled:
    """A pattern pre-digested for matching (parsed references, reverse edges), built once per pattern."""

    def __init__(self, pattern: Pattern):
        self.p = pattern
        self.n = len(pattern.nodes)
        # per node, per input: ("x3", None) for a pattern input, (None, (k, port)) for a node output
        self.refs = [[(r, None) if _ref(r) is None else (None, _ref(r)) for r in pn.inputs] for pn in pattern.nodes]
        # pattern node -> [(consumer pattern node, input position, output port)]
        self.users: list[list[tuple[int, int, int]]] = [[] for _ in pattern.nodes]
        for j, refs in enumerate(self.refs):
            for pos, (_, ref) in enumerate(refs):
                if ref is not None:
                    self.users[ref[0]].append((j, pos, ref[1]))
        self.pattern_outputs = {_ref(o) for o in pattern.outputs if _ref(o) is not None}
        # split sizes in rules are symbolic ("x1.0": dim 0 of pattern input x1): checked once all inputs are bound
        self.symbolic = [any(_is_symbolic(v) for _, v in pn.params) for pn in pattern.nodes]
        self.static = [{k: v for k, v in pn.params if not _is_symbolic(v)} for pn in pattern.nodes]
        self.param_keys = [{k for k, _ in pn.params} for pn in pattern.nodes]
        # immediate neighbours of each pattern node, for a cheap test of a seed before full matching
        self.in_ops = [[(pos, pattern.nodes[ref[0]].op, ref[1]) for pos, (_, ref) in enumerate(refs) if ref]
                       for refs in self.refs]
        self.user_ops = [[(port, pattern.nodes[u].op, pos) for (u, pos, port) in users] for users in self.users]

    def plausible(self, j: int, name: str, index: "GraphIndex") -> bool:
        """Does graph node ``name`` have the producers and readers pattern node ``j`` needs?"""
        v = index.view[name]
        for pos, op, port in self.in_ops[j]:
            prod = index.producer.get(v.inputs[pos]) if pos < len(v.inputs) else None
            if prod is None or prod[1] != port or (index.view.get(prod[0]) or _NO_VIEW).op != op:
                return False
        outs = index.nodes[name].outputs
        for port, op, pos in self.user_ops[j]:
            t = outs[port] if port < len(outs) else None
            if not any((cv := index.view.get(c)) is not None and cv.op == op and pos < len(cv.inputs)
                       and cv.inputs[pos] == t for c in index.consumers.get(t, ())):
                return False
        return True


_NO_VIEW = OpView("", (), (), 0)
_COMPILED: IdentityCache[_Compiled] = IdentityCache(1 << 13)  # a library's patterns, with their reverses


def _compile(pattern: Pattern) -> _Compiled:
    hit = _COMPILED.get(pattern)
    return hit if hit is not None else _COMPILED.put(pattern, _Compiled(pattern))


class _Matcher:
    """Backtracking matcher for one pattern against one indexed graph."""

    def __init__(self, pattern: Pattern, index: GraphIndex):
        c = _compile(pattern)
        self.c = c
        self.p = pattern
        self.ix = index
        self.users = c.users
        self.pattern_outputs = c.pattern_outputs
        self.symbolic = c.symbolic

    def _params_ok(self, j: int, v: OpView) -> bool:
        if not self.symbolic[j]:
            return v.params == self.p.nodes[j].params
        have = dict(v.params)
        return set(have) == self.c.param_keys[j] and all(have[k] == val for k, val in self.c.static[j].items())

    def _symbolic_ok(self, assign: dict[int, str], bind: dict[str, str]) -> bool:
        dims = {x: self.ix.graph.shape(t) for x, t in bind.items()}
        for j, name in assign.items():
            if self.symbolic[j]:
                try:
                    resolved = freeze_params(ops.bind_params(self.p.nodes[j].param_dict, dims))
                except (KeyError, IndexError, TypeError, ValueError):
                    return False
                if resolved != self.ix.view[name].params:
                    return False
        return True

    # ---- local consistency ---------------------------------------------------------------------------------
    def _fits(self, j: int, name: str, assign: dict[int, str], bind: dict[str, str]) -> dict[str, str] | None:
        """Bindings extended by mapping pattern node ``j`` to graph node ``name``, or None if inconsistent."""
        pn: PNode = self.p.nodes[j]
        v = self.ix.view.get(name)
        if v is None or v.op != pn.op or len(v.inputs) != len(pn.inputs) or v.n_outputs != pn.n_outputs:
            return None
        if not self._params_ok(j, v) or name in assign.values():
            return None
        node = self.ix.nodes[name]
        new = dict(bind)
        for pos, (x, ref) in enumerate(self.c.refs[j]):
            t = v.inputs[pos]
            if ref is None:
                if new.setdefault(x, t) != t:
                    return None
            elif ref[0] in assign:
                if self.ix.nodes[assign[ref[0]]].outputs[ref[1]] != t:
                    return None
        for (u, pos, port) in self.users[j]:
            if u in assign and self.ix.view[assign[u]].inputs[pos] != node.outputs[port]:
                return None
        return new

    def _candidates(self, assign: dict[int, str], bind: dict[str, str]) -> tuple[int, list[str]]:
        """The unassigned pattern node with the fewest candidate graph nodes, and those candidates."""
        best: tuple[int, list[str]] | None = None
        for j, pn in enumerate(self.p.nodes):
            if j in assign:
                continue
            cands: list[str] | None = None
            for (u, pos, port) in self.users[j]:  # j produces an input of an assigned node: unique producer
                if u in assign:
                    t = self.ix.view[assign[u]].inputs[pos]
                    prod = self.ix.producer.get(t)
                    cands = [prod[0]] if prod is not None and prod[1] == port else []
                    break
            if cands is None:
                for r, ref in self.c.refs[j]:
                    t = None
                    if ref is not None and ref[0] in assign:
                        t = self.ix.nodes[assign[ref[0]]].outputs[ref[1]]
                    elif ref is None and r in bind:
                        t = bind[r]
                    if t is not None:
                        cs = self.ix.consumers.get(t, [])
                        if cands is None or len(cs) < len(cands):
                            cands = cs
            if cands is None:
                cands = self.ix.by_op.get(pn.op, [])
            if best is None or len(cands) < len(best[1]):
                best = (j, cands)
        assert best is not None
        return best

    def _valid(self, assign: dict[int, str], bind: dict[str, str]) -> bool:
        """Removing the matched nodes must lose no value the rest of the graph reads."""
        matched = set(assign.values())
        produced_inside = set()
        for j, name in assign.items():
            node = self.ix.nodes[name]
            for port, t in enumerate(node.outputs):
                if not t:
                    continue
                produced_inside.add(t)
                if (j, port) in self.pattern_outputs:
                    continue
                if t in self.ix.graph_outputs:
                    return False
                if any(c not in matched for c in self.ix.consumers.get(t, [])):
                    return False
        # a pattern input bound to a value computed inside the match would dangle once the match is removed
        if any(t in produced_inside for t in bind.values()):
            return False
        return not any(self.symbolic) or self._symbolic_ok(assign, bind)

    # ---- search ------------------------------------------------------------------------------------------
    def run(self, seeds: Iterable[tuple[int, str]]) -> list[tuple[dict[int, str], dict[str, str]]]:
        found: list[tuple[dict[int, str], dict[str, str]]] = []
        seen: set[tuple[str, ...]] = set()
        n = len(self.p.nodes)

        def extend(assign: dict[int, str], bind: dict[str, str]) -> None:
            if len(assign) == n:
                key = tuple(assign[i] for i in range(n))
                if key not in seen and self._valid(assign, bind):
                    seen.add(key)
                    found.append((dict(assign), dict(bind)))
                return
            j, cands = self._candidates(assign, bind)
            for name in cands:
                new = self._fits(j, name, assign, bind)
                if new is not None:
                    assign[j] = name
                    extend(assign, new)
                    del assign[j]

        for j, name in seeds:
            bind = self._fits(j, name, {}, {})
            if bind is not None:
                extend({j: name}, bind)
        return found


def find_matches(index: GraphIndex, rule: Rule, anchors: Iterable[str] | None = None,
                 seeds: list[tuple[int, str]] | None = None) -> list[Match]:
    """Every valid match of ``rule.src`` in the indexed graph (only those using an anchor node if given, or
    growing from the given (pattern node, graph node) seeds)."""
    pattern = rule.src
    if not pattern.nodes:
        return []
    if seeds is None and anchors is None:
        seeds = [(0, name) for name in index.by_op.get(pattern.nodes[0].op, [])]
    elif seeds is None:
        seeds = []
        for name in anchors:  # type: ignore[union-attr]
            v = index.view.get(name)
            if v is None:
                continue
            seeds.extend((j, name) for j, pn in enumerate(pattern.nodes) if pn.op == v.op)
    results = _Matcher(pattern, index).run(seeds)
    return [Match(rule, tuple(a[i] for i in range(len(pattern.nodes))), tuple(sorted(b.items())))
            for a, b in results]


def connected(pattern: Pattern) -> bool:
    """True when every pattern node is linked to the others by edges or shared pattern inputs.

    A source pattern of unrelated pieces (``ewadd(x0,x1), ewadd(x2,x3)``) matches every pair of nodes in a
    graph - quadratic in the model size - and merging unrelated computations is not a substitution the
    search should spend its budget on, so such rules are not matched.
    """
    n = len(pattern.nodes)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    by_input: dict[str, int] = {}
    for j, pn in enumerate(pattern.nodes):
        for r in pn.inputs:
            ref = _ref(r)
            other = ref[0] if ref is not None else by_input.setdefault(r, j)
            parent[find(j)] = find(other)
    return len({find(i) for i in range(n)}) <= 1


def with_reverses(rules: list[Rule]) -> list[Rule]:
    """The rules plus each rule read right to left (``name~rev``) where that is a different, applicable rule.

    A verified rule is an equivalence, so its reverse is verified too; it is applicable when the target
    pattern uses every input of the source (otherwise matching the target could not bind them).  Whether
    the generator kept ``a => b`` or ``b => a`` after pruning then no longer decides what the search can do
    (e.g. merging bias adds *into* a split versus distributing them over it).
    """
    seen = {(r.src.render(), r.dst.render()) for r in rules}
    out = list(rules)
    for r in rules:
        if not r.dst.nodes or not set(r.src.input_names()) <= set(r.dst.input_names()):
            continue
        key = (r.dst.render(), r.src.render())
        if key not in seen:
            seen.add(key)
            out.append(Rule(f"{r.name}~rev", r.dst, r.src, r.verified))
    return out


class RuleIndex:
    """Rules grouped by the operators their source patterns use, so anchored matching skips rules that
    cannot contain an anchor node's operator."""

    def __init__(self, rules: list[Rule]):
        # Source patterns must be connected and made of operators a graph node can be: constants such as
        # Imatmul or Iconv only ever appear on the target side of an applicable rule.
        importable = {name for name, spec in ops.REGISTRY.items() if spec.onnx_types}
        self.rules = [r for r in rules if r.src.nodes and connected(r.src)
                      and all(pn.op in importable for pn in r.src.nodes)]
        self.skipped = len(rules) - len(self.rules)
        self.ops = [frozenset(pn.op for pn in r.src.nodes) for r in self.rules]
        # where each (operator, parameters) occurs in source patterns: an anchor node seeds only the rules
        # that have a pattern node it can be; symbolic parameters (split sizes) are indexed by operator
        self.exact: dict[tuple[str, tuple], list[tuple[int, int]]] = {}
        self.loose: dict[str, list[tuple[int, int]]] = {}
        for i, r in enumerate(self.rules):
            c = _compile(r.src)
            for j, pn in enumerate(r.src.nodes):
                if c.symbolic[j]:
                    self.loose.setdefault(pn.op, []).append((i, j))
                else:
                    self.exact.setdefault((pn.op, pn.params), []).append((i, j))

    def all_matches(self, index: GraphIndex) -> list[Match]:
        present = {op for op, names in index.by_op.items() if names}
        out: list[Match] = []
        for r, used in zip(self.rules, self.ops):
            if used <= present:
                out.extend(find_matches(index, r))
        return out

    def matches_around(self, index: GraphIndex, anchors: set[str]) -> list[Match]:
        """Matches that use at least one anchor node."""
        present = {op for op, names in index.by_op.items() if names}
        seeds: dict[int, list[tuple[int, str]]] = {}
        for a in sorted(anchors):
            v = index.view.get(a)
            if v is None:
                continue
            for i, j in self.exact.get((v.op, v.params), []) + self.loose.get(v.op, []):
                if self.ops[i] <= present and _compile(self.rules[i].src).plausible(j, a, index):
                    seeds.setdefault(i, []).append((j, a))
        out: list[Match] = []
        for i in sorted(seeds):
            out.extend(find_matches(index, self.rules[i], seeds=seeds[i]))
        return out
