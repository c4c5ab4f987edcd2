"""Pruning of candidate rules (TASO section 4.3): keep only rules that are not implied by a more general one.

* **common subgraph**: source and target contain the same op application (same op, params and inputs).
  Replacing that shared computation by a fresh input gives a more general rule with fewer operators, which
  the enumeration also produces (it enumerates every smaller graph), so the specific one is dropped.
* **common final operator**: source and target end in the same op with the same params, and each of its
  inputs computes the same value on both sides.  Then the rule is the composition of the smaller rules
  between those inputs (enumerated as smaller graphs), so it is dropped.
* **equal up to renaming**: rules that differ only in the names of their inputs (or the order of the
  arguments of commutative ops, or the order of their outputs) are one rule; :func:`canonical` computes a
  renaming-invariant key.  A multi-output rule whose target is its own source renamed (outputs permuted)
  only reorders a concat and is dropped (:func:`only_reorders`).
"""
from __future__ import annotations

import itertools
from typing import Any

from graphopt import ops
from graphopt.rules import Pattern, Rule


def shares_subgraph(src_apps: tuple[str, ...], dst_apps: tuple[str, ...]) -> bool:
    return not set(src_apps).isdisjoint(dst_apps)


def common_final_op(en: Any, src: tuple, dst: tuple) -> bool:
    """True when both single-output graphs end in the same op whose inputs agree value-wise."""
    (s_apps, s_out), (d_apps, d_out) = src, dst
    if len(s_out) != 1 or len(d_out) != 1 or not s_apps or not d_apps:
        return False
    s_t, d_t = en.tensors[s_out[0]], en.tensors[d_out[0]]
    if s_t.op_key is None or d_t.op_key is None:
        return False
    a, b = en.apps[s_t.op_key], en.apps[d_t.op_key]
    if a.op != b.op or a.params != b.params or len(a.inputs) != len(b.inputs):
        return False
    if a.outputs.index(s_out[0]) != b.outputs.index(d_out[0]):
        return False
    ha = [en.tensors[t].vhash for t in a.inputs]
    hb = [en.tensors[t].vhash for t in b.inputs]
    if ops.REGISTRY[a.op].commutative:
        return sorted(ha) == sorted(hb)
    return ha == hb


# ---- renaming-invariant canonical form -----------------------------------------------------------------

def _terms(p: Pattern, names: dict[str, str] | None) -> list[str]:
    """Tree form of each output; inputs renamed by ``names`` (None: anonymous ``_``)."""
    memo: dict[str, str] = {}

    def term(r: str) -> str:
        if r.startswith("x"):
            return "_" if names is None else names.get(r, r)
        if r in memo:
            return memo[r]
        k, _, port = r[1:].partition(":")
        n = p.nodes[int(k)]
        args = [term(i) for i in n.inputs]
        if ops.REGISTRY[n.op].commutative:
            args.sort()
        params = []
        for key, v in n.params:
            if key == "sizes" and names is not None:
                v = tuple(_rename_sym(s, names) for s in v)
            elif key == "sizes":
                v = tuple("_" + s.partition(".")[2] if isinstance(s, str) else s for s in v)
            params.append(f"{key}={v}")
        s = f"{n.op}[{';'.join(params)}]({','.join(args)})" + (f".{port}" if n.n_outputs > 1 else "")
        memo[r] = s
        return s

    return [term(o) for o in p.outputs]


def _rename_sym(s: Any, names: dict[str, str]) -> Any:
    if not isinstance(s, str):
        return s
    base, _, d = s.partition(".")
    return f"{names.get(base, base)}.{d}"


def _first_occurrence(p: Pattern) -> list[str]:
    """Inputs in order of first use, visiting commutative arguments in a name-independent order."""
    order: list[str] = []
    anon: dict[str, str] = {}

    def anon_term(r: str) -> str:
        if r not in anon:
            anon[r] = _terms(Pattern(p.nodes, (r,)), None)[0] if not r.startswith("x") else "_"
        return anon[r]

    def visit(r: str) -> None:
        if r.startswith("x"):
            if r not in order:
                order.append(r)
            return
        n = p.nodes[int(r[1:].partition(":")[0])]
        args = list(n.inputs)
        if ops.REGISTRY[n.op].commutative:
            args.sort(key=anon_term)
        for a in args:
            visit(a)
        for key, v in n.params:
            if key == "sizes":
                for s in v:
                    if isinstance(s, str):
                        visit(s.partition(".")[0])

    outs = sorted(p.outputs, key=anon_term)
    for o in outs:
        visit(o)
    return order


def canonical(rule: Rule) -> str:
    """Key equal for rules that are the same up to input renaming, commutative-argument and output order.

    The minimum over all renamings (rules have at most a handful of inputs); beyond 5 inputs the renaming
    follows first use, which can only miss duplicates, never merge different rules.
    """
    inputs = rule.src.input_names()
    if len(inputs) > 5:
        orders = [_first_occurrence(rule.src)]
    else:
        orders = [list(p) for p in itertools.permutations(inputs)]
    best = None
    for order in orders:
        names = {x: f"i{k}" for k, x in enumerate(order)}
        pairs = sorted(zip(_terms(rule.src, names), _terms(rule.dst, names)))
        key = " | ".join(f"{a} => {b}" for a, b in pairs)
        if best is None or key < best:
            best = key
    return best


def only_reorders(rule: Rule) -> bool:
    """A multi-output rule whose target is its own source graph with inputs renamed and outputs permuted -
    an isomorphic graph, e.g. merging two bias adds as concat(b1, b2) versus concat(b2, b1)."""
    if len(rule.src.outputs) < 2 or len(rule.src.nodes) != len(rule.dst.nodes):
        return False
    inputs = rule.src.input_names()
    if len(inputs) > 5:
        return False
    dst_terms = sorted(_terms(rule.dst, {x: x for x in inputs}))
    for perm in itertools.permutations(inputs):
        names = dict(zip(inputs, perm))
        if sorted(_terms(rule.src, names)) == dst_terms:
            return True
    return False


def dedup(rules: list[Rule]) -> list[Rule]:
    """Keep the first rule of each renaming class (and drop multi-output rules that only reorder)."""
    seen: set[str] = set()
    out: list[Rule] = []
    for r in rules:
        if only_reorders(r):
            continue
        key = canonical(r)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out
