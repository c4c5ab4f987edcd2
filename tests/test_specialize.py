"""A build specialized on a control input's value (issue 25 item 2, :mod:`graphopt.specialize`).

Silero VAD's released ONNX did not go through: its LSTM's input stayed ``(unk, unk, 128)`` after
``--input-shape`` (the pads are computed from the sample rate ``sr``), and its ``If`` on ``sr`` failed in TVM's
importer ("Dynamic pads are not supported yet").  What must hold now:

- hand-built graphs: the inputs whose value decides shapes or a branch that cannot stay are found, the
  specialized graph has constant pads and no ``If``, computes what the input computes for that value, and a
  missing value is refused in one line; an LSTM behind shape arithmetic ONNX inference does not evaluate is
  unrolled once the shapes are folded;
- the corpus replicas (:func:`models.exported._silero`, both exporters, with and without the ``If``) through
  ``optimize-model`` and checked against onnxruntime, and a built folder refusing any other ``sr`` in one line
  (run-model, exit 2; ``pipeline.load(DIR).run``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

os.environ.setdefault("TVM_NUM_THREADS", "2")
from graphopt.errors import UserError  # noqa: E402
from graphopt.feeds import run_ort  # noqa: E402
from graphopt.onnx_io import export_onnx, import_onnx  # noqa: E402
from graphopt.specialize import needed_values, specialize, specialize_model  # noqa: E402
from graphopt.validate import check_model  # noqa: E402

RTOL = ATOL = 1e-4


def _model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _branch(name: str, op: str, reads: str) -> onnx.GraphProto:
    """A body computing ``op(reads)`` through a local tensor named ``t`` (sibling bodies share the name)."""
    return h.make_graph([h.make_node(op, [reads], ["t"]), h.make_node("Identity", ["t"], [name])], name, [],
                        [h.make_tensor_value_info(name, T.FLOAT, [None, None])])


def vad_like() -> onnx.ModelProto:
    """Silero's structure in six nodes: pads of ``sr // 250`` on the audio, then an If on ``sr == 16000`` whose
    branches read the padded audio; a second If on the same condition with the same local names."""
    nodes = [h.make_node("Div", ["sr", "k250"], ["ctx"]), h.make_node("Unsqueeze", ["ctx", "zero"], ["ctx1"]),
             h.make_node("Concat", ["zeros3", "ctx1"], ["pads"], axis=0),
             h.make_node("Pad", ["x", "pads"], ["padded"], name="pad", mode="reflect"),
             h.make_node("Equal", ["sr", "k16000"], ["is16"]),
             h.make_node("If", ["is16"], ["y"], name="rate", then_branch=_branch("a", "Relu", "padded"),
                         else_branch=_branch("b", "Neg", "padded")),
             h.make_node("If", ["is16"], ["z"], name="twice", then_branch=_branch("c", "Sigmoid", "padded"),
                         else_branch=_branch("d", "Abs", "padded"))]
    inits = [numpy_helper.from_array(np.array(250, np.int64), "k250"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.zeros(3, np.int64), "zeros3"),
             numpy_helper.from_array(np.array(16000, np.int64), "k16000")]
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [1, "n"]),
                          h.make_tensor_value_info("sr", T.INT64, [])],
                  [h.make_tensor_value_info(k, T.FLOAT, [1, None]) for k in ("y", "z")], inits)


def static_if() -> onnx.ModelProto:
    """An If on ``sr`` whose branches compile as they are (static shapes, no operator to rewrite)."""
    nodes = [h.make_node("Equal", ["sr", "k16000"], ["is16"]),
             h.make_node("If", ["is16"], ["y"], name="rate", then_branch=_branch("a", "Relu", "x"),
                         else_branch=_branch("b", "Neg", "x"))]
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [2, 3]), h.make_tensor_value_info("sr", T.INT64, [])],
                  [h.make_tensor_value_info("y", T.FLOAT, [2, 3])],
                  [numpy_helper.from_array(np.array(16000, np.int64), "k16000")])


# ---------------------------------------------------------------------------------------------- the analysis

def test_the_value_deciding_pads_or_a_blocked_branch_is_needed_and_a_compilable_if_is_kept():
    assert needed_values(vad_like(), {"x": (1, 600)}, frozenset()) == {"sr": "the pads of Pad node 'pad'"}
    assert needed_values(static_if(), None, frozenset()) == {}  # both branches compile: every value served
    assert needed_values(static_if(), None, frozenset({"Neg"})) == {"sr": "the branch of If node 'rate'"}


def test_specialized_graph_has_constant_pads_no_if_and_computes_the_same(tmp_path):
    model = vad_like()
    x = np.random.default_rng(0).standard_normal((1, 600)).astype(np.float32)
    for sr in (16000, 8000):
        graph = import_onnx(model, {"x": (1, 600)})
        assert specialize(graph, {"sr": np.array(sr)}) == 2
        assert not any(n.op_type == "If" for n in graph.nodes)
        pad = next(n for n in graph.nodes if n.op_type == "Pad")
        assert graph.is_constant(pad.inputs[1]) and graph.shape(pad.outputs[0]) == (1, 600 + sr // 250)
        assert [i.name for i in graph.inputs] == ["x", "sr"]  # the interface is unchanged
        feeds = {"x": x, "sr": np.array(sr, np.int64)}
        for got, ref in zip(run_ort(export_onnx(graph), feeds), run_ort(model, feeds)):
            np.testing.assert_array_equal(got, ref)


def test_a_needed_value_missing_from_inputs_is_refused_in_one_line(tmp_path):
    path = tmp_path / "vad.onnx"
    onnx.save(vad_like(), str(path))
    with pytest.raises(UserError) as e:
        specialize_model(check_model(path, {"x": (1, 600)}), frozenset())
    message = str(e.value)
    assert "\n" not in message and "'sr'" in message and "--inputs" in message and "Pad node 'pad'" in message
    np.savez(tmp_path / "in.npz", sr=np.array(8000, np.int64))
    proto, spec = specialize_model(check_model(path, {"x": (1, 600)}, tmp_path / "in.npz"), frozenset())
    assert spec.to_json() == {"values": {"sr": 8000}, "why": {"sr": "the pads of Pad node 'pad'"}, "folded_ifs": 2}
    assert not any(n.op_type == "If" for n in proto.graph.node)


def test_lstm_behind_unevaluated_shape_arithmetic_is_unrolled_once_the_shapes_are_folded():
    """``x.view(t // 8, -1, 8)``: ONNX shape inference does not evaluate the Div, so the LSTM's input had no
    static shape at unrolling time although --input-shape fixed every size."""
    from pipeline.frontend import legalize_for_tvm

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([8], np.int64), "eight"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
             numpy_helper.from_array(rng.standard_normal((1, 16, 8)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((1, 16, 4)).astype(np.float32), "r")]
    nodes = [h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "one"], ["len"], axis=0),
             h.make_node("Div", ["len", "eight"], ["steps"]),
             h.make_node("Concat", ["steps", "minus1", "eight"], ["shape"], axis=0),
             h.make_node("Reshape", ["x", "shape"], ["seq"]),
             h.make_node("LSTM", ["seq", "w", "r"], ["y"], hidden_size=4)]
    model = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["b", "n"])],
                   [h.make_tensor_value_info("y", T.FLOAT, [None, None, None, None])], inits)
    legal = legalize_for_tvm(import_onnx(model, {"x": (2, 32)}))
    assert legal.lowered == {"LSTM": 1} and legal.folded > 0
    feeds = {"x": rng.standard_normal((2, 32)).astype(np.float32)}
    np.testing.assert_allclose(run_ort(export_onnx(legal.graph), feeds)[0], run_ort(model, feeds)[0], rtol=RTOL,
                               atol=ATOL)


# ---------------------------------------------------------------------------------------------- the replicas

def _corpus():
    from models.exported import build_exported, missing_dependency

    if missing_dependency():
        pytest.skip(missing_dependency())
    return build_exported


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``get(name, exporter)``: the small replica exported, saved, and built with default schedules (graph
    stage skipped) on its sample inputs (sr = 16000); once per module."""
    from pipeline.context import BuildContext, TuneOptions
    from pipeline.optimize_model import optimize_model

    build_exported = _corpus()
    cache: dict[tuple[str, str], tuple] = {}

    def get(name: str, exporter: str):
        if (name, exporter) not in cache:
            folder = tmp_path_factory.mktemp(f"{name}-{exporter}")
            m = build_exported(name, "small", exporter)
            onnx.save(m.model, str(folder / "model.onnx"))
            np.savez(folder / "inputs.npz", **m.sample_inputs)
            ctx = BuildContext.create(threads=2, skip_graph=True, tuning=TuneOptions(skip=True, progress=False),
                                      inputs=str(folder / "inputs.npz"))
            optimize_model(str(folder / "model.onnx"), str(folder / "out"), ctx)
            cache[name, exporter] = (m, folder)
        return cache[name, exporter]

    return get


@pytest.mark.parametrize("name,exporter", [("vad_real", "torchscript"),
                                           # the dynamo export's build is 5x the TorchScript one's (40 s)
                                           pytest.param("vad_real", "dynamo", marks=pytest.mark.slow),
                                           ("vad_real_16k", "torchscript")])
def test_replica_builds_matches_onnxruntime_and_refuses_another_sample_rate(built, name, exporter):
    import pipeline

    m, folder = built(name, exporter)
    report = json.loads((folder / "out" / "report.json").read_text())
    assert report["specialized"]["values"] == {"sr": 16000}, report["specialized"]
    assert report["specialized"]["folded_ifs"] == (1 if name == "vad_real" else 0)
    assert report["stages"]["legalize"]["lowered"] == {"LSTM": 1}
    sr = next(t for t in report["deploy"]["inputs"] if t["name"] == "sr")
    assert sr == {"name": "sr", "dtype": "int64", "shape": [], "value": 16000}

    model = pipeline.load(folder / "out")
    got = model.run(m.sample_inputs)
    for g, r in zip(got.values(), run_ort(m.model, m.sample_inputs)):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL * max(1.0, float(np.abs(r).max())))
    with pytest.raises(UserError) as e:
        model.run(dict(m.sample_inputs, sr=np.array(8000, np.int64)))
    assert "\n" not in str(e.value) and "sr=16000" in str(e.value) and "--inputs" in str(e.value)
    assert set(model.random_feeds()) == {"input", "sr", "state"} and model.random_feeds()["sr"] == 16000


def test_run_model_refuses_another_sample_rate_in_one_line(built, tmp_path, capsys):
    from pipeline.cli import run_model_main

    m, folder = built("vad_real", "torchscript")
    np.savez(tmp_path / "sr8.npz", **dict(m.sample_inputs, sr=np.array(8000, np.int64)))
    capsys.readouterr()
    assert run_model_main([str(folder / "out"), "--inputs", str(tmp_path / "sr8.npz"), "--repeat", "1"]) == 2
    # (an earlier test of the session may have sized TVM's pool: run-model warns of that, on its own line)
    err = [ln for ln in capsys.readouterr().err.strip().splitlines()
           if ln.strip() and not ln.startswith("warning: TVM's thread pool already runs")]
    assert len(err) == 1 and err[0].startswith("error: input 'sr' is 8000") and "sr=16000 only" in err[0], err
    assert run_model_main([str(folder / "out"), "--repeat", "1", "--check"]) == 0  # random inputs: sr is 16000


def test_replica_without_its_sample_rate_is_refused_before_any_work(tmp_path):
    from pipeline.context import BuildContext
    from pipeline.optimize_model import optimize_model

    m = _corpus()("vad_real", "small", "torchscript")
    onnx.save(m.model, str(tmp_path / "model.onnx"))
    with pytest.raises(UserError) as e:
        optimize_model(str(tmp_path / "model.onnx"), str(tmp_path / "out"),
                       BuildContext.create(input_shapes=m.input_shapes))
    assert str(e.value).startswith("input 'sr' decides the branch of If node") and "--inputs" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_built_folder_signature_records_the_value(built):
    """The value is part of the checksummed deploy section: an edit of it is refused like any other."""
    from pipeline.artifact import Model, section_checksum

    _, folder = built("vad_real_16k", "torchscript")
    report = json.loads((folder / "out" / "report.json").read_text())
    dep = report["deploy"]
    assert dep["checksum"] == section_checksum(dep)
    edited = json.loads(json.dumps(report))
    next(t for t in edited["deploy"]["inputs"] if t["name"] == "sr")["value"] = 8000
    with pytest.raises(UserError, match="edited"):
        Model(Path(folder / "out"), edited)
