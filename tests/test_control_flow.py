"""Nested control flow through optimize-model (issue "trust round 4", family "control flow").

A body reads the tensors of every enclosing graph by name, at any depth, and may define a name of its own that
an enclosing graph defines too after the node (onnx.checker's full check and onnxruntime accept both).  What
went wrong, and must not again:

- an If nested in a branch, its branches reading a top-level weight or node output that nothing else reads:
  the tensor was dropped as unused (only bodies one level deep were looked into), and the export failed with an
  internal error, in specialization and in the graph stage;
- the graph stage priced such an If alone, and TVM's importer, handed a body reading a tensor it did not
  have, passed None to its Concat converter: SIGSEGV, the process gone;
- a body's own tensor named like a top-level Identity's output was renamed to the Identity's input;
- a body's own tensor named like one computed from a control input was taken for it;
- a control value giving a Pad a crop onnxruntime refuses failed late, naming neither the input nor the value.

Every case is built with ``onnx.helper`` and passes ``onnx.checker.check_model(m, full_check=True)``; it must
build (exit 0) and ``pipeline.load(DIR).run`` must equal onnxruntime on the input model, or exit 2 with one
stderr line, and never die of a signal.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

os.environ.setdefault("TVM_NUM_THREADS", "2")
from graphopt.feeds import run_ort  # noqa: E402
from graphopt.specialize import needed_values  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RTOL = ATOL = 1e-4
FAST = ["--threads", "2", "--skip-tune", "--no-progress"]
GRAPH_STAGE = ["--time-limit", "20"]  # the graph stage runs: it prices an If alone and drops unused tensors
X = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)


# ---- model builders -----------------------------------------------------------------------------------------

def _vi(name: str, shape, dtype: int = T.FLOAT) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, dtype, shape)


def _init(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _body(name: str, nodes, out: str, shape=(2, 3)) -> onnx.GraphProto:
    return h.make_graph(nodes, name, [], [_vi(out, list(shape))])


def _unary(name: str, op: str, x: str, out: str) -> onnx.GraphProto:
    return _body(name, [h.make_node(op, [x], [out])], out)


def _wide(name: str, x: str, out: str) -> onnx.GraphProto:
    """A branch whose output is twice as wide: the If's output has no static shape."""
    return _body(name, [h.make_node("Concat", [x, x], [out], axis=1)], out, (2, 6))


def _if(cond: str, out: str, then: onnx.GraphProto, other: onnx.GraphProto, name: str) -> onnx.NodeProto:
    return h.make_node("If", [cond], [out], name=name, then_branch=then, else_branch=other)


def _reads_outer(name: str, op: str) -> onnx.GraphProto:
    """A branch computing ``op(h, w)``: a top-level node output and a top-level weight nothing else reads."""
    return _body(name, [h.make_node(op, ["h", "w"], [f"{name}_o"])], f"{name}_o")


def nested_on_control() -> onnx.ModelProto:
    """If on ``mode == 1``; in each branch an If on ``flip == 1`` (computed in the branch) whose branches read
    ``h`` and ``w`` of the top level or are twice as wide: both values decide shapes, the build is specialized."""
    def outer_branch(name: str, op: str) -> onnx.GraphProto:
        inner = _if(f"{name}_flip", f"{name}_o", _reads_outer(f"{name}_t", op), _wide(f"{name}_e", "h", f"{name}_w"),
                    f"{name}_inner")
        return _body(name, [h.make_node("Equal", ["flip", "one"], [f"{name}_flip"]), inner], f"{name}_o", (2, None))

    nodes = [h.make_node("Mul", ["x", "two"], ["h"]), h.make_node("Equal", ["mode", "one"], ["is1"]),
             _if("is1", "y", outer_branch("then", "Add"), outer_branch("else", "Sub"), "outer")]
    inits = [_init("two", np.float32(2)), _init("one", np.int64(1)),
             _init("w", np.arange(6, dtype=np.float32).reshape(2, 3))]
    return _model(nodes, [_vi("x", [2, 3]), _vi("mode", [], T.INT64), _vi("flip", [], T.INT64)],
                  [_vi("y", [2, None])], inits)


def _data_conditions() -> list[onnx.NodeProto]:
    return [h.make_node("ReduceSum", ["x"], ["sum"], keepdims=0), h.make_node("Greater", ["sum", "zero"], ["pos"]),
            h.make_node("ReduceMax", ["x"], ["max"], keepdims=0), h.make_node("Greater", ["max", "one"], ["big"])]


def nested_on_data() -> onnx.ModelProto:
    """If on ``sum(x) > 0``, in each branch an If on ``max(x) > 1`` whose branches read ``h`` and ``w`` of the
    top level: static shapes, so the Ifs stay and TVM's code takes the branch at run time."""
    inner_then = _if("big", "t", _reads_outer("tt", "Add"), _unary("tf", "Relu", "h", "tf_o"), "inner_then")
    inner_else = _if("big", "e", _reads_outer("et", "Sub"), _unary("ef", "Sigmoid", "x", "ef_o"), "inner_else")
    nodes = _data_conditions() + [h.make_node("Mul", ["x", "two"], ["h"]),
                                  _if("pos", "y", _body("then", [inner_then], "t"), _body("else", [inner_else], "e"),
                                      "outer")]
    inits = [_init("zero", np.float32(0)), _init("one", np.float32(1)), _init("two", np.float32(2)),
             _init("w", np.arange(6, dtype=np.float32).reshape(2, 3))]
    return _model(nodes, [_vi("x", [2, 3])], [_vi("y", [2, 3])], inits)


def reused_names() -> onnx.ModelProto:
    """The inner If and both its branches name their output ``r``, which the outer branch returns; the inner
    branches concatenate ``hs``, a top-level node output nothing else reads, with ``x``."""
    def concat(name: str, a: str, b: str) -> onnx.GraphProto:
        return _body(name, [h.make_node("Concat", [a, b], ["r"], axis=1)], "r", (2, 6))

    inner = _if("big", "r", concat("tt", "hs", "x"), concat("tf", "x", "hs"), "inner")
    nodes = _data_conditions() + [h.make_node("Sigmoid", ["x"], ["hs"]),
                                  _if("pos", "y", _body("then", [inner], "r", (2, 6)), _wide("else", "x", "y"),
                                      "outer"),
                                  h.make_node("Relu", ["y"], ["z"])]
    return _model(nodes, [_vi("x", [2, 3])], [_vi("z", [2, 6])],
                  [_init("zero", np.float32(0)), _init("one", np.float32(1))])


def shadowed_identity_output() -> onnx.ModelProto:
    """An If on ``mode == 1`` (its other branch is twice as wide: specialized); its branch holds an If whose
    branches compute their own ``r``, then defines another ``r`` by an Identity, which import bypasses once the
    branch is inlined (renaming the readers of its output to its input)."""
    then = _body("tt", [h.make_node("Relu", ["x"], ["r"]), h.make_node("Neg", ["r"], ["t"])], "t")
    other = _body("te", [h.make_node("Abs", ["x"], ["r"]), h.make_node("Sqrt", ["r"], ["e"])], "e")
    branch = _body("then", [_if("pos", "y1", then, other, "inner"), h.make_node("Sigmoid", ["x"], ["s"]),
                            h.make_node("Identity", ["s"], ["r"]), h.make_node("Add", ["y1", "r"], ["b"])], "b",
                   (2, None))
    nodes = _data_conditions() + [h.make_node("Equal", ["mode", "one_i"], ["is1"]),
                                  _if("is1", "z", branch, _wide("else", "x", "w"), "outer")]
    return _model(nodes, [_vi("x", [2, 3]), _vi("mode", [], T.INT64)], [_vi("z", [2, None])],
                  [_init("zero", np.float32(0)), _init("one", np.float32(1)), _init("one_i", np.int64(1))])


def sibling_reuse() -> onnx.ModelProto:
    """One branch computes ``p`` from the control input ``mode``; its sibling has a constant ``p`` of its own
    as a Reshape's shape (looked at after the other: attributes are stored by name, else_branch first):
    nothing the build compiles depends on the value of ``mode``."""
    shape = numpy_helper.from_array(np.array([2, 3], np.int64))
    then = _body("then", [h.make_node("Constant", [], ["p"], value=shape), h.make_node("Neg", ["x"], ["n"]),
                          h.make_node("Reshape", ["n", "p"], ["t"])], "t")
    other = _body("else", [h.make_node("Cast", ["mode"], ["p"], to=T.FLOAT), h.make_node("Add", ["x", "p"], ["e"])],
                  "e")
    nodes = _data_conditions() + [_if("pos", "y", then, other, "branch")]
    return _model(nodes, [_vi("x", [2, 3]), _vi("mode", [], T.INT64)], [_vi("y", [2, 3])],
                  [_init("zero", np.float32(0)), _init("one", np.float32(1))])


def pad_by(mode: str) -> onnx.ModelProto:
    """``x`` [2, 5] padded by ``k`` at the start of its last axis and by ``1 - k`` at its end."""
    nodes = [h.make_node("Mul", ["k", "at_start"], ["start"]), h.make_node("Sub", ["at_end", "start"], ["pads"]),
             h.make_node("Pad", ["x", "pads"], ["y"], name="pad", mode=mode)]
    inits = [_init("at_start", np.array([0, -1, 0, 1], np.int64)), _init("at_end", np.array([0, 0, 0, 1], np.int64))]
    return _model(nodes, [_vi("x", [2, 5]), _vi("k", [], T.INT64)], [_vi("y", [2, None])], inits)


# ---- running optimize-model ---------------------------------------------------------------------------------

def _save(tmp_path: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[str, str]:
    onnx.save(model, str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "in.npz", **feeds)
    return str(tmp_path / "m.onnx"), str(tmp_path / "in.npz")


def _optimize(tmp_path: Path, capsys, model: onnx.ModelProto, feeds: dict[str, np.ndarray],
              *flags: str) -> tuple[int, list[str]]:
    """optimize-model in this process: its exit code and its stderr lines."""
    from pipeline.cli import optimize_model_main

    path, inputs = _save(tmp_path, model, feeds)
    capsys.readouterr()
    code = optimize_model_main([path, "-o", str(tmp_path / "out"), "--inputs", inputs, "-q", *FAST, *flags])
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def _assert_matches_onnxruntime(folder: Path, model: onnx.ModelProto, *feed_sets: dict[str, np.ndarray]) -> None:
    import pipeline

    built = pipeline.load(folder)
    for feeds in feed_sets:
        for got, ref in zip(built.run(feeds).values(), run_ort(model, feeds)):
            np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


def _built(code: int, err: list[str]) -> None:
    assert code == 0 and not err, (code, err)


# ---- the cases ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,flip", [(1, 1), (0, 0)])
def test_nested_ifs_on_control_inputs_reading_outer_tensors_specialize_to_onnxruntime(tmp_path, capsys, mode, flip):
    model = nested_on_control()
    feeds = {"x": X, "mode": np.array(mode, np.int64), "flip": np.array(flip, np.int64)}
    _built(*_optimize(tmp_path, capsys, model, feeds, "--skip-graph"))
    _assert_matches_onnxruntime(tmp_path / "out", model, feeds)


def test_nested_ifs_on_data_conditions_match_onnxruntime_on_every_path(tmp_path, capsys):
    model = nested_on_data()
    _built(*_optimize(tmp_path, capsys, model, {"x": X}, *GRAPH_STAGE))
    paths = [{"x": x} for x in (np.abs(X) * 3, np.abs(X) * 0.1, -np.abs(X) * 3, -np.abs(X) * 0.1)]
    _assert_matches_onnxruntime(tmp_path / "out", model, *paths)


def test_reused_names_in_nested_branches_never_kill_the_process(tmp_path):
    """In a process of its own: before, the graph stage's TVM import of the If alone died of SIGSEGV."""
    model = reused_names()
    path, inputs = _save(tmp_path, model, {"x": np.abs(X) + 1})
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", path, "-o", str(tmp_path / "out"), "--inputs", inputs,
                           "-q", *FAST, *GRAPH_STAGE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}"
    if proc.returncode == 2:
        assert len(err) == 1, err
    else:
        _built(proc.returncode, err)
        _assert_matches_onnxruntime(tmp_path / "out", model, {"x": np.abs(X) + 1}, {"x": -np.abs(X)})


def test_a_branch_tensor_named_like_a_later_identity_output_keeps_its_own_value(tmp_path, capsys):
    model = shadowed_identity_output()
    one = np.array(1, np.int64)
    _built(*_optimize(tmp_path, capsys, model, {"x": X, "mode": one}, "--skip-graph"))
    _assert_matches_onnxruntime(tmp_path / "out", model, {"x": np.abs(X), "mode": one}, {"x": -np.abs(X), "mode": one})


def test_a_sibling_branch_tensor_named_like_a_control_value_needs_no_value(tmp_path, capsys):
    model = sibling_reuse()
    assert needed_values(model, None, frozenset()) == {}
    feeds = {"x": np.abs(X), "mode": np.array(3, np.int64)}
    _built(*_optimize(tmp_path, capsys, model, {"x": X}, "--skip-graph"))  # no value of mode given
    _assert_matches_onnxruntime(tmp_path / "out", model, feeds, dict(feeds, x=-np.abs(X), mode=np.array(7, np.int64)))


def test_negative_pads_crop_like_onnxruntime_or_are_refused_naming_the_value(tmp_path, capsys):
    x = np.random.default_rng(1).standard_normal((2, 5)).astype(np.float32)
    model = pad_by("reflect")
    code, err = _optimize(tmp_path, capsys, model, {"x": x, "k": np.array(-3, np.int64)}, "--skip-graph")
    assert code == 2 and len(err) == 1, (code, err)
    assert "input 'k' = -3" in err[0] and "Pad node 'pad'" in err[0] and "--inputs" in err[0], err
    feeds = {"x": x, "k": np.array(-1, np.int64)}  # crops 1 at the start, reflects 2 at the end
    _built(*_optimize(tmp_path, capsys, model, feeds, "--skip-graph"))
    _assert_matches_onnxruntime(tmp_path / "out", model, feeds)


def test_torchscript_export_with_nested_ifs_matches_onnxruntime(tmp_path, capsys):
    torch = pytest.importorskip("torch")

    class Nested(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))

        def forward(self, x):
            h2 = x * 2
            if bool(x.sum() > 0):
                y = h2 + self.w if bool(x.max() > 1) else torch.relu(h2)
            else:
                y = h2 - self.w if bool(x.min() < -1) else torch.sigmoid(x)
            return y

    torch.onnx.export(torch.jit.script(Nested()), (torch.from_numpy(X),), str(tmp_path / "t.onnx"), dynamo=False,
                      opset_version=17, input_names=["x"], output_names=["y"])
    model = onnx.load(str(tmp_path / "t.onnx"))
    assert sum(n.op_type == "If" for n in model.graph.node) == 1  # the inner Ifs are in its branches
    _built(*_optimize(tmp_path, capsys, model, {"x": X}, *GRAPH_STAGE))
    paths = [{"x": x} for x in (np.abs(X) * 3, np.abs(X) * 0.1, -np.abs(X) * 3, -np.abs(X) * 0.1)]
    _assert_matches_onnxruntime(tmp_path / "out", model, *paths)
