"""Older exporters' files: IR<4 initializers, opsets onnxruntime no longer implements, and an Expand whose shape
is computed from another tensor.

Each model is built here with onnx.helper and run through ``optimize-model --skip-graph --skip-tune`` in-process
(the graph stage plays no part in these faults), then checked against onnxruntime or numpy.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, version_converter

from graphopt.errors import UserError
from graphopt.onnx_io import import_onnx
from pipeline import load
from pipeline.cli import optimize_model_main, run_model_main

RNG = np.random.default_rng(0)
QUICK = ["--target", "llvm", "--threads", "1", "--skip-graph", "--skip-tune", "--no-progress"]


def vi(name: str, shape: list[int], dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def floats(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def old_model(nodes: list[onnx.NodeProto], inputs: list, outputs: list, weights: dict[str, np.ndarray], opset: int,
              weights_listed: bool) -> onnx.ModelProto:
    """An IR 3 model (onnx 1.2/1.3 era); ``weights_listed``: its initializers among the graph inputs, as the
    checker demands at IR 3, else not (what some older exporters wrote)."""
    listed = [vi(k, list(v.shape), helper.np_dtype_to_tensor_dtype(v.dtype)) for k, v in weights.items()]
    g = helper.make_graph(nodes, "old", inputs + (listed if weights_listed else []), outputs,
                          [numpy_helper.from_array(v, k) for k, v in weights.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 3
    return m


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def build(model: onnx.ModelProto, tmp_path, capsys) -> tuple[int, str]:
    """optimize-model on ``model``: its exit status and its stderr lines (TVM's C++ log lines left out)."""
    src = tmp_path / "model.onnx"
    onnx.save(model, str(src))
    rc = optimize_model_main([str(src), *QUICK, "-o", str(tmp_path / "out")])
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln and not ln.startswith("[")]
    return rc, "\n".join(err)


def assert_one_line_error(rc: int, err: str, *words: str) -> None:
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (rc, err)
    assert "internal" not in err, err
    for w in words:
        assert w in err, (w, err)


def assert_shipped_model_is_valid(out) -> onnx.ModelProto:
    """optimized.onnx passes onnx.checker's full check and loads in onnxruntime."""
    shipped = onnx.load(str(out / "optimized.onnx"))
    onnx.checker.check_model(shipped, full_check=True)
    ort_run(shipped, {i.name: np.zeros([d.dim_value for d in i.type.tensor_type.shape.dim], np.float32)
                      for i in shipped.graph.input})
    return shipped


# ---- 1. IR<4: initializers and graph inputs -----------------------------------------------------------------

@pytest.mark.parametrize("weights_listed", [
    pytest.param(True, id="weights-listed-as-inputs"),
    # the convention every other build in the suite already uses
    pytest.param(False, id="weights-not-listed", marks=pytest.mark.slow)])
def test_ir3_model_builds_and_its_weights_stay_weights(weights_listed, tmp_path, capsys):
    """Before: listed, the Constant node folded into a weight made the export fail onnx.checker (an internal
    RuntimeError after the build); not listed, the model was refused as invalid."""
    w = floats(4, 8)
    bias = floats(8)
    nodes = [helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(bias)),
             helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    model = old_model(nodes, [vi("x", [2, 4])], [vi("y", [2, 8])], {"w": w}, opset=8, weights_listed=weights_listed)
    rc, err = build(model, tmp_path, capsys)
    assert rc == 0, err
    out = tmp_path / "out"
    assert [i["name"] for i in json.loads((out / "report.json").read_text())["deploy"]["inputs"]] == ["x"]
    shipped = assert_shipped_model_is_valid(out)
    weights = {t.name for t in shipped.graph.initializer}  # a file that listed them keeps them listed
    assert shipped.ir_version >= 4 and [i.name for i in shipped.graph.input if i.name not in weights] == ["x"]
    x = floats(2, 4)
    np.testing.assert_allclose(load(out).run({"x": x})["y"], x @ w + bias, rtol=1e-5, atol=1e-5)


# ---- 2. Expand with a computed shape ------------------------------------------------------------------------

def _shape_from(nodes: list[onnx.NodeProto], inputs: list,
                weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "expand", inputs, [vi("z", [2, 3, 4])],
                          [numpy_helper.from_array(v, k) for k, v in (weights or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def test_expand_to_a_shape_from_an_inputs_values_is_refused_in_one_line(tmp_path, capsys):
    """Before: an internal AttributeError ('ExternFunc' object has no attribute 'name') in TVM's FastMathTransform,
    on the vm.builtin.tensor_to_shape call the importer's dynamic Expand emits."""
    nodes = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Max", ["sx", "n"], ["s"]),
             helper.make_node("Expand", ["y", "s"], ["z"], name="broadcast")]
    model = _shape_from(nodes, [vi("x", [2, 3, 4]), vi("y", [1, 4]), vi("n", [3], TensorProto.INT64)])
    rc, err = build(model, tmp_path, capsys)
    assert_one_line_error(rc, err, "Expand node 'broadcast'", "input 'n'", "Shape")


def test_shapes_computed_from_tensor_shapes_still_import():
    """The refusal reads values only: an Expand to Shape(x), or to arithmetic on it, folds to a constant; a
    ConstantOfShape of an input's values is refused the same way (before: an internal AssertionError)."""
    from pipeline.frontend import legalize_for_tvm

    x, y = vi("x", [2, 3, 4]), vi("y", [1, 4])
    shape_fed = _shape_from([helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Max", ["sx", "one"], ["s"]),
                             helper.make_node("Expand", ["y", "s"], ["z"])], [x, y],
                            {"one": np.ones(3, np.int64)})
    legal = legalize_for_tvm(import_onnx(shape_fed))
    expand = next(n for n in legal.graph.nodes if n.op_type == "Expand")
    assert legal.graph.is_constant(expand.inputs[1])
    valued = _shape_from([helper.make_node("ConstantOfShape", ["s"], ["z"], name="fill")],
                         [vi("s", [3], TensorProto.INT64)])
    with pytest.raises(UserError, match="ConstantOfShape node 'fill' takes its shape from the values of input 's'"):
        legalize_for_tvm(import_onnx(valued))


# ---- 3. opsets onnxruntime no longer implements -------------------------------------------------------------

def conv_bn_pool(extra: list[onnx.NodeProto] = ()) -> onnx.ModelProto:
    """Conv -> Add(broadcast=1) -> BatchNormalization-6 -> AveragePool-1 at opset 6 (IR 3, weights listed)."""
    weights = {"cw": floats(4, 3, 3, 3), "cb": floats(4, 1, 1), "sc": floats(4), "bi": floats(4), "me": floats(4),
               "va": np.abs(floats(4)) + 0.5}
    nodes = [helper.make_node("Conv", ["x", "cw"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "cb"], ["cc"], broadcast=1),
             helper.make_node("BatchNormalization", ["cc", "sc", "bi", "me", "va"], ["bn"], epsilon=1e-5, is_test=1),
             helper.make_node("AveragePool", ["bn"], ["p" if extra else "y"], kernel_shape=[2, 2], strides=[2, 2]),
             *extra]
    return old_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 4, 4])], weights, opset=6, weights_listed=True)


def test_opset6_model_is_upgraded_checked_and_reported(tmp_path, capsys):
    """Before: refused, onnxruntime implementing no Add-6 or BatchNormalization-6 ("onnxruntime cannot load the
    model"); the first it lacks is named."""
    model = conv_bn_pool()
    rc, err = build(model, tmp_path, capsys)
    assert rc == 0, err
    assert "upgraded to opset 13" in err  # the note
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    upgrade = report["opset_upgrade"]
    assert upgrade["from"] == 6 and upgrade["to"] == 13 and upgrade["by"] == "onnx.version_converter"
    assert upgrade["why"] in ("onnxruntime implements no Add-6", "onnxruntime implements no BatchNormalization-6")
    shipped = assert_shipped_model_is_valid(out)
    assert [o.version for o in shipped.opset_import if o.domain == ""] == [13]
    x = floats(1, 3, 8, 8)
    upgraded = version_converter.convert_version(onnx.load(str(tmp_path / "model.onnx")), 13)
    upgraded.ir_version = 7
    np.testing.assert_allclose(load(out).run({"x": x})["y"], ort_run(upgraded, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert run_model_main([str(out), "--check", "--repeat", "2"]) == 0


def test_opset_the_converter_cannot_upgrade_names_the_re_export(tmp_path, capsys):
    """ImageScaler (an experimental op of opset 1) exists at no newer opset: one line naming it, the opset and
    the fix.  Before: onnxruntime's refusal of an operator version, with no way out but the user's guess."""
    model = conv_bn_pool([helper.make_node("ImageScaler", ["p"], ["y"], scale=2.0, bias=[1.0, 2.0, 3.0, 4.0])])
    rc, err = build(model, tmp_path, capsys)
    assert_one_line_error(rc, err, "opset 6", "onnxruntime implements no", "ImageScaler does not exist at opset 13",
                          "re-export the model at opset 13 or newer")
    assert not (tmp_path / "out" / "model.so").exists()
