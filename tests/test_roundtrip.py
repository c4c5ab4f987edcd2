"""ONNX import -> IR -> export on the constructs real exporters emit, checked in onnxruntime.

Each model here isolates one construct (Constant flavours, Identity chains, local functions, control flow
capturing outer tensors, optional inputs, opsets 13-21, float16, initializers listed as inputs) so a
failure names the construct; test_torch_export.py covers the same through real torch exports.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.cli import graphopt_main
from graphopt.feeds import ort_session, random_inputs, run_ort
from graphopt.onnx_io import account_nodes, export_onnx, import_onnx
from graphopt.roundtrip import roundtrip

ROOT = Path(__file__).resolve().parents[1]
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=17, functions=(), extra_opsets=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "t", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets],
                              functions=list(functions))
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _vi(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def _lossless(model, input_shapes=None) -> dict:
    r = roundtrip(model, input_shapes)
    assert r["outputs_equal"] and r["max_abs_err"] <= 1e-5 and r["dropped_nodes"] == 0, r
    acc = account_nodes(model, import_onnx(model, input_shapes))
    assert acc["dropped_nodes"] == 0, acc
    return {**r, **acc}


def test_every_constant_flavour_is_folded_into_a_weight():
    consts = [
        helper.make_node("Constant", [], ["c_t"], value=numpy_helper.from_array(np.full((2, 3), 0.5, np.float32))),
        helper.make_node("Constant", [], ["c_f"], value_float=2.0),
        helper.make_node("Constant", [], ["c_fs"], value_floats=[1.0, 2.0, 3.0]),
        helper.make_node("Constant", [], ["c_i"], value_int=1),
        helper.make_node("Constant", [], ["c_is"], value_ints=[3, 2]),
    ]
    nodes = consts + [
        helper.make_node("Add", ["x", "c_t"], ["a"]),
        helper.make_node("Mul", ["a", "c_f"], ["b"]),
        helper.make_node("Add", ["b", "c_fs"], ["c"]),
        helper.make_node("Unsqueeze", ["c", "c_i"], ["d"]),  # axes from a Constant, as TorchScript writes it
        helper.make_node("Reshape", ["d", "c_is"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", [2, 3])], [_vi("y", [3, 2])])
    r = _lossless(model)
    assert r["folded_constants"] == 5 and r["kept"] == 5 == r["nodes"]
    graph = import_onnx(model)
    assert graph.initializers["c_is"].tolist() == [3, 2] and graph.initializers["c_f"].dtype == np.float32


def test_constant_that_is_a_graph_output():
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.arange(3, dtype=np.float32))),
             helper.make_node("Relu", ["x"], ["y"])]
    model = _model(nodes, [_vi("x", [3])], [_vi("y", [3]), _vi("k", [3])])
    _lossless(model)
    out = run_ort(export_onnx(import_onnx(model)), {"x": np.zeros(3, np.float32)})
    assert out[1].tolist() == [0.0, 1.0, 2.0]


def test_identities_are_bypassed_except_on_graph_outputs():
    nodes = [helper.make_node("Identity", ["x"], ["i1"]),  # reads a graph input
             helper.make_node("Relu", ["i1"], ["r"]),
             helper.make_node("Identity", ["r"], ["i2"]),
             helper.make_node("Identity", ["i2"], ["y"]),  # chain ending in a graph output: kept, renamed input
             helper.make_node("Identity", ["w"], ["i3"]),  # reads a weight (TorchScript tied parameters)
             helper.make_node("Add", ["r", "i3"], ["z"])]
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    model = _model(nodes, [_vi("x", [4])], [_vi("y", [4]), _vi("z", [4])], [w])
    r = _lossless(model)
    assert r["bypassed_identities"] == 3 and r["kept"] == 3
    graph = import_onnx(model)
    assert [(n.op_type, n.inputs) for n in graph.nodes] == [("Relu", ["x"]), ("Identity", ["r"]),
                                                            ("Add", ["r", "w"])]


def test_self_identity_from_dynamo_passthrough_output_is_dropped():
    """torch's dynamo exporter writes Identity(x) -> x when a model returns an input; that is not valid
    ONNX (ORT refuses it), so import drops it and the export is a valid model returning the input."""
    nodes = [helper.make_node("Identity", ["x"], ["x"]), helper.make_node("Neg", ["x"], ["y"])]
    graph = helper.make_graph(nodes, "t", [_vi("x", [2])], [_vi("x", [2]), _vi("y", [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    imported = import_onnx(model)
    assert [n.op_type for n in imported.nodes] == ["Neg"]
    assert account_nodes(model, imported)["dropped_nodes"] == 0
    x = np.array([1.0, -2.0], np.float32)
    got = run_ort(export_onnx(imported), {"x": x})
    assert [g.tolist() for g in got] == [[1.0, -2.0], [-1.0, 2.0]]


def test_empty_and_duplicate_node_names_export_valid_models():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="n"), helper.make_node("Neg", ["a"], ["b"], name="n"),
             helper.make_node("Abs", ["b"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "t", [_vi("x", [3])], [_vi("y", [3])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    out = export_onnx(import_onnx(model))
    names = [n.name for n in out.graph.node]
    assert len(set(names)) == 3 and all(names)
    # ORT refuses the duplicated names of the source model; the exported one runs.
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    assert run_ort(out, {"x": x})[0].tolist() == [0.0, 0.5, 2.0]


@pytest.mark.parametrize("opset", [13, 15, 17, 18, 19, 21])
def test_opsets_13_to_21(opset):
    """Ops whose signature changed across these opsets (ReduceMean axes, Split sizes) keep their form."""
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    split = numpy_helper.from_array(np.array([2, 2], np.int64), "split")
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "w")
    reduce = (helper.make_node("ReduceMean", ["m", "axes"], ["r"], keepdims=1) if opset >= 18
              else helper.make_node("ReduceMean", ["m"], ["r"], axes=[1], keepdims=1))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), reduce,
             helper.make_node("Sub", ["m", "r"], ["c"]),
             helper.make_node("Split", ["c", "split"], ["s0", "s1"], axis=1),
             helper.make_node("Softmax", ["s0"], ["p"], axis=-1),
             helper.make_node("Concat", ["p", "s1"], ["y"], axis=1)]
    model = _model(nodes, [_vi("x", [3, 4])], [_vi("y", [3, 4])], [axes, split, w], opset=opset)
    _lossless(model)
    assert export_onnx(import_onnx(model)).opset_import[0].version == opset


def test_float16_model():
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((8, 8)).astype(np.float16), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    model = _model(nodes, [_vi("x", [2, 8], TensorProto.FLOAT16)], [_vi("y", [2, 8], TensorProto.FLOAT16)], [w])
    _lossless(model)
    out = export_onnx(import_onnx(model))
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16


def test_local_function_in_custom_domain_is_kept():
    fn = helper.make_function("custom.ops", "Swish", ["X"], ["Y"],
                              [helper.make_node("Sigmoid", ["X"], ["S"]), helper.make_node("Mul", ["X", "S"], ["Y"])],
                              opset_imports=[helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Swish", ["x"], ["h"], domain="custom.ops"), helper.make_node("Neg", ["h"], ["y"])]
    model = _model(nodes, [_vi("x", [5])], [_vi("y", [5])], functions=[fn],
                   extra_opsets=[helper.make_opsetid("custom.ops", 1)])
    r = _lossless(model)
    assert r["opaque_nodes"] >= 1  # the function call is opaque to the optimizer, but kept
    out = export_onnx(import_onnx(model))
    assert [f.name for f in out.functions] == ["Swish"]
    assert {o.domain for o in out.opset_import} == {"", "custom.ops"}


def test_if_branch_reading_an_outer_identity_is_rewired():
    """Control-flow bodies capture outer tensors by name; bypassing an Identity must rename them too."""
    then_g = helper.make_graph([helper.make_node("Relu", ["alias"], ["t"])], "then", [], [_vi("t", [3])])
    else_g = helper.make_graph([helper.make_node("Neg", ["alias"], ["e"])], "else", [], [_vi("e", [3])])
    nodes = [helper.make_node("Identity", ["x"], ["alias"]),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)]
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    model = _model(nodes, [_vi("x", [3])], [_vi("y", [3])], [zero])
    graph = import_onnx(model)
    assert "alias" not in {t for n in graph.nodes for t in n.inputs}
    out = export_onnx(graph)
    for x in ([1.0, -2.0, 3.0], [-1.0, -2.0, 3.0]):
        feeds = {"x": np.array(x, np.float32)}
        np.testing.assert_array_equal(run_ort(out, feeds)[0], run_ort(model, feeds)[0])
    _lossless(model)


def test_lstm_with_omitted_optional_inputs_and_outputs():
    rng = np.random.default_rng(2)
    hidden, inp = 6, 4
    inits = [numpy_helper.from_array(rng.standard_normal((1, 4 * hidden, inp)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32), "R"),
             numpy_helper.from_array(rng.standard_normal((1, 8 * hidden)).astype(np.float32), "B")]
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0"], ["", "y_h"], hidden_size=hidden)]
    model = _model(nodes, [_vi("x", [5, 1, inp]), _vi("h0", [1, 1, hidden])], [_vi("y_h", [1, 1, hidden])], inits)
    _lossless(model)
    assert import_onnx(model).nodes[0].inputs[4] == "" and import_onnx(model).nodes[0].outputs[0] == ""


def test_initializers_listed_as_inputs_stay_overridable_inputs():
    w = numpy_helper.from_array(np.full((3,), 2.0, np.float32), "w")
    model = _model([helper.make_node("Mul", ["x", "w"], ["y"])], [_vi("x", [3]), _vi("w", [3])],
                   [_vi("y", [3])], [w])
    _lossless(model)
    graph = import_onnx(model)
    assert set(random_inputs(graph)) == {"x"} and not graph.is_constant("w")
    out = export_onnx(graph)
    assert [i.name for i in out.graph.input] == ["x", "w"]
    sess = ort_session(out)
    assert [i.name for i in sess.get_overridable_initializers()] == ["w"]
    got = sess.run(None, {"x": np.ones(3, np.float32), "w": np.full(3, 5.0, np.float32)})
    assert got[0].tolist() == [5.0, 5.0, 5.0]


def test_interface_names_order_dtypes_and_ir_version_are_preserved():
    nodes = [helper.make_node("Cast", ["ids"], ["f"], to=F), helper.make_node("Add", ["f", "x"], ["b_out"]),
             helper.make_node("Neg", ["x"], ["a_out"])]
    model = _model(nodes, [_vi("x", [2]), _vi("ids", [2], TensorProto.INT32)],
                   [_vi("b_out", [2]), _vi("a_out", [2])])
    out = export_onnx(import_onnx(model))
    sig = lambda vs: [(v.name, v.type.tensor_type.elem_type) for v in vs]  # noqa: E731
    assert sig(out.graph.input) == sig(model.graph.input) and sig(out.graph.output) == sig(model.graph.output)
    assert out.ir_version == model.ir_version
    _lossless(model)


def test_cli_roundtrip_on_bundled_bert_tiny(tmp_path, capsys):
    out = tmp_path / "rt.json"
    assert graphopt_main(["roundtrip", str(ROOT / "models" / "bert_tiny.onnx"), "--json", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert {"nodes", "source_nodes", "opaque_nodes", "dropped_nodes", "max_abs_err", "outputs_equal"} <= set(printed)
    assert printed["dropped_nodes"] == 0
    assert printed["outputs_equal"] and printed["max_abs_err"] <= 1e-5
    assert printed["nodes"] == printed["source_nodes"] == 82 and 0 <= printed["opaque_nodes"] < printed["nodes"]


def _external_data_model(tmp_path: Path) -> tuple[Path, np.ndarray]:
    weight = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    w = numpy_helper.from_array(weight, "w")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [_vi("x", [2, 64])], [_vi("y", [2, 64])], [w])
    path = tmp_path / "big.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="big.onnx.data", size_threshold=0)
    return path, weight  # (save_model moved the proto's data out: keep the array itself)


def test_external_data_weights_are_loaded(tmp_path):
    """Large exports keep weights in a file beside the .onnx (torch.onnx.export does for > 2 GB)."""
    path, weight = _external_data_model(tmp_path)
    assert (tmp_path / "big.onnx.data").exists()
    r = roundtrip(str(path))
    assert r["outputs_equal"] and r["max_abs_err"] <= 1e-5
    np.testing.assert_array_equal(import_onnx(str(path)).initializers["w"], weight)


def test_missing_external_data_file_is_named(tmp_path, capsys):
    path, _ = _external_data_model(tmp_path)
    (tmp_path / "big.onnx.data").unlink()
    assert graphopt_main(["roundtrip", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "big.onnx.data" in err and "Traceback" not in err


def test_torch_lib_function_with_attribute_parameter():
    """Older dynamo exports call ``pkg.onnxscript.torch_lib`` functions whose body reads the caller's
    attributes (``ref_attr_name``); the call node must keep its attribute with the right type."""
    alpha = helper.make_attribute_ref("alpha", onnx.AttributeProto.FLOAT)
    body = helper.make_node("LeakyRelu", ["self"], ["result"])
    body.attribute.append(alpha)
    fn = helper.make_function("pkg.onnxscript.torch_lib", "aten_leaky_relu", ["self"], ["result"], [body],
                              opset_imports=[helper.make_opsetid("", 18)], attributes=["negative_slope"])
    fn.node[0].attribute[0].ref_attr_name = "negative_slope"
    nodes = [helper.make_node("aten_leaky_relu", ["x"], ["y"], domain="pkg.onnxscript.torch_lib",
                              negative_slope=0.25)]
    model = _model(nodes, [_vi("x", [4])], [_vi("y", [4])], opset=18, functions=[fn],
                   extra_opsets=[helper.make_opsetid("pkg.onnxscript.torch_lib", 1)])
    _lossless(model)
    out = export_onnx(import_onnx(model))
    (attr,) = out.graph.node[0].attribute
    assert attr.type == onnx.AttributeProto.FLOAT and attr.f == 0.25
    assert run_ort(out, {"x": np.array([-4.0, 0, 1, 2], np.float32)})[0].tolist() == [-1.0, 0, 1, 2]


def test_account_nodes_reports_a_dropped_node_by_name():
    """The 0-dropped check can fail: a node missing from the IR is reported with its name."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="keep_me"), helper.make_node("Neg", ["a"], ["y"], name="lost")]
    model = _model(nodes, [_vi("x", [3])], [_vi("y", [3])])
    graph = import_onnx(model)
    assert account_nodes(model, graph)["dropped_nodes"] == 0
    graph.nodes = [n for n in graph.nodes if n.name != "lost"]
    acc = account_nodes(model, graph)
    assert acc["dropped_nodes"] == 1 and acc["dropped"] == ["lost"] and acc["kept"] == 1
