"""TASO's substitution generator: enumerate small graphs, fingerprint them, pair up equal ones.

Enumeration runs per *domain*: a set of small named input tensors (TASO's matrices, images, kernels and
scalar, plus transformer-shaped activations and biases) and the operator variants (op + concrete params)
that make sense on them.  A depth-first search adds one operator at a time up to ``max_ops``:

* no duplicate computation: an op applied to the same inputs twice is skipped (tensors are identified by a
  structural key, so this is a set lookup);
* symmetry breaking: commutative ops take their inputs in sorted order, and a graph is only built in its
  lexicographically smallest topological order (a new op must have a larger key than the previous one
  unless it consumes the previous one's output), plus a seen-set for the remaining duplicates;
* split follows TASO's split-tree semantics: a tensor may only be split along an axis where a concat put a
  boundary, and the split sizes are the symbolic dims (``"x1.0"``) of the concatenated tensors, tracked
  through the operators that preserve that axis;
* enlarge and the constants only apply to domain inputs (TASO's restriction against junk rules);
* binary data ops never read one tensor twice (the rule over two inputs also covers that case), images
  and kernels keep their roles (a 4x4x3x3 kernel is never convolved as an image: identities that only hold
  for such tiny shapes would follow), and a graph that recomputes a value it already has inside (e.g.
  ``matmul(transpose(transpose(x)), y)``) is cut: its rules follow from the collapsing rule plus a smaller one;
* a two-output graph must share an ancestor between its outputs, and a two-output pair only becomes a
  rule when one side shares work between the outputs (that side is the target: TASO's "merge two matmuls");
  otherwise it is just two single-output rules.

A graph's outputs are the tensors no other op of the graph consumes (at most two are kept: single- and
two-output rules).  Its fingerprint is a symmetric hash over the hashes (shape + int64 contents, see
:data:`graphopt.ops.INT`) of its outputs.  Graphs with equal fingerprints form candidate pairs, which are
then confirmed on float inputs in [-1, 1] (tolerance 1e-5) and turned into :class:`graphopt.rules.Rule`
objects with the input/output mapping inferred from the per-output hashes.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from graphopt import ops, prune
from graphopt.ops.base import FLOAT, INT
from graphopt.rules import Pattern, PNode, Rule


class SymDim(int):
    """An int dimension that remembers which domain-input dim it came from (``"in.d"``), for split trees."""

    sym: str

    def __new__(cls, value: int, sym: str) -> "SymDim":
        obj = super().__new__(cls, value)
        obj.sym = sym
        return obj


@dataclass(frozen=True)
class DomainInput:
    name: str
    shape: tuple[int, ...]
    # optional split tree on one axis: (axis, (input, dim), (input, dim)) = this tensor is a concat there
    tree: tuple[int, tuple[str, int], tuple[str, int]] | None = None
    role: str = "any"  # "img" / "kernel": conv reads an image and a kernel, never a kernel as an image


@dataclass(frozen=True)
class Domain:
    name: str
    inputs: tuple[DomainInput, ...]
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]  # (op, frozen params)
    max_ops: int | None = None  # per-domain cap (None: the global max_ops)


# Domains whose enumeration at 4 operators is too large for Python within the 10-minute budget stay at 3
# when --max-ops 4 is asked for (measured: the linear domain alone takes 70 s and yields ~6000 candidates).
BIG = 3


def _v(op: str, **params: Any) -> tuple[str, tuple[tuple[str, Any], ...]]:
    return op, tuple(sorted(params.items()))


def _conv_variants(strides=((1, 1), (2, 2)), pads=("SAME", "VALID"), acts=("none", "relu")):
    return [_v("conv2d", stride=s, pad=p, act=a, groups=1) for s in strides for p in pads for a in acts]


def default_domains() -> list[Domain]:
    """The input sets and operator variants enumerated for the shipped library."""
    split_concat = [_v("concat", axis=0), _v("concat", axis=1), _v("split", axis=0), _v("split", axis=1)]
    pools = [_v("pool2d_avg", kernel=(3, 3), stride=(1, 1), pad="SAME"),
             _v("pool2d_max", kernel=(3, 3), stride=(1, 1), pad="SAME")]
    img, k3 = (2, 4, 5, 5), (4, 4, 3, 3)
    return [
        # TASO's matrix world: three square matrices and a scalar
        Domain("matrix", (DomainInput("a", (4, 4)), DomainInput("b", (4, 4)), DomainInput("c", (4, 4)),
                          DomainInput("s", ())),
               tuple([_v("matmul"), _v("ewadd"), _v("ewmul"), _v("relu"), _v("transpose", perm=(1, 0)),
                      _v("smul")] + split_concat), BIG),
        # identity constants (TASO's Imatmul / Iewmul), on their own so they do not multiply junk
        Domain("matrix-identity", (DomainInput("a", (4, 4)), DomainInput("b", (4, 4))),
               tuple([_v("matmul"), _v("ewadd"), _v("ewmul"), _v("Imatmul"), _v("Iewmul"),
                      _v("transpose", perm=(1, 0))]), BIG),
        # TASO's images and 3x3 kernels, all conv variants
        Domain("conv", (DomainInput("x", img, role="img"), DomainInput("w", k3, role="kernel"), DomainInput("v", k3, role="kernel")),
               tuple(_conv_variants(strides=((1, 1),)) + [_v("conv2d", stride=(2, 2), pad="SAME", act=a, groups=1)
                                                          for a in ("none", "relu")]
                     + [_v("relu"), _v("ewadd")] + pools + split_concat), BIG),
        # kernels of different sizes: enlarge (1x3 -> 3x3) to merge them
        Domain("conv-enlarge", (DomainInput("x", img, role="img"), DomainInput("w", k3, role="kernel"), DomainInput("u", (4, 4, 1, 3), role="kernel")),
               tuple(_conv_variants(strides=((1, 1),), pads=("SAME",)) + [_v("enlarge"), _v("ewadd")]
                     + split_concat)),
        # identity kernel and pooling-as-convolution (TASO's Iconv / Cpool)
        Domain("conv-identity", (DomainInput("x", img, role="img"), DomainInput("w", k3, role="kernel")),
               tuple(_conv_variants(strides=((1, 1),), pads=("SAME",)) + [
                   _v("relu"), _v("ewadd"), _v("Iconv"), _v("Cpool", kernel=(3, 3))] + pools)),
        # batch-axis merges: two images, one kernel, scalar
        Domain("conv-batch", (DomainInput("x", img, role="img"), DomainInput("y", img, role="img"), DomainInput("w", k3, role="kernel"),
                              DomainInput("s", ())),
               tuple(_conv_variants(strides=((1, 1),)) + [_v("relu"), _v("ewadd"), _v("ewmul"), _v("smul")]
                     + pools + split_concat), BIG),
        # conv biases as the search sees them (Conv(x, w, b) -> conv2d + bias_add of a [C,1,1] bias); t is the
        # output of two merged convs (split tree on channels) so their bias adds can be merged too
        Domain("conv-bias", (DomainInput("x", img, role="img"), DomainInput("w", k3, role="kernel"),
                             DomainInput("b", (4, 1, 1)), DomainInput("d", (4, 1, 1)),
                             DomainInput("t", (2, 8, 5, 5), tree=(1, ("b", 0), ("d", 0)), role="img")),
               tuple(_conv_variants(strides=((1, 1),), pads=("SAME",)) + [
                   _v("bias_add"), _v("relu"), _v("concat", axis=0), _v("concat", axis=1), _v("split", axis=1)]),
               BIG),
        # transformer projections: [B,S,H] activation, [H,H] weights, [H] biases; t is a concat of two
        # H-wide projections (split tree on its last axis) so bias adds can be merged across a split
        Domain("linear", (DomainInput("x", (2, 3, 4)), DomainInput("w", (4, 4)), DomainInput("v", (4, 4)),
                          DomainInput("b", (4,)), DomainInput("d", (4,)),
                          DomainInput("t", (2, 3, 8), tree=(2, ("b", 0), ("d", 0)))),
               tuple([_v("matmul"), _v("bias_add"), _v("relu"), _v("concat", axis=0), _v("concat", axis=1),
                      _v("concat", axis=2), _v("split", axis=1), _v("split", axis=2), _v("split", axis=0)]), BIG),
        # attention: batched matmuls with transposes, scalar scaling
        Domain("attention", (DomainInput("q", (2, 3, 4)), DomainInput("k", (2, 3, 4)),
                             DomainInput("r", (2, 4, 3)), DomainInput("s", ())),
               tuple([_v("bmatmul"), _v("ewadd"), _v("smul"), _v("relu"), _v("transpose", perm=(0, 2, 1)),
                      _v("transpose", perm=(1, 0, 2)), _v("concat", axis=0), _v("concat", axis=1),
                      _v("concat", axis=2), _v("split", axis=0), _v("split", axis=1), _v("split", axis=2)]), BIG),
    ]


# ---- enumeration ----------------------------------------------------------------------------------------

@dataclass
class Tensor:
    key: str
    shape: tuple
    value: np.ndarray
    vhash: bytes
    tree: dict[int, tuple[SymDim, SymDim]]
    is_input: bool
    op_key: str | None = None  # producing op application (None for inputs)
    role: str = "any"


@dataclass(frozen=True)
class OpApp:
    key: str
    op: str
    params: tuple[tuple[str, Any], ...]
    inputs: tuple[str, ...]   # tensor keys
    outputs: tuple[str, ...]  # tensor keys


@dataclass
class Enumeration:
    """Result of enumerating one domain: graphs grouped by fingerprint, plus the tables to rebuild them."""

    domain: Domain
    tensors: dict[str, Tensor] = field(default_factory=dict)
    apps: dict[str, OpApp] = field(default_factory=dict)
    classes: dict[bytes, list[tuple[tuple[str, ...], tuple[str, ...]]]] = field(default_factory=dict)
    graphs: int = 0


def _hash_value(shape: tuple, value: np.ndarray) -> bytes:
    h = hashlib.blake2b(digest_size=12)
    h.update(repr(tuple(int(d) for d in shape)).encode())
    h.update(np.ascontiguousarray(value, dtype=np.int64).tobytes())
    return h.digest()


def _fingerprint(vhashes: list[bytes]) -> bytes:
    """Symmetric over outputs: the graph's outputs are a set."""
    h = hashlib.blake2b(digest_size=16)
    for v in sorted(vhashes):
        h.update(v)
    return h.digest()


def propagate_tree(op: str, params: dict, ins: list[Tensor], out_rank: int, out_index: int,
                    ) -> dict[int, tuple[SymDim, SymDim]]:
    """Split-tree of an op output: which axes still carry a concat boundary (TASO's split tree)."""
    if op == "concat":
        a = params["axis"]
        return {a: (ins[0].shape[a], ins[1].shape[a])}
    if op in ("relu", "smul", "bias_add"):
        return dict(ins[0].tree)
    if op in ("ewadd", "ewmul"):
        return {**ins[1].tree, **ins[0].tree}
    if op == "transpose":
        perm = params["perm"]
        return {i: ins[0].tree[p] for i, p in enumerate(perm) if p in ins[0].tree}
    if op in ("matmul", "bmatmul"):
        ra, rb = len(ins[0].shape), len(ins[1].shape)
        tree = {ax: t for ax, t in ins[0].tree.items() if ax != ra - 1}
        if rb - 1 in ins[1].tree:
            tree[out_rank - 1] = ins[1].tree[rb - 1]
        return tree
    if op == "conv2d":
        tree = {0: ins[0].tree[0]} if 0 in ins[0].tree else {}
        if 0 in ins[1].tree and params.get("groups", 1) == 1:
            tree[1] = ins[1].tree[0]
        return tree
    if op in ("pool2d_max", "pool2d_avg"):
        return {ax: t for ax, t in ins[0].tree.items() if ax in (0, 1)}
    if op == "split":
        return {ax: t for ax, t in ins[0].tree.items() if ax != params["axis"]}
    return {}


_INPUT_ONLY = ("enlarge", "Iconv", "Imatmul", "Iewmul", "Cpool")
# Binary data ops never read one tensor twice: a rule over distinct inputs also matches a graph where both
# are bound to the same tensor, so the same-input variants would only add less general rules.
_DISTINCT_INPUTS = ("ewadd", "ewmul", "matmul", "bmatmul", "concat", "bias_add", "conv2d", "enlarge")


def _role(op: str, roles: list[str]) -> str | None:
    """Role of an op's output, or None when the op would read a kernel as an image (or vice versa).

    Without roles a 4x4x3x3 kernel is also a valid 4-channel 3x3 image, and convolving kernels produces
    identities that only hold for those tiny shapes (e.g. a 3x3 max pool of a 1x1 image is the identity).
    """
    if op == "conv2d":
        return "img" if roles[0] in ("img", "any") and roles[1] in ("kernel", "any") else None
    if op in ("pool2d_max", "pool2d_avg", "Cpool"):
        return ("kernel" if op == "Cpool" else "img") if roles[0] in ("img", "any") else None
    if op in ("enlarge", "Iconv"):
        return "kernel" if all(r in ("kernel", "any") for r in roles) else None
    data = [r for r in roles if r != "any"]
    if op in ("smul",):
        data = [r for r in roles[:1] if r != "any"]
    if len(set(data)) > 1:
        return None
    return data[0] if data else "any"


class _Enumerator:
    def __init__(self, domain: Domain, max_ops: int, seed: int = 0):
        self.domain = domain
        self.max_ops = min(max_ops, domain.max_ops or max_ops)
        self.res = Enumeration(domain)
        self.shape_cache: dict[tuple, Any] = {}
        self.seen: set[frozenset[str]] = set()
        rng = np.random.default_rng(seed)
        self.inputs: list[str] = []
        for di in domain.inputs:
            shape = tuple(SymDim(d, f"{di.name}.{i}") for i, d in enumerate(di.shape))
            value = rng.integers(-100, 101, size=di.shape).astype(np.int64)
            tree = {}
            if di.tree:
                ax, (n1, d1), (n2, d2) = di.tree
                s1 = next(x for x in domain.inputs if x.name == n1).shape[d1]
                s2 = next(x for x in domain.inputs if x.name == n2).shape[d2]
                tree = {ax: (SymDim(s1, f"{n1}.{d1}"), SymDim(s2, f"{n2}.{d2}"))}
            t = Tensor(key="in:" + di.name, shape=shape, value=value, vhash=_hash_value(shape, value), tree=tree,
                       is_input=True, op_key=None, role=di.role)
            self.res.tensors[t.key] = t
            self.inputs.append(t.key)

    # -- one op application ----------------------------------------------------------------------------
    def apply(self, op: str, fparams: tuple, in_keys: tuple[str, ...]) -> OpApp | None:
        key = f"{op}{fparams}({','.join(in_keys)})"
        hit = self.res.apps.get(key)
        if hit is not None or key in self.shape_cache:
            return hit
        if op in _DISTINCT_INPUTS and in_keys[0] == in_keys[1]:
            self.shape_cache[key] = None
            return None
        ins = [self.res.tensors[k] for k in in_keys]
        role = _role(op, [t.role for t in ins])
        if role is None:
            self.shape_cache[key] = None
            return None
        spec = ops.REGISTRY[op]
        params = dict(fparams)
        if op == "split":
            tree = ins[0].tree.get(params["axis"])
            if tree is None or not all(isinstance(d, SymDim) for d in tree):
                self.shape_cache[key] = None
                return None
            params["sizes"] = (int(tree[0]), int(tree[1]))
        try:
            out_shapes = spec.shape(params, [t.shape for t in ins])
        except ValueError:
            self.shape_cache[key] = None
            return None
        values = spec.ref(params, [t.value for t in ins], INT)
        if op == "split":  # the rule keeps the sizes symbolic: dims of the concatenated inputs
            params["sizes"] = (tree[0].sym, tree[1].sym)
        out_keys = []
        for i, (shape, value) in enumerate(zip(out_shapes, values)):
            tkey = f"{key}#{i}" if len(out_shapes) > 1 else key
            tree = propagate_tree(op, params, ins, len(shape), i)
            self.res.tensors[tkey] = Tensor(key=tkey, shape=shape, value=value, vhash=_hash_value(shape, value),
                                            tree=tree, is_input=False, op_key=key, role=role)
            out_keys.append(tkey)
        app = OpApp(key, op, tuple(sorted(params.items())), tuple(in_keys), tuple(out_keys))
        self.res.apps[key] = app
        return app

    def candidates(self, avail: list[str], new: list[str]) -> Iterator[OpApp]:
        """Op applications over ``avail`` that read at least one tensor of ``new``."""
        newset = set(new)
        for op, fparams in self.domain.variants:
            spec = ops.REGISTRY[op]
            if op in _INPUT_ONLY and not all(self.res.tensors[k].is_input for k in new):
                continue
            n = spec.n_inputs
            combos = (itertools.combinations_with_replacement(avail, n) if spec.commutative
                      else itertools.product(avail, repeat=n))
            for combo in combos:
                if not newset.intersection(combo):
                    continue
                if op in _INPUT_ONLY and not all(self.res.tensors[k].is_input for k in combo):
                    continue
                app = self.apply(op, fparams, combo)
                if app is not None:
                    yield app

    # -- depth-first search ----------------------------------------------------------------------------
    def run(self, part: tuple[int, int] | None = None) -> Enumeration:
        """Enumerate; ``part=(k, n)`` keeps only first ops with index % n == k (to split work)."""
        for k in self.inputs:  # zero-op graphs: a single input (rules like transpose(transpose(x)) => x)
            self._record((), (k,))
        for a, b in itertools.combinations(self.inputs, 2):
            self._record((), (a, b))
        first = list(self.candidates(list(self.inputs), list(self.inputs)))
        for i, app in enumerate(first):
            if part and i % part[1] != part[0]:
                continue
            self._dfs([app], first)
        return self.res

    def _dfs(self, graph: list[OpApp], cands: list[OpApp]) -> None:
        ids = frozenset(a.key for a in graph)
        if ids in self.seen:
            return
        self.seen.add(ids)
        produced = [o for a in graph for o in a.outputs]
        consumed = {i for a in graph for i in a.inputs}
        sinks = tuple(o for o in produced if o not in consumed)
        if any(self._undoes_concat(a) for a in graph) and len(graph) > 2:
            return
        if self._recomputes(graph, produced, set(consumed)):
            return
        if len(sinks) == 1 or (len(sinks) == 2 and self._connected(graph, sinks)):
            self._record(tuple(a.key for a in graph), sinks)
        if len(graph) >= self.max_ops:
            return
        # sinks beyond what the remaining ops can consume can never shrink to <= 2 outputs
        if len(sinks) - 2 > 2 * (self.max_ops - len(graph)):
            return
        last = graph[-1]
        if self._undoes_concat(last):
            return
        cands = cands + list(self.candidates(self.inputs + produced, list(last.outputs)))
        for app in cands:
            if app.key in ids:
                continue
            if app.key < last.key and not set(app.inputs) & set(last.outputs):
                continue
            self._dfs(graph + [app], cands)

    def _recomputes(self, graph: list[OpApp], produced: list[str], consumed: set[str]) -> bool:
        """True when an intermediate result equals a tensor the graph already has (e.g. transpose(transpose(x))
        used by another op, or matmul(x, Imatmul)): every rule built on it is implied by the rule that
        collapses that detour (kept: there the detour is the graph's output) plus a smaller rule.  Graphs
        growing from it stay redundant, so the search below it is cut too."""
        have = {self.res.tensors[t].vhash: t for t in self.inputs}
        for a in graph:
            for o in a.outputs:
                h = self.res.tensors[o].vhash
                if h in have and o in consumed:
                    return True
                have.setdefault(h, o)
        return False

    def _undoes_concat(self, app: OpApp) -> bool:
        """split(concat(x, y)) along the concat axis is just (x, y): kept only as that 2-op rule itself."""
        if app.op != "split":
            return False
        src = self.res.tensors[app.inputs[0]]
        return src.op_key is not None and self.res.apps[src.op_key].op == "concat" and dict(
            self.res.apps[src.op_key].params)["axis"] == dict(app.params)["axis"]

    def _connected(self, graph: list[OpApp], sinks: tuple[str, ...]) -> bool:
        """Two outputs form one rule only if they share an ancestor (else they are two separate rules)."""
        by_out = {o: a for a in graph for o in a.outputs}

        def ancestors(t: str) -> set[str]:
            seen, stack = set(), [t]
            while stack:
                x = stack.pop()
                if x in seen:
                    continue
                seen.add(x)
                if x in by_out:
                    stack.extend(by_out[x].inputs)
            return seen
        return bool(ancestors(sinks[0]) & ancestors(sinks[1]))

    def _record(self, app_keys: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        self.res.graphs += 1
        fp = _fingerprint([self.res.tensors[o].vhash for o in outputs])
        self.res.classes.setdefault(fp, []).append((app_keys, outputs))


def enumerate_domain(domain: Domain, max_ops: int, part: tuple[int, int] | None = None) -> Enumeration:
    return _Enumerator(domain, max_ops).run(part)


# ---- candidate pairs -> rules --------------------------------------------------------------------------

def _to_pattern(en: Enumeration, app_keys: tuple[str, ...], outputs: tuple[str, ...],
                names: dict[str, str]) -> Pattern:
    """Pattern of one enumerated graph; ``names`` maps domain-input tensor keys to x0, x1, ..."""
    apps = [en.apps[k] for k in app_keys]
    ref: dict[str, str] = dict(names)
    nodes: list[PNode] = []
    for i, a in enumerate(apps):
        params = dict(a.params)
        if a.op == "split":
            params["sizes"] = tuple(_rename_sym(s, names) for s in params["sizes"])
        nodes.append(PNode.make(a.op, [ref[t] for t in a.inputs], len(a.outputs), **params))
        for j, o in enumerate(a.outputs):
            ref[o] = f"n{i}:{j}"
    return Pattern(tuple(nodes), tuple(ref[o] for o in outputs))


def _rename_sym(sym: str, names: dict[str, str]) -> str:
    base, _, d = sym.partition(".")
    return f"{names['in:' + base]}.{d}"


def _inputs_used(en: Enumeration, app_keys, outputs) -> list[str]:
    used: list[str] = []
    for k in app_keys:
        a = en.apps[k]
        for t in a.inputs:
            if t.startswith("in:") and t not in used:
                used.append(t)
        if a.op == "split":
            for s in dict(a.params)["sizes"]:
                t = "in:" + s.partition(".")[0]
                if t not in used:
                    used.append(t)
    for o in outputs:
        if o.startswith("in:") and o not in used:
            used.append(o)
    return used


def _float_eval(en: Enumeration, app_keys, outputs, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    vals = dict(feeds)
    for k in app_keys:
        a = en.apps[k]
        params = dict(a.params)
        if a.op == "split":
            params["sizes"] = tuple(int(en.tensors[o].shape[params["axis"]]) for o in a.outputs)
        outs = ops.REGISTRY[a.op].ref(params, [vals[t] for t in a.inputs], FLOAT)
        vals.update(zip(a.outputs, outs))
    return [vals[o] for o in outputs]


def _size(graph) -> int:
    return len(graph[0])


@dataclass
class PairStats:
    candidate_pairs: int = 0
    common_subgraph: int = 0
    common_final_op: int = 0
    not_a_rule: int = 0      # target needs an input the source does not bind, or ambiguous outputs
    float_rejected: int = 0


def candidate_rules(en: Enumeration, seed: int = 1) -> tuple[PairStats, list[Rule]]:
    """Fingerprint-equal pairs of one domain -> float-confirmed rules, pruned of implied pairs.

    Pairs sharing a subgraph or ending in a common operator are dropped here (see :mod:`graphopt.prune`),
    because the enumeration holds the more general rule; renaming duplicates are dropped later, across
    domains.  Rules are oriented from the larger graph to the smaller (ties: a name-independent order).
    """
    rng = np.random.default_rng(seed)
    feeds = {t.key: rng.uniform(-1, 1, size=tuple(int(d) for d in t.shape)) for t in en.tensors.values()
             if t.is_input}
    st = PairStats()
    out: list[Rule] = []
    for members in en.classes.values():
        if len(members) < 2:
            continue
        for g1, g2 in itertools.combinations(members, 2):
            st.candidate_pairs += 1
            if prune.shares_subgraph(g1[0], g2[0]):
                st.common_subgraph += 1
                continue
            if prune.common_final_op(en, g1, g2):
                st.common_final_op += 1
                continue
            rule = _make_rule(en, g1, g2)
            if rule is None:
                st.not_a_rule += 1
                continue
            src, dst = rule
            a = _float_eval(en, *src, feeds)
            b = _float_eval(en, *dst, feeds)
            if not all(x.shape == y.shape and np.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(a, b)):
                st.float_rejected += 1
                continue
            src_in = _inputs_used(en, *src)
            names = {k: f"x{i}" for i, k in enumerate(src_in)}
            out.append(Rule("", _to_pattern(en, *src, names), _to_pattern(en, *dst, names),
                            input_ranks=tuple(len(en.tensors[k].shape) for k in src_in)))
    return st, out


def _anon(en: Enumeration, graph) -> tuple:
    return (_size(graph), sorted(_anon_term(en, o) for o in graph[1]))


def _anon_term(en: Enumeration, t: str) -> str:
    tensor = en.tensors[t]
    if tensor.op_key is None:
        return "_" + repr(tuple(int(d) for d in tensor.shape))
    a = en.apps[tensor.op_key]
    args = [_anon_term(en, i) for i in a.inputs]
    if ops.REGISTRY[a.op].commutative:
        args.sort()
    return f"{a.op}{a.params}({','.join(args)})#{a.outputs.index(t)}"


def _shares_work(en: Enumeration, graph) -> bool:
    """True when some op of a two-output graph, other than the split that separates them, is an ancestor of
    both outputs: (split -> bias_add, bias_add) shares nothing, split(bias_add(t, concat(b, d))) does."""
    def ancestors(t: str) -> set[str]:
        seen, stack = set(), [t]
        while stack:
            x = en.tensors[stack.pop()]
            if x.op_key and x.op_key not in seen:
                seen.add(x.op_key)
                stack.extend(en.apps[x.op_key].inputs)
        return seen
    a, b = graph[1]
    return any(en.apps[k].op != "split" for k in ancestors(a) & ancestors(b))


def _make_rule(en: Enumeration, g1, g2):
    """Orient the pair and map outputs; None if it cannot be a rule."""
    k1, k2 = _anon(en, g1), _anon(en, g2)
    src, dst = (g1, g2) if k1 >= k2 else (g2, g1)
    if len(g1[1]) == 2:
        # a two-output rule is only worth having when its target shares work between the outputs (TASO's
        # "merge two matmuls"); otherwise it is two single-output rules applied one after the other
        s1, s2 = _shares_work(en, g1), _shares_work(en, g2)
        if not (s1 or s2):
            return None
        if s1 != s2:
            src, dst = (g2, g1) if s1 else (g1, g2)
    if _size(src) == 0:
        return None
    if not set(_inputs_used(en, *dst)) <= set(_inputs_used(en, *src)):
        return None
    sh = [en.tensors[o].vhash for o in src[1]]
    dh = [en.tensors[o].vhash for o in dst[1]]
    if len(set(sh)) != len(sh):
        return None
    return src, (dst[0], tuple(dst[1][dh.index(h)] for h in sh))


def evaluate_pattern(pattern: Pattern, inputs: dict[str, np.ndarray], arith=FLOAT) -> list[np.ndarray]:
    """Run a rule pattern on concrete inputs ``{"x0": array, ...}`` (split sizes bound from their shapes)."""
    dims = {k: np.shape(v) for k, v in inputs.items()}
    vals: dict[str, np.ndarray] = dict(inputs)
    for k, n in enumerate(pattern.nodes):
        outs = ops.evaluate(n.op, ops.bind_params(n.param_dict, dims), [vals[i] for i in n.inputs], arith)
        for j, o in enumerate(outs):
            vals[f"n{k}:{j}"] = o
    return [vals[o] for o in pattern.outputs]
