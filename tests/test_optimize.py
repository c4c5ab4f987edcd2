"""The graph stage end to end (graphopt.stage, ``graphopt optimize``): robustness on awkward graphs and
the shipped verified library on real model shapes."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from graphopt.cost.analytic import AnalyticCost
from graphopt.cost.base import CostModel
from graphopt.ir import Graph
from graphopt.onnx_io import import_onnx
from graphopt.rules import load_rules
from graphopt.stage import GraphStageOptions, GraphStageResult, optimize_graph, optimize_onnx
from pipeline.cli import graphopt_main as main
from models.bert import BertConfig, build_bert
from models.builder import GraphBuilder
from models.inception import build_inception
from test_match import merge_bias, merge_matmul, three_projections
from test_search import LaunchCost

HAND = [merge_matmul(2), merge_matmul(3), merge_bias(2), merge_bias(3)]


def optimize(proto: onnx.ModelProto, cost: CostModel, **options) -> tuple[onnx.ModelProto, dict]:
    """The graph stage on an ONNX model, with its options as keywords."""
    return optimize_onnx(proto, cost, GraphStageOptions(**options))


def graph_stage(graph: Graph, cost: CostModel, **options) -> GraphStageResult:
    """The graph stage on a graph (what the pipeline calls), with its options as keywords."""
    return optimize_graph(graph, cost, GraphStageOptions(**options))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _check(proto: onnx.ModelProto, rules=HAND, cost=None, **kw):
    out, rep = optimize(proto, cost=cost or LaunchCost(1.0, 1.5, 2.0), rules=rules, budget=60, **kw)
    assert rep["outputs_equal"] and rep["max_abs_err"] <= 1e-4, rep
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    assert [i.name for i in out.graph.input] == [i.name for i in proto.graph.input]
    onnx.checker.check_model(out)
    return out, rep


def opaque_model() -> onnx.ModelProto:
    """Two projections of x, one through Softmax, one through Erf, a custom-attribute LayerNormalization."""
    b = GraphBuilder("opaque", seed=5)
    x = b.input("x", (4, 16))
    p = b.op("MatMul", [x, b.normal("w0", (16, 16), 0.25)], "mm0")
    q = b.op("MatMul", [x, b.normal("w1", (16, 16), 0.25)], "mm1")
    s = b.op("Softmax", [p], "softmax", axis=-1)
    e = b.op("Erf", [q], "erf")
    y = b.op("Add", [s, e], "add")
    b.op("LayerNormalization", [y, b.const("g", np.ones(16, np.float32)), b.const("bb", np.zeros(16, np.float32))],
         "ln", axis=-1, epsilon=1e-5, out="y")
    b.output("y", (4, 16))
    return b.model()


def multi_output_model() -> onnx.ModelProto:
    """Three projections of one input that are all graph outputs (and one is read again inside)."""
    b = GraphBuilder("multi", seed=6)
    x = b.input("x", (4, 16))
    for i in range(3):
        b.op("MatMul", [x, b.normal(f"w{i}", (16, 8), 0.25)], f"mm{i}", out=f"y{i}")
        b.output(f"y{i}", (4, 8))
    b.op("Relu", ["y0"], "relu", out="z")
    b.output("z", (4, 8))
    return b.model()


def test_opaque_nodes_are_kept_and_routed_around():
    proto = opaque_model()
    out, rep = _check(proto)
    assert rep["applied"] == {"merge_matmul_r2": 1}
    ops = _ops(out)
    assert ops.count("MatMul") == 1 and "Concat" not in ops
    assert {"Softmax", "Erf", "LayerNormalization"} <= set(ops)


def test_multiple_graph_outputs_keep_names():
    proto = multi_output_model()
    out, rep = _check(proto, cost=LaunchCost(1.0, 1.5, 2.0, unit=8))
    assert rep["applied"] == {"merge_matmul_r2": 2}
    assert _ops(out).count("MatMul") == 1


def test_shared_weights_merge_correctly():
    proto = three_projections(shared_weight=True)
    out, rep = _check(proto)
    assert _ops(out).count("MatMul") == 1


def test_graph_output_also_consumed_inside():
    proto = three_projections(output_inside=True)
    out, rep = _check(proto)
    assert "p0" in [o.name for o in out.graph.output]
    assert any("p0" in n.input for n in out.graph.node)


def test_conv_biases_are_split_for_the_search_and_fused_after():
    b = GraphBuilder("convs", seed=7)
    x = b.input("x", (1, 8, 6, 6))
    ys = []
    for i in range(2):
        w = b.normal(f"w{i}", (4, 8, 1, 1), 0.3)
        ys.append(b.op("Conv", [x, w, b.normal(f"b{i}", (4,), 0.1)], f"conv{i}", kernel_shape=[1, 1]))
    b.op("Add", ys, "add", out="y")
    b.output("y", (1, 4, 6, 6))
    proto = b.model()
    out, rep = _check(proto)  # no conv rule among the hand rules: nothing changes, biases go back in
    assert _ops(out) == _ops(proto) and all(len(n.input) == 3 for n in out.graph.node if n.op_type == "Conv")


def test_unit_inputs_are_checked():
    from graphopt.errors import UserError

    with pytest.raises(UserError):
        optimize(three_projections(), alpha=0.5, rules=HAND, cost=LaunchCost())


def test_cli_reports_bad_paths_in_one_line(tmp_path, capsys):
    assert main(["optimize", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


# ---- the shipped, verified library ----------------------------------------------------------------------

TINY_BERT = BertConfig(layers=2, hidden=32, heads=2, intermediate=64, vocab=50, max_positions=16, seq=8)


def test_library_is_verified_and_loaded():
    rules = load_rules()
    assert rules and all(r.verified for r in rules)


def test_library_keeps_awkward_models_correct():
    for proto in (opaque_model(), multi_output_model(), three_projections(True, True)):
        _check(proto, rules=None, cost=AnalyticCost())


def test_library_merges_bert_qkv_when_launches_dominate():
    """With a cost where a merged matmul beats separate ones, the library + search fuse each layer's Q, K, V
    projections (and biases) into one matmul."""
    proto = build_bert(TINY_BERT, 0, "tiny")
    out, rep = _check(proto, rules=None, cost=LaunchCost(1.0, 1.5, 2.0, unit=32))
    g = import_onnx(out)
    widths = sorted(g.shape(n.inputs[1])[1] for n in g.nodes
                    if n.op_type == "MatMul" and n.inputs[1] in g.initializers)
    assert widths.count(96) == 2, (widths, rep["applied"])


def test_library_merges_parallel_inception_convs(tmp_path):
    proto = build_inception(0)
    path, out_path, js = tmp_path / "in.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(proto, str(path))
    code = main(["optimize", str(path), "-o", str(out_path), "--cost", "analytic", "--json", str(js),
                 "--budget", "40", "--no-progress"])
    rep = json.loads(js.read_text())
    assert code == 0 and rep["outputs_equal"]
    assert set(rep) >= {"cost_before", "cost_after", "applied", "graphs_explored", "seconds", "max_abs_err"}
    out = onnx.load(str(out_path))
    assert _ops(out).count("Conv") <= _ops(proto).count("Conv")


def test_pipeline_entry_point_returns_an_exportable_graph():
    """``pipeline.optimize_model`` calls ``graphopt.stage.optimize_graph(graph)`` and exports ``result.graph``."""
    from graphopt.compare import max_abs_err
    from graphopt.feeds import random_inputs, run_ort
    from graphopt.onnx_io import export_onnx

    proto = opaque_model()
    g = import_onnx(proto)
    res = graph_stage(g, cost=LaunchCost(1.0, 1.5, 2.0), rules=HAND, budget=20)
    assert res.cost_after < res.cost_before and res.applied == {"merge_matmul_r2": 1}
    feeds = random_inputs(g)
    exported = export_onnx(res.graph)
    assert "Concat" not in _ops(exported)
    assert max_abs_err(run_ort(proto, feeds), run_ort(exported, feeds)) < 1e-5
