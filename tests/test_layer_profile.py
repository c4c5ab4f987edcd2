"""run-model --profile: each kernel call of the shipped build timed, named by its ONNX nodes, and set beside
onnxruntime's own profile of the same nodes (pipeline.pricing.layer_profile)."""
from __future__ import annotations

import json

import onnx
from onnx import TensorProto, helper

from pipeline import cli
from pipeline.pricing.layer_profile import Comparison, KernelRow, _anchors, align, side_by_side
from pipeline.pricing.profile import CallTime
from pipeline.passes.provenance import CallSite
from tests.test_deploy import mlp_built, one_line_error  # noqa: F401 - mlp_built: the shared folder fixture


def test_calls_line_up_with_the_call_sites_builtins_left_out():
    calls = [CallTime("vm.builtin.alloc_tensor", 0.01), CallTime("fused_a_prepacked", 2.0),
             CallTime("vm.builtin.null_value", 0.0), CallTime("b", 1.0)]
    sites = [CallSite("fused_a", ("MatMul_0", "Add_1")), CallSite("b", ("Relu_2",))]
    assert [(c.name, n) for c, n in align(calls, sites)] == [("fused_a_prepacked", ("MatMul_0", "Add_1")),
                                                              ("b", ("Relu_2",))]
    # an older folder lists fewer sites: matched by name in order, the rest unnamed
    assert [n for _, n in align(calls, sites[1:])] == [(), ("Relu_2",)]


def test_onnxruntime_nodes_are_credited_to_the_node_producing_their_output():
    def node(op, ins, outs, name):
        return helper.make_node(op, ins, outs, name=name)

    info = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])]
    original = helper.make_graph([node("MatMul", ["x", "w"], ["m"], "mm"), node("Add", ["m", "b"], ["a"], "add"),
                                  node("Relu", ["a"], ["y"], "relu")], "g", info, info)
    # onnxruntime's: a fused Gemm writing a tensor of its own, reshaped back into the Add's output, then ReLU
    optimized = helper.make_graph([node("Gemm", ["x", "w", "b"], ["tmp"], "fused_gemm"),
                                   node("Reshape", ["tmp", "s"], ["a"], "gemm_output_reshape"),
                                   node("Relu", ["a"], ["y"], "relu")], "g", info, info)
    assert _anchors(optimized, original) == {"fused_gemm": "add", "gemm_output_reshape": "add", "relu": "relu"}
    # names onnxruntime derives from the original: a fusion named after its first node, a blocked op after the
    # tensor it computes (its own output a reordered tensor, which would otherwise credit the node after it)
    renamed = helper.make_graph([node("Gemm", ["x", "w", "b"], ["a"], "mm/MatMulAddFusion"),
                                 node("QLinearAdd", ["a", "b"], ["made_up"], "add_token_7"),
                                 node("Relu", ["a"], ["blocked"], "y_nchwc"),
                                 node("ReorderOutput", ["blocked"], ["y"], "reorder")], "g", info, info)
    assert _anchors(renamed, original) == {"mm/MatMulAddFusion": "mm", "add_token_7": "add", "y_nchwc": "relu",
                                           "reorder": "relu"}


def test_both_profiles_are_summed_over_the_nodes_each_call_computes():
    rows = [KernelRow(kernel="k", calls=2, ms=3.0, share=1.0, gflops=None, roofline_pct=None, nodes=["a", "b"],
                      sites=[["a", "b"], ["c"]], site_ms=[2.0, 1.0])]
    got = side_by_side(rows, {"a": 0.5, "b": 0.25, "c": 4.0, "reshape": 0.1})
    assert got == [Comparison(["c"], 1.0, 4.0, "k"), Comparison(["a", "b"], 2.0, 0.75, "k"),
                   Comparison(["reshape"], 0.0, 0.1, None)]


def test_run_model_profile_names_every_kernel_by_its_nodes(mlp_built, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli.run_model_main([str(mlp_built), "--profile", "--repeat", "3", "--json", str(out),
                               "--profile-plot", str(tmp_path / "p.png")]) == 0
    printed = capsys.readouterr().out
    prof = json.loads(out.read_text())["profile"]
    graph = onnx.load(mlp_built / "optimized.onnx").graph
    names = {n.name for n in graph.node}
    assert prof["traced"] == 1.0 and prof["kernels"]
    assert {n for k in prof["kernels"] for n in k["nodes"]} == names  # MatMul, Add, Relu, MatMul: all of them
    assert abs(sum(k["ms"] for k in prof["kernels"]) - prof["kernels_ms"]) < 1e-9
    assert abs(sum(k["share"] for k in prof["kernels"]) - 1.0) < 1e-9
    assert prof["ort"] and prof["ort_ms"] > 0  # onnxruntime's column, on optimized.onnx
    assert {n for c in prof["ort"] for n in c["nodes"]} >= names
    assert "ONNX nodes" in printed and (tmp_path / "p.png").stat().st_size > 0


def test_profile_options_are_checked_first(mlp_built, tmp_path, capsys):
    assert cli.run_model_main([str(mlp_built), "--profile-plot", str(tmp_path / "p.png")]) == 2
    assert "add --profile" in one_line_error(capsys)
    assert cli.run_model_main([str(mlp_built), "--profile", "--profile-plot", str(tmp_path / "p.txt")]) == 2
    assert ".png" in one_line_error(capsys)
