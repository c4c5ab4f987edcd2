"""Matching rule patterns in model graphs and applying them (graphopt.match / graphopt.rewrite).

The rules here are written by hand in the library's format (TASO's two-output matmul merge, a bias merge
with symbolic split sizes, a relu fusion) to exercise the matcher; the shipped optimizer only ever loads the
verified library.
"""
from __future__ import annotations

import numpy as np
import pytest

from graphopt.compare import max_abs_err
from graphopt.feeds import random_inputs, run_ort
from graphopt.match import GraphIndex, RuleIndex, find_matches
from graphopt.onnx_io import export_onnx, import_onnx
from graphopt.cleanup import fold_constants
from graphopt.rewrite import RewriteError, apply_match, target_plan
from graphopt.rules import PNode, Pattern, Rule
from models.builder import GraphBuilder


def merge_matmul(rank: int = 2) -> Rule:
    """TASO: matmul(x,y1), matmul(x,y2) => split(matmul(x, concat1(y1,y2)))."""
    src = Pattern((PNode.make("matmul", ["x0", "x1"]), PNode.make("matmul", ["x0", "x2"])), ("n0:0", "n1:0"))
    dst = Pattern((PNode.make("concat", ["x1", "x2"], axis=1), PNode.make("matmul", ["x0", "n0:0"]),
                   PNode.make("split", ["n1:0"], n_outputs=2, axis=rank - 1, sizes=("x1.1", "x2.1"))),
                  ("n2:0", "n2:1"))
    return Rule(f"merge_matmul_r{rank}", src, dst, True)


def merge_bias(rank: int = 2) -> Rule:
    """split(x).0 + b1, split(x).1 + b2 => split(x + concat(b1, b2)) (split sizes symbolic)."""
    ax = rank - 1
    src = Pattern((PNode.make("split", ["x0"], n_outputs=2, axis=ax, sizes=("x1.0", "x2.0")),
                   PNode.make("bias_add", ["n0:0", "x1"]), PNode.make("bias_add", ["n0:1", "x2"])),
                  ("n1:0", "n2:0"))
    dst = Pattern((PNode.make("concat", ["x1", "x2"], axis=0), PNode.make("bias_add", ["x0", "n0:0"]),
                   PNode.make("split", ["n1:0"], n_outputs=2, axis=ax, sizes=("x1.0", "x2.0"))),
                  ("n2:0", "n2:1"))
    return Rule(f"merge_bias_r{rank}", src, dst, True)


def relu_of_matmul_to_matmul() -> Rule:
    """A deliberately *wrong* single-output rule (drops the relu): only for matcher mechanics."""
    src = Pattern((PNode.make("matmul", ["x0", "x1"]), PNode.make("relu", ["n0:0"])), ("n1:0",))
    dst = Pattern((PNode.make("matmul", ["x0", "x1"]),), ("n0:0",))
    return Rule("drop_relu", src, dst, False)


def three_projections(shared_weight: bool = False, output_inside: bool = False):
    """x -> three matmuls (+ bias) summed; optionally two matmuls share one weight, or a projection is
    both a graph output and read inside the graph."""
    b = GraphBuilder("proj", seed=1)
    x = b.input("x", (8, 16))
    ws = [b.normal(f"w{i}", (16, 16), 0.25) for i in range(3)]
    if shared_weight:
        ws[2] = ws[0]
    outs = []
    for i, w in enumerate(ws):
        y = b.op("MatMul", [x, w], f"mm{i}", out="p0" if (output_inside and i == 0) else None)
        outs.append(b.op("Add", [y, b.normal(f"b{i}", (16,), 0.1)], f"add{i}"))
    s = b.op("Add", [outs[0], outs[1]], "sum0")
    b.op("Add", [s, outs[2]], "sum1", out="y")
    b.output("y", (8, 16))
    if output_inside:
        b.output("p0", (8, 16))
    return b.model()


def _names(matches):
    return sorted(tuple(n.split("/")[-1] for n in m.nodes) for m in matches)


def test_two_output_pattern_matches_every_ordered_pair_sharing_the_input():
    g = import_onnx(three_projections())
    ms = find_matches(GraphIndex(g), merge_matmul(2))
    assert _names(ms) == [(a, b) for a in ("mm0", "mm1", "mm2") for b in ("mm0", "mm1", "mm2") if a != b]
    assert all(m.binding()["x0"] == "x" for m in ms)


def test_pattern_inputs_bind_consistently_and_params_must_be_equal():
    b = GraphBuilder("two_inputs", seed=2)
    x, z = b.input("x", (4, 8)), b.input("z", (4, 8))
    w = b.normal("w", (8, 8), 0.3)
    b.op("Add", [b.op("MatMul", [x, w], "a"), b.op("MatMul", [z, w], "b")], "s", out="y")
    b.output("y", (4, 8))
    g = import_onnx(b.model())
    assert find_matches(GraphIndex(g), merge_matmul(2)) == []  # x0 would need to be both x and z
    wrong_axis = Rule("r", Pattern((PNode.make("concat", ["x0", "x1"], axis=0),), ("n0:0",)),
                      Pattern((PNode.make("concat", ["x0", "x1"], axis=0),), ("n0:0",)))
    b = GraphBuilder("cat", seed=0)
    p, q = b.input("p", (2, 3)), b.input("q", (2, 3))
    b.op("Concat", [p, q], "c", axis=1, out="y")
    b.output("y", (2, 6))
    assert find_matches(GraphIndex(import_onnx(b.model())), wrong_axis) == []


def test_intermediate_used_outside_or_graph_output_blocks_the_match():
    def build(extra_reader: bool, as_output: bool):
        b = GraphBuilder("mmrelu", seed=3)
        x = b.input("x", (4, 8))
        m = b.op("MatMul", [x, b.normal("w", (8, 8), 0.3)], "mm", out="m" if as_output else None)
        r = b.op("Relu", [m], "relu", out="y")
        b.output("y", (4, 8))
        if extra_reader:
            b.op("Neg", [m], "neg", out="z")
            b.output("z", (4, 8))
        if as_output:
            b.output("m", (4, 8))
        return import_onnx(b.model())

    rule = relu_of_matmul_to_matmul()
    assert len(find_matches(GraphIndex(build(False, False)), rule)) == 1
    assert find_matches(GraphIndex(build(True, False)), rule) == []
    assert find_matches(GraphIndex(build(False, True)), rule) == []


def test_symbolic_split_sizes_resolve_against_bound_inputs():
    g = import_onnx(three_projections())
    index = GraphIndex(g)
    m = next(m for m in find_matches(index, merge_matmul(2)) if _names([m]) == [("mm0", "mm1")])
    g2 = apply_match(m, index).graph
    ms = find_matches(GraphIndex(g2), merge_bias(2))
    assert len(ms) == 1 and sorted(ms[0].binding()) == ["x0", "x1", "x2"]
    # A split whose sizes do not equal the bias lengths is not this pattern.
    for n in g2.nodes:
        if n.op_type == "Split":
            g2.initializers[n.inputs[1]] = np.array([4, 28], dtype=np.int64)
    assert find_matches(GraphIndex(g2), merge_bias(2)) == []


def test_apply_merges_and_folds_weights_into_one_initializer():
    proto = three_projections()
    g = import_onnx(proto)
    index = GraphIndex(g)
    m = next(m for m in find_matches(index, merge_matmul(2)) if _names([m]) == [("mm0", "mm1")])
    rw = apply_match(m, index)
    g2 = rw.graph
    assert sorted(n.split("/")[-1] for n in rw.removed) == ["mm0", "mm1"]
    assert [n.op_type for n in g2.nodes].count("MatMul") == 2
    assert len(g.nodes) == 8  # the input graph is untouched
    folded = fold_constants(g2)
    assert folded == 1
    ops = [n.op_type for n in g2.nodes]
    assert "Concat" not in ops and ops.count("Split") == 1
    merged = next(n for n in g2.nodes if n.op_type == "MatMul" and g2.shape(n.inputs[1]) == (16, 32))
    assert merged.inputs[1] in g2.initializers
    assert "w0" not in g2.initializers and "w1" not in g2.initializers
    feeds = random_inputs(g)
    assert max_abs_err(run_ort(proto, feeds), run_ort(export_onnx(g2), feeds)) < 1e-5


def test_graph_outputs_keep_their_names_and_readers():
    proto = three_projections(output_inside=True)
    g = import_onnx(proto)
    index = GraphIndex(g)
    m = next(m for m in find_matches(index, merge_matmul(2)) if _names([m]) == [("mm0", "mm2")])
    g2 = apply_match(m, index).graph
    fold_constants(g2)
    assert g2.output_names == ["y", "p0"]
    assert any("p0" in n.outputs for n in g2.nodes) and any("p0" in n.inputs for n in g2.nodes)
    feeds = random_inputs(g)
    assert max_abs_err(run_ort(proto, feeds), run_ort(export_onnx(g2), feeds)) < 1e-5


def test_cycle_and_shape_mismatch_are_rejected():
    # w2 = relu(x @ w0) reshaped as a weight: merging x@w0 with x@w2 would feed the merged matmul its own output.
    b = GraphBuilder("cyc", seed=4)
    x = b.input("x", (8, 8))
    a = b.op("MatMul", [x, b.normal("w0", (8, 8), 0.3)], "mm0")
    w2 = b.op("Relu", [a], "relu")
    b.op("MatMul", [x, w2], "mm1", out="y")
    b.output("y", (8, 8))
    g = import_onnx(b.model())
    index = GraphIndex(g)
    ms = find_matches(index, merge_matmul(2))
    assert ms, "the pattern itself matches"
    for m in ms:
        with pytest.raises(RewriteError):
            apply_match(m, index)
    # A split axis that does not fit the tensors: shapes are rechecked when the rule is applied.
    g = import_onnx(three_projections())
    index = GraphIndex(g)
    with pytest.raises(RewriteError):
        target_plan(find_matches(index, merge_matmul(3))[0], index)


def test_anchored_matching_finds_exactly_the_matches_using_an_anchor():
    g = import_onnx(three_projections())
    index = GraphIndex(g)
    rules = RuleIndex([merge_matmul(2)])
    every = rules.all_matches(index)
    mm2 = next(n for n in index.nodes if n.endswith("mm2"))
    around = rules.matches_around(index, {mm2})
    assert {m.key for m in around} == {m.key for m in every if mm2 in m.nodes}
    first = next(m for m in every if mm2 not in m.nodes)
    rw = apply_match(first, index)
    index2 = GraphIndex(rw.graph)
    # after merging mm0+mm1, the only pairs left join mm2 with the merged matmul, which is new
    after = rules.all_matches(index2)
    assert after and all(set(m.nodes) & set(rw.added) for m in after)
    assert {m.key for m in rules.matches_around(index2, set(rw.added))} == {m.key for m in after}


def test_disconnected_source_patterns_are_not_matched():
    from graphopt.match import connected

    pair = Pattern((PNode.make("ewadd", ["x0", "x1"]), PNode.make("ewadd", ["x2", "x3"])), ("n0:0", "n1:0"))
    assert not connected(pair)
    assert connected(merge_matmul(2).src) and connected(merge_bias(2).src)
    assert RuleIndex([Rule("pair", pair, pair, True), merge_matmul(2)]).skipped == 1


def test_common_subexpressions_are_merged_once():
    from graphopt.cleanup import eliminate_common_subexpressions

    b = GraphBuilder("cse", seed=8)
    x, y = b.input("x", (2, 4)), b.input("y", (2, 4))
    c1 = b.op("Concat", [x, y], "c1", axis=0)
    c2 = b.op("Concat", [x, y], "c2", axis=0)
    c3 = b.op("Concat", [x, y], "c3", axis=0, out="out2")
    b.op("Add", [b.op("Relu", [c1], "r1"), b.op("Relu", [c2], "r2")], "add", out="out")
    b.output("out", (4, 4))
    b.output("out2", (4, 4))
    proto = b.model()
    g = import_onnx(proto)
    assert eliminate_common_subexpressions(g) == 2  # c2 and then r2 (now reading c1); c3 is a graph output
    assert [n.op_type for n in g.nodes].count("Concat") == 2
    feeds = random_inputs(g)
    assert max_abs_err(run_ort(proto, feeds), run_ort(export_onnx(g), feeds)) == 0.0
