"""Generator, pruning and the shipped library."""
from __future__ import annotations

import json
import time

import numpy as np

from graphopt import generator as G
from graphopt import prune
from graphopt.library import cache_key, generate_cached
from graphopt.rules import LIBRARY_PATH, PNode, Pattern, Rule, load_meta, load_rules


def _domain(name, inputs, variants, max_ops=None):
    return G.Domain(name, tuple(G.DomainInput(n, s) for n, s in inputs), tuple(G._v(op, **p) for op, p in variants),
                    max_ops)


def _rules(domain, max_ops):
    en = G.enumerate_domain(domain, max_ops)
    st, rules = G.candidate_rules(en)
    return en, st, rules


def _numerically_equal(rule: Rule, shapes: dict[str, tuple]) -> bool:
    rng = np.random.default_rng(0)
    feeds = {f"x{i}": rng.uniform(-1, 1, size=shapes[f"x{i}"]) for i in range(len(shapes))}
    a = G.evaluate_pattern(rule.src, feeds)
    b = G.evaluate_pattern(rule.dst, feeds)
    return all(x.shape == y.shape and np.allclose(x, y) for x, y in zip(a, b))


def test_symmetry_breaking_and_no_duplicate_computation():
    d = _domain("t", [("a", (2, 2)), ("b", (2, 2))], [("ewadd", {})])
    en = G.enumerate_domain(d, 1)
    # two single inputs, the input pair, and ewadd(a, b) once (not ewadd(b, a), never ewadd(a, a))
    assert en.graphs == 4
    en2 = G.enumerate_domain(d, 2)
    keys = [k for members in en2.classes.values() for k, _ in members if k]
    assert len(keys) == len(set(frozenset(k) for k in keys))


def test_transpose_matmul_rule_found_and_numerically_true():
    d = _domain("t", [("a", (3, 4)), ("b", (4, 2))], [("matmul", {}), ("transpose", {"perm": (1, 0)})])
    en, st, rules = _rules(d, 3)
    texts = [r.render() for r in rules]
    want = "matmul(transpose[perm=1x0](x1),transpose[perm=1x0](x0)) => transpose[perm=1x0](matmul(x0,x1))"
    assert want in texts
    shapes = {"a": (3, 4), "b": (4, 2)}
    for r in rules:  # every candidate holds numerically (inputs x0.. follow the domain order of first use)
        names = G._inputs_used(en, *_graph_of(en, r))
        assert _numerically_equal(r, {f"x{i}": shapes[k[3:]] for i, k in enumerate(names)})


def _graph_of(en, rule):
    """The enumerated source graph a rule came from (found by its rendering)."""
    for members in en.classes.values():
        for g in members:
            names = {k: f"x{i}" for i, k in enumerate(G._inputs_used(en, *g))}
            if g[0] and G._to_pattern(en, *g, names).render() == rule.src.render():
                return g
    raise AssertionError("source graph not found")


def test_two_output_merge_rule_and_split_sizes():
    d = _domain("t", [("a", (2, 4)), ("b", (4, 3)), ("c", (4, 5))],
                [("matmul", {}), ("concat", {"axis": 1}), ("split", {"axis": 1})])
    en, st, rules = _rules(d, 3)
    merges = [r for r in rules if len(r.src.outputs) == 2 and [n.op for n in r.src.nodes] == ["matmul", "matmul"]]
    assert merges, [r.render() for r in rules]
    r = merges[0]
    assert sorted(n.op for n in r.dst.nodes) == ["concat", "matmul", "split"]
    split = next(n for n in r.dst.nodes if n.op == "split")
    assert all(isinstance(s, str) for s in split.param_dict["sizes"])  # symbolic: dims of the weights
    # the rule generalises to other widths than the ones it was found with
    assert _numerically_equal(r, {"x0": (3, 6), "x1": (6, 7), "x2": (6, 2)})


def test_pruning_drops_implied_rules_and_renamings():
    d = _domain("t", [("a", (3, 3)), ("b", (3, 3)), ("c", (3, 3))],
                [("ewadd", {}), ("relu", {}), ("transpose", {"perm": (1, 0)})])
    en, st, rules = _rules(d, 3)
    assert st.common_subgraph > 0 and st.common_final_op > 0
    assert st.candidate_pairs > len(rules)
    unique = prune.dedup(rules)
    assert len(unique) < len(rules)  # a, b, c are interchangeable: renamed copies collapse
    keys = [prune.canonical(r) for r in unique]
    assert len(keys) == len(set(keys))
    r = Rule("r", Pattern((PNode.make("ewadd", ["x0", "x1"]),), ("n0:0",)),
             Pattern((PNode.make("ewadd", ["x1", "x0"]),), ("n0:0",)))
    renamed = Rule("s", Pattern((PNode.make("ewadd", ["x1", "x0"]),), ("n0:0",)),
                   Pattern((PNode.make("ewadd", ["x0", "x1"]),), ("n0:0",)))
    assert prune.canonical(r) == prune.canonical(renamed)


def test_shipped_library_meets_the_bar():
    rules = load_rules(LIBRARY_PATH, verified_only=False)
    meta = load_meta(LIBRARY_PATH)
    assert len(rules) >= 743 and all(r.verified for r in rules)
    stats = meta["stats"]
    assert stats["after_pruning"] == len(rules) and stats["unverified"] == 0
    texts = [r.render() for r in rules]
    has = lambda *parts: any(all(p in t for p in parts) for t in texts)  # noqa: E731
    assert has("matmul(x0,x1), matmul(x0,x2) =>", "matmul(x0,concat[axis=1](x1,x2))")        # shared-input matmuls
    assert has("conv2d[act=none,groups=1,pad=SAME,stride=1x1](x0,x1), conv2d", "](x0,concat[axis=0](x")  # convs
    assert has("relu(conv2d[act=none", "=> conv2d[act=relu")                                  # relu fusion
    assert has("transpose[perm=1x0](matmul(", "=> matmul(transpose")                           # transpose/matmul
    assert has("bias_add(x0,x1), bias_add(x2,x1) =>", "bias_add(concat[axis=0](x")            # merged biases


def test_rebuild_with_unchanged_specs_is_instant(tmp_path):
    meta = load_meta(LIBRARY_PATH)
    out = tmp_path / "rules.json"
    out.write_text(LIBRARY_PATH.read_text())
    assert meta["cache_key"] == cache_key(meta["stats"]["max_ops"], meta["details"]["z3_timeout_ms"])
    t0 = time.perf_counter()
    got, hit = generate_cached(out, meta["stats"]["max_ops"], 2, meta["details"]["z3_timeout_ms"], progress=False)
    assert hit and time.perf_counter() - t0 < 5
    assert got["stats"] == meta["stats"]


def test_cli_stats_and_show(tmp_path, capsys):
    from pipeline.cli import graphopt_main as main
    assert main(["rules", "stats", "--json", str(tmp_path / "s.json")]) == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    assert set(stats) == {"enumerated_graphs", "candidate_pairs", "verified", "rejected", "unverified",
                          "after_pruning", "properties", "seconds", "max_ops"}
    assert main(["rules", "show", "--grep", "conv2d+relu->conv2d"]) == 0
    assert "=> conv2d[act=relu" in capsys.readouterr().out
    assert main(["rules", "stats", "--library", str(tmp_path / "missing.json")]) == 2
