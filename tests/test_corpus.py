"""Real exporter output through the product: every small corpus model x exporter (:mod:`models.exported`).

What the product must do with each (issue 13):
1. *round trip*: import into the graph IR without dropping a node, export, and compute what the input computes
   in onnxruntime (``graphopt.roundtrip.roundtrip``, the ``graphopt roundtrip`` command);
2. *pipeline*: ``optimize_model(..., skip_graph=True)`` with default schedules - Relax import, partition,
   compile, the product's own check against onnxruntime - and the written ``model.so`` agrees with
   onnxruntime here too, on the model's sample inputs or seeded random ones, NaN-aware and scaled as the
   product documents it: ``|ours - ref| <= 1e-4 * max(1, max |ref|) + 1e-4 * |ref|`` per output.

Models are built once per session and cached.  A representative subset (each family and exporter, the
opset-9 convention, the shape-arithmetic and RNN cases) runs in CI; the rest is ``slow``.  A case that fails
because of a product bug goes into ``PIPELINE_XFAIL`` as ``xfail(strict=True)`` with its root cause, so it
turns into a failure when fixed (then remove the entry); today every case passes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

os.environ.setdefault("TVM_NUM_THREADS", "2")
from graphopt.compare import max_abs_err  # noqa: E402
from graphopt.feeds import random_inputs, run_ort  # noqa: E402
from graphopt.onnx_io import account_nodes, export_onnx, import_onnx  # noqa: E402
from graphopt.roundtrip import roundtrip  # noqa: E402
from models.exported import ExportedModel, build_exported, matrix, missing_dependency  # noqa: E402

if missing_dependency():
    pytest.skip(missing_dependency(), allow_module_level=True)

ATOL = RTOL = 1e-4  # the independent re-check of model.so (scale-aware, as issue 13 item 4 asks)

# ---- what fails today, and why (issue 13 triage) ---------------------------------------------------------
PIPELINE_XFAIL: dict[tuple[str, str], str] = {}

# Run in CI: transformers, convnets and RNNs, both exporters, the opset-9 convention, the former failure modes
# (TorchScript and dynamo shape arithmetic, Swin's pads, LSTM/GRU, the VAD's control input); the rest is slow.
# ShuffleNet (opset 9), DenseNet and ResNet went to the slow set to keep the suite within its 15 minutes (58 s
# together on a 2-core Intel Xeon): convnet covers the opset-9 convention, and DenseNet still builds blocked in
# test_densenet_runs_blocked. ConvNeXt (10.5 s) followed for the same reason: convnet covers the dynamo convnet.
FAST = {
    ("bert", "torchscript"), ("bert", "dynamo"), ("vit", "torchscript"),
    ("convnet", "opset9"), ("convnet", "dynamo"), ("lstm_lm", "torchscript"),
    ("bigru_lm", "dynamo"), ("vad", "dynamo"), ("swin", "torchscript"),
}


def _params(xfails: dict[tuple[str, str], str]) -> list:
    out = []
    for model, exporter in matrix():
        marks = [] if (model, exporter) in FAST else [pytest.mark.slow]
        if (model, exporter) in xfails:
            marks.append(pytest.mark.xfail(strict=True, reason=xfails[model, exporter]))
        out.append(pytest.param(model, exporter, marks=marks, id=f"{model}-{exporter}"))
    return out


@dataclass
class Entry:
    exported: ExportedModel
    path: Path  # the model as a user's file


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """``get(model, exporter)``: the small model exported once per session and saved to a file."""
    folder = tmp_path_factory.mktemp("corpus")
    cache: dict[tuple[str, str], Entry] = {}

    def get(model: str, exporter: str) -> Entry:
        if (model, exporter) not in cache:
            m = build_exported(model, "small", exporter)
            path = folder / f"{model}-{exporter}.onnx"
            onnx.save(m.model, str(path))
            cache[model, exporter] = Entry(m, path)
        return cache[model, exporter]

    return get


def _feeds_for(m: ExportedModel, graph) -> dict[str, np.ndarray]:
    return dict(m.sample_inputs) if m.sample_inputs is not None else random_inputs(graph, 0)


def _assert_close(got: list[np.ndarray], ref: list[np.ndarray], atol: float, rtol: float) -> None:
    """numpy's allclose with ``atol`` in units of the output's scale (Inception's logits reach 1e8 with random
    weights: fp32 re-association moves them by ~1e2, 2e-6 of the scale)."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        finite = np.abs(r[np.isfinite(r)]) if np.issubdtype(r.dtype, np.floating) else np.abs(r)
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        np.testing.assert_allclose(g, r, rtol=rtol, atol=atol * scale, equal_nan=True)


# ------------------------------------------------------------------------------------------------ round trip

@pytest.mark.parametrize("model,exporter", _params({}))
def test_round_trip(corpus, model, exporter):
    m = corpus(model, exporter).exported
    assert m.opset == {"torchscript": 17, "dynamo": 18, "opset9": 9}[exporter]
    if m.input_shapes:  # the symbolic axes are really there: a user must pass --input-shape
        assert any(d.dim_param for i in m.model.graph.input for d in i.type.tensor_type.shape.dim)
    if exporter == "opset9":  # the model-zoo convention: weights are listed as graph inputs too
        assert {t.name for t in m.model.graph.initializer} <= {i.name for i in m.model.graph.input}

    report = roundtrip(m.model, m.input_shapes or None)
    assert report["outputs_equal"] and report["dropped_nodes"] == 0, report
    graph = import_onnx(m.model, m.input_shapes or None)
    assert account_nodes(m.model, graph)["dropped_nodes"] == 0
    # independently of the product's comparison (which does not see NaN): same outputs, NaN where NaN
    feeds = _feeds_for(m, graph)
    _assert_close(run_ort(export_onnx(graph), feeds), run_ort(m.model, feeds), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ pipeline

@pytest.mark.parametrize("model,exporter", _params(PIPELINE_XFAIL))
def test_pipeline_default_schedules(corpus, model, exporter, tmp_path):
    from pipeline.context import BuildContext, TuneOptions
    from pipeline.optimize_model import optimize_model

    entry = corpus(model, exporter)
    m = entry.exported
    out = tmp_path / "out"
    inputs = None
    if m.sample_inputs is not None:  # a control input random values cannot drive (--inputs FILE.npz)
        inputs = tmp_path / "inputs.npz"
        np.savez(inputs, **m.sample_inputs)
    res = optimize_model(str(entry.path), str(out), BuildContext.create(
        threads=2, input_shapes=m.input_shapes or None, skip_graph=True, tuning=TuneOptions(skip=True, progress=False),
        inputs=str(inputs) if inputs else None))
    stages = res.report["stages"]
    assert stages["partition"]["tasks"] > 0 and stages["compile"]["ok"], stages["compile"]
    # the layout stage realized what it decided: no model falls back to NCHW because TVM rejected the layout
    assert "failed" not in stages["partition"]["layout"], stages["partition"]["layout"]
    _check_library(out, m, res.report)


def _check_library(out: Path, m: ExportedModel, report: dict) -> None:
    """The written library, run here: the product's check inputs (or the model's valid sample inputs), against
    onnxruntime on the model as exported."""
    import tvm
    from tvm import relax

    from graphopt.dynamic import INPUT_MODEL, OPTIMIZED, STATIC
    from kerneltune.native_log import quiet_native_stderr
    from pipeline.compile import outputs_numpy

    # optimized.onnx keeps the export's symbolic axes (checked at a second size in onnxruntime): fix them again.
    # An RNN unrolled over a symbolic time axis (the Silero replicas' LSTM over frames) has no symbolic form:
    # the check at the second size fails, and optimized.onnx is the input model, as documented.
    dynamic = report["dynamic_shapes"]
    unrolled = set(report["stages"].get("legalize", {}).get("lowered", {})) & {"LSTM", "GRU", "RNN"}
    expected = (INPUT_MODEL if unrolled else OPTIMIZED) if m.input_shapes else STATIC
    assert dynamic["optimized_onnx"] == expected, dynamic["reason"]
    graph = import_onnx(onnx.load(str(out / "optimized.onnx")), m.input_shapes or None, require_static=True)
    feeds = _feeds_for(m, graph)
    names = [i.name for i in graph.inputs if i.name not in graph.initializers]
    dev = tvm.cpu(0)
    with quiet_native_stderr():
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(out / "model.so")), dev)
        got = outputs_numpy(vm["main"](*[tvm.runtime.tensor(feeds[n], dev) for n in names]))
    _assert_close(got, run_ort(m.model, feeds), ATOL, RTOL)  # symbolic axes take the feeds' sizes


def test_densenet_runs_blocked(corpus, tmp_path):
    """DenseNet keeps a BatchNormalization after every concat (no conv to fold it into).  TVM's ConvertLayout
    once rejected it ("Invalid layout axis 16b") and the model fell back to NCHW; with ``--layout nchwc`` every
    conv now runs blocked, with layout transforms only at the model's input and output."""
    from pipeline.context import BuildContext, TuneOptions
    from pipeline.optimize_model import optimize_model

    entry = corpus("densenet", "torchscript")
    out = tmp_path / "out"
    res = optimize_model(str(entry.path), str(out), BuildContext.create(
        threads=2, skip_graph=True, layout="nchwc", tuning=TuneOptions(skip=True, progress=False)))
    lay = res.report["stages"]["partition"]["layout"]
    assert lay["mode"] == "nchwc" and "failed" not in lay, lay
    assert lay["convs"] == lay["blocked"] == 10 and lay["transforms"] == 2, lay
    assert sum(t["kind"] == "conv2d_nchwc" for t in res.report["tasks"]) >= 5
    _check_library(out, entry.exported, res.report)


# ------------------------------------------------------------------------------------------------ control input

def test_check_sees_nan_from_an_invalid_control_input(corpus):
    """The VAD's sample rate must be 8000 or 16000 (hence ``--inputs`` in the pipeline test); for 0 the model
    computes 16000 / sr = inf and outputs NaN.  A comparison that reports no error against NaN would pass any
    build (``max(err, nan)`` keeps ``err``); the product's comparison must report the mismatch."""
    m = corpus("vad", "dynamo").exported
    feeds = dict(m.sample_inputs, sr=np.array(0, dtype=np.int64))
    ref = run_ort(m.model, feeds)
    assert any(np.isnan(r).any() for r in ref)
    finite = [np.nan_to_num(r) for r in ref]
    assert not max_abs_err(ref, finite) <= 1e-4
