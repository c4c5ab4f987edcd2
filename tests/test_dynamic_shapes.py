"""Symbolic input sizes: the shipped ONNX model keeps the input's symbolic dimensions and runs at other sizes
(graphopt.dynamic), while model.so stays built for the sizes given.

Every "runs at another size" claim is checked against onnxruntime on the *input* model at that size; the
size-specific forms (folded Reshape targets, batch-concatenation splits) are shown to fail there first, so
the tests see the repair doing the work."""
from __future__ import annotations

import io
import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.cleanup import fold_shapes
from graphopt.compare import compare_outputs
from graphopt.dynamic import (INPUT_MODEL, OPTIMIZED, STATIC, dynamic_model, probe_shapes, symbolic_inputs,
                              with_interface)
from graphopt.errors import UserError
from graphopt.feeds import random_inputs, run_ort
from graphopt.ir import Graph, Node
from graphopt.onnx_io import export_onnx, import_onnx
from graphopt.stage import GraphStageOptions, optimize_onnx
from models.builder import GraphBuilder
from test_optimize import HAND
from test_search import LaunchCost


def dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in vi.type.tensor_type.shape.dim]


def same_outputs_at(original: onnx.ModelProto, shipped: onnx.ModelProto, shapes: dict[str, tuple[int, ...]],
                    seed: int = 7) -> bool:
    """Both models in onnxruntime on the same random inputs of ``shapes`` (raises when ``shipped`` fails)."""
    feeds = random_inputs(import_onnx(original, shapes), seed)
    return compare_outputs(run_ort(original, feeds), run_ort(shipped, feeds)).ok


def flatten_by_shape(batch: int | str = "N") -> onnx.ModelProto:
    """x[N, 2, 3] -> Reshape(x, concat(shape(x)[0:1], [-1])) -> MatMul: TorchScript's ``view(x.size(0), -1)``."""
    w = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    nodes = [helper.make_node("Shape", ["x"], ["s"], end=1),
             helper.make_node("Concat", ["s", "minus1"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w"], ["y"])]
    g = helper.make_graph(nodes, "flatten", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])],
                          [numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
                           numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def folded(model: onnx.ModelProto, shapes) -> tuple[Graph, Graph]:
    """(the graph at ``shapes``, the same with its shape arithmetic folded into constants), as the pipeline
    hands them over."""
    source = import_onnx(model, shapes)
    optimized = source.copy()
    assert fold_shapes(optimized) > 0
    return source, optimized


# ---------------------------------------------------------------------------------------------- graph level

def test_probe_changes_every_open_dimension_and_keeps_equal_sizes_equal():
    symbolic = {"ids": ["batch", "seq"], "mask": ["batch", None], "img": ["N", 3, "H", "H"]}
    built = {"ids": (1, 16), "mask": (1, 16), "img": (2, 3, 32, 32)}
    assert probe_shapes(symbolic, built) == {"ids": (3, 15), "mask": (3, 15), "img": (3, 3, 31, 31)}


def test_folded_reshape_target_is_computed_again_and_runs_at_batch_3():
    original = flatten_by_shape()
    source, optimized = folded(original, {"x": (1, 2, 3)})
    naive = with_interface(export_onnx(optimized), original)  # symbolic interface, constant [1, -1] inside
    with pytest.raises(UserError):
        same_outputs_at(original, naive, {"x": (3, 2, 3)})

    shipped, info = dynamic_model(original, optimized, source)
    assert info.form == OPTIMIZED and info.restored_nodes == 2 and info.check["ok"], info
    assert info.symbolic == {"x": ["N", 2, 3]} and info.built_for == {"x": [1, 2, 3]}
    assert info.checked_at == {"x": [3, 2, 3]}
    assert dims(shipped.graph.input[0]) == ["N", 2, 3] and dims(shipped.graph.output[0]) == ["N", 4]
    for batch in (1, 3, 5):
        assert same_outputs_at(original, shipped, {"x": (batch, 2, 3)})


def batch_concat_model() -> tuple[onnx.ModelProto, Graph, Graph]:
    """Three inputs a, b, c [N, 4] through one shared weight (the input model), and the graph a batch merge
    makes of it: concat(a, b, c) on the batch axis -> MatMul -> Split [1, 2] -> Split [1, 1] (the nested
    merge's sizes, fixed by batch 1)."""
    b = GraphBuilder("shared", seed=3)
    xs = [b.input(n, ("N", 4)) for n in "abc"]
    w = b.normal("w", (4, 5), 0.5)
    for x in xs:
        b.op("MatMul", [x, w], f"mm_{x}", out=f"y{x}")
        b.output(f"y{x}", ("N", 5))
    original = b.model()
    source = import_onnx(original, {n: (1, 4) for n in "abc"})
    merged = source.copy()
    merged.initializers.update({"s12": np.array([1, 2], np.int64), "s11": np.array([1, 1], np.int64)})
    merged.nodes = [Node("Concat", ["a", "b", "c"], ["abc"], {"axis": 0}, "cat"),
                    Node("MatMul", ["abc", "w"], ["yabc"], name="mm"),
                    Node("Split", ["yabc", "s12"], ["ya", "ybc"], {"axis": 0}, "split0"),
                    Node("Split", ["ybc", "s11"], ["yb", "yc"], {"axis": 0}, "split1")]
    merged.value_info = {}
    return original, source, merged


def test_batch_concatenation_splits_follow_the_batch():
    original, source, merged = batch_concat_model()
    shapes3 = {n: (3, 4) for n in "abc"}
    naive = with_interface(export_onnx(merged), original)
    assert same_outputs_at(original, naive, {n: (1, 4) for n in "abc"})
    with pytest.raises(UserError, match="split"):
        same_outputs_at(original, naive, shapes3)

    shipped, info = dynamic_model(original, merged, source)
    assert info.form == OPTIMIZED and info.scaled_splits == 2, info
    assert "Concat" in {n.op_type for n in shipped.graph.node}  # the merged form is what ships
    assert same_outputs_at(original, shipped, shapes3)
    assert same_outputs_at(original, shipped, {n: (4, 4) for n in "abc"})


def test_a_size_constant_nothing_can_trace_ships_the_input_model_and_says_why():
    original = flatten_by_shape()
    source, optimized = folded(original, {"x": (1, 2, 3)})
    reshape = next(n for n in optimized.nodes if n.op_type == "Reshape")
    optimized.initializers["baked"] = optimized.initializers[reshape.inputs[1]]  # a name the input never had
    reshape.inputs[1] = "baked"
    optimized.remove_unused()

    shipped, info = dynamic_model(original, optimized, source)
    assert info.form == INPUT_MODEL and shipped.SerializeToString() == original.SerializeToString()
    assert "x=3,2,3" in info.reason and "optimized.onnx is the input model" in info.reason, info.reason


def batch_one_only() -> onnx.ModelProto:
    """x[N, 6] reshaped to a fixed [1, 2, 3] (+ 1): only batch 1 runs."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Add", ["r", "one"], ["y"])]
    g = helper.make_graph(nodes, "fixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3])],
                          [numpy_helper.from_array(np.array([1, 2, 3], np.int64), "shape"),
                           numpy_helper.from_array(np.ones(3, np.float32), "one")])
    original = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    original.ir_version = 8
    return original


def test_an_input_model_that_fails_at_the_second_size_is_shipped_unchanged():
    """Nothing at another size can be checked when the input model itself runs at batch 1 only."""
    original = batch_one_only()
    source = import_onnx(original, {"x": (1, 6)})
    shipped, info = dynamic_model(original, source.copy(), source)
    assert info.form == INPUT_MODEL and "input model does not run in onnxruntime at x=3,6" in info.reason, info.reason
    assert shipped is original


def test_a_model_without_symbolic_inputs_ships_the_optimized_graph_as_is():
    original = flatten_by_shape(batch=2)
    assert symbolic_inputs(original) == {}
    source, optimized = folded(original, None)
    shipped, info = dynamic_model(original, optimized, source)
    assert info.form == STATIC and "Shape" not in {n.op_type for n in shipped.graph.node}
    assert same_outputs_at(original, shipped, {})


def test_graphopt_optimize_keeps_the_symbolic_batch():
    b = GraphBuilder("proj", seed=1)
    x = b.input("x", ("batch", 16))
    ys = [b.op("MatMul", [x, b.normal(f"w{i}", (16, 16), 0.25)], f"mm{i}") for i in range(3)]
    b.op("Add", [b.op("Add", ys[:2], "sum0"), ys[2]], "sum1", out="y")
    b.output("y", ("batch", 16))
    proto = b.model()
    out, rep = optimize_onnx(proto, LaunchCost(1.0, 1.5, 2.0), GraphStageOptions(rules=HAND, budget=60),
                             input_shapes={"x": (2, 16)})
    assert rep["applied"] and rep["outputs_equal"], rep
    dyn = rep["dynamic_shapes"]
    assert dyn["optimized_onnx"] == OPTIMIZED and dyn["checked_at"] == {"x": [3, 16]}
    assert dims(out.graph.input[0]) == ["batch", 16] and dims(out.graph.output[0]) == ["batch", 16]
    assert sum(n.op_type == "MatMul" for n in out.graph.node) == 1  # the merged graph is what ships
    assert same_outputs_at(proto, out, {"x": (5, 16)})


# ---------------------------------------------------------------------------------------------- optimize-model

def torch_cnn() -> onnx.ModelProto:
    """Conv -> ReLU -> MaxPool -> ``view(x.size(0), -1)`` -> Linear, exported by TorchScript with a symbolic
    batch ``N`` (the Shape/Gather/Concat/Reshape chain the graph stage folds at batch 1)."""
    torch = pytest.importorskip("torch", reason="needs torch.onnx.export (pip install -e .[test])")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.fc = torch.nn.Linear(8 * 8 * 8, 10)

        def forward(self, x):
            y = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
            return self.fc(y.view(y.size(0), -1))

    torch.manual_seed(0)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Net().eval(), (torch.randn(1, 3, 16, 16),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(buf.getvalue())


def optimize_dir(model: onnx.ModelProto, tmp_path, *options: str) -> tuple[onnx.ModelProto, dict]:
    from pipeline.cli import optimize_model_main

    src, out = tmp_path / "model.onnx", tmp_path / "out"
    onnx.save(model, str(src))
    assert optimize_model_main([str(src), "--skip-tune", "--time-limit", "3", "--threads", "2", "--no-progress",
                                "-o", str(out), *options]) == 0
    return onnx.load(str(out / "optimized.onnx")), json.loads((out / "report.json").read_text())


def test_optimize_model_keeps_the_symbolic_batch_of_a_torch_cnn(tmp_path):
    import pipeline

    original = torch_cnn()
    shipped, report = optimize_dir(original, tmp_path, "--input-shape", "x=1,3,16,16")
    assert dims(shipped.graph.input[0]) == ["N", 3, 16, 16] and dims(shipped.graph.output[0]) == ["N", 10]
    assert same_outputs_at(original, shipped, {"x": (3, 3, 16, 16)})
    dyn = report["dynamic_shapes"]
    assert dyn["symbolic"] == {"x": ["N", 3, 16, 16]} and dyn["built_for"] == {"x": [1, 3, 16, 16]}
    assert dyn["optimized_onnx"] == OPTIMIZED and dyn["check"]["ok"] and dyn["restored_nodes"] > 0
    assert report["deploy"]["inputs"][0]["shape"] == [1, 3, 16, 16]  # model.so: the size it was built for
    model = pipeline.load(tmp_path / "out")
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    assert model.check({"x": x}).ok  # the built size against onnxruntime on the symbolic optimized.onnx
    with pytest.raises(UserError, match=r"compiled for \[1, 3, 16, 16\]"):
        model.run({"x": np.zeros((3, 3, 16, 16), np.float32)})


def test_optimize_model_keeps_the_symbolic_batch_of_our_mlp(tmp_path):
    from models.mlp import build_mlp

    original = build_mlp(batch="batch", sizes=(32, 64, 64, 10))
    shipped, report = optimize_dir(original, tmp_path, "--input-shape", "input=2,32")
    assert dims(shipped.graph.input[0]) == ["batch", 32] and dims(shipped.graph.output[0]) == ["batch", 10]
    assert report["dynamic_shapes"]["optimized_onnx"] == OPTIMIZED
    assert same_outputs_at(original, shipped, {"input": (3, 32)})


def test_optimize_model_keeps_symbolic_batch_and_sequence_of_a_transformer(tmp_path):
    """A Hugging Face BERT (small config, random weights) exported by TorchScript with symbolic batch and
    sequence: attention masks and head reshapes are shape arithmetic the graph stage folds at (1, 16)."""
    from models.exported import build_exported, missing_dependency

    if missing_dependency():
        pytest.skip(missing_dependency())
    exported = build_exported("bert", "small", "torchscript")
    shipped, report = optimize_dir(exported.model, tmp_path, *exported.shape_args())
    names = [i.name for i in exported.model.graph.input]
    assert all(dims(i) == ["batch", "sequence"] for i in shipped.graph.input if i.name in names)
    assert report["dynamic_shapes"]["optimized_onnx"] == OPTIMIZED, report["dynamic_shapes"]["reason"]
    assert report["dynamic_shapes"]["built_for"] == {n: [1, 16] for n in names}
    assert same_outputs_at(exported.model, shipped, {n: (3, 12) for n in names})


def test_optimize_model_ships_the_input_model_and_says_so_when_other_sizes_cannot_be_checked(tmp_path, capsys):
    original = batch_one_only()
    shipped, report = optimize_dir(original, tmp_path, "--input-shape", "x=1,6", "--skip-graph")
    assert shipped.SerializeToString() == original.SerializeToString()
    assert report["dynamic_shapes"]["optimized_onnx"] == INPUT_MODEL
    note = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: ")]
    assert len(note) == 1 and "x=3,6" in note[0] and "optimized.onnx is the input model" in note[0], note
