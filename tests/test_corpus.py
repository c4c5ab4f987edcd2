"""Real exporter output through the product: every small corpus model x exporter (:mod:`models.exported`).

What the product must do with each (issue 13):
1. *round trip*: import into the graph IR without dropping a node, export, and compute what the input computes
   in onnxruntime (``graphopt.roundtrip.roundtrip``, the ``graphopt roundtrip`` command);
2. *pipeline*: ``optimize_model(..., skip_graph=True)`` with default schedules - Relax import, partition,
   compile, the product's own check against onnxruntime - and the written ``model.so`` agrees with
   onnxruntime here too, on the product's check inputs or the model's sample inputs, NaN-aware and scaled:
   ``|ours - ref| <= 1e-4 + 1e-4 * |ref|``.

Models are built once per session and cached.  A representative subset (one or two per family and exporter,
and every failure mode) runs in CI; the rest is ``slow``.  Cases that fail today because of a product bug are
``xfail(strict=True)`` with the root cause, so they turn into failures when it is fixed (then remove the
marker).  The root causes, with reproducers, are in the coverage triage notes of issue 13.
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
SHAPE_FOLD = ("shape arithmetic is not folded under static input shapes before Relax import; TVM's importer "
              "then loses the static shape ({}); the AttributeError on tvm.error.TVMError "
              "(pipeline/relax_import.py:to_relax) hides it")
TS_SCALAR_COS = SHAPE_FOLD.format("ConstantOfShape of an empty shape -> broadcast_to of a 1-D value to ())")
DYNAMO_RANGE = SHAPE_FOLD.format("Range(0, Shape-derived n) -> symbolic length, the mask no longer broadcasts "
                                 "with the scores, Reshape(-1) fails")
SWIN_PAD = SHAPE_FOLD.format("F.pad's ConstantOfShape/Concat pads chain -> 'Dynamic pads are not supported'")
ABS_CHECK = ("absolute 1e-4 output check (pipeline/compile.py:ATOL) on outputs of ~1e8: relative error ~1e-5, "
             "onnxruntime itself moves ~1e2 between optimization levels")
RNN = "LSTM/GRU have no converter in TVM's Relax ONNX importer (lowering in progress)"

PIPELINE_XFAIL = {
    ("bert", "torchscript"): TS_SCALAR_COS, ("gpt2", "torchscript"): TS_SCALAR_COS,
    ("distilbert", "torchscript"): TS_SCALAR_COS,
    ("bert", "dynamo"): DYNAMO_RANGE, ("gpt2", "dynamo"): DYNAMO_RANGE, ("distilbert", "dynamo"): DYNAMO_RANGE,
    ("swin", "torchscript"): SWIN_PAD,
    ("inception_v3", "torchscript"): ABS_CHECK, ("inception_v3", "dynamo"): ABS_CHECK,
    **{(m, e): RNN for m in ("lstm_lm", "bilstm_lm", "gru_lm", "bigru_lm") for e in ("torchscript", "dynamo")},
    ("vad", "torchscript"): RNN + " (the TorchScript exporter writes nn.LSTMCell as an LSTM node)",
}

# Run in CI: every family, both exporters, the opset-9 convention, each failure mode once; the rest is slow.
FAST = {
    ("bert", "torchscript"), ("bert", "dynamo"), ("vit", "torchscript"), ("convnext", "dynamo"),
    ("resnet", "torchscript"), ("efficientnet", "dynamo"), ("densenet", "torchscript"),
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
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=rtol, atol=atol, equal_nan=True)


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
    import tvm
    from tvm import relax

    from kerneltune.native_log import quiet_native_stderr
    from pipeline.compile import outputs_numpy
    from pipeline.optimize import TuneOptions, optimize_model

    entry = corpus(model, exporter)
    m = entry.exported
    out = tmp_path / "out"
    res = optimize_model(str(entry.path), "llvm", str(out), threads=2, input_shapes=m.input_shapes or None,
                         skip_graph=True, tuning=TuneOptions(skip=True, progress=False))
    stages = res.report["stages"]
    assert stages["partition"]["tasks"] > 0 and stages["compile"]["max_abs_err"] <= 1e-4

    # the written library, run here: the product's check inputs (or the model's valid sample inputs)
    graph = import_onnx(onnx.load(str(out / "optimized.onnx")), require_static=True)
    feeds = _feeds_for(m, graph)
    names = [i.name for i in graph.inputs if i.name not in graph.initializers]
    dev = tvm.cpu(0)
    with quiet_native_stderr():
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(out / "model.so")), dev)
        got = outputs_numpy(vm["main"](*[tvm.runtime.tensor(feeds[n], dev) for n in names]))
    _assert_close(got, run_ort(m.model, feeds), ATOL, RTOL)  # symbolic axes take the feeds' sizes


# ------------------------------------------------------------------------------------------------ control input

@pytest.mark.xfail(strict=True, reason="graphopt.feeds.max_abs_err drops NaN (max(err, nan) keeps err), so a "
                                       "check on random inputs passes a model whose reference output is NaN "
                                       "(issue 17 item 1)")
def test_check_sees_nan_from_an_invalid_control_input(corpus):
    """The VAD's sample rate must be 8000 or 16000; the product's random draw gives 0 or 1 today (integer
    inputs not behind a Gather are drawn below 2), and for 0 the model computes 16000 / sr = inf and outputs
    NaN.  A comparison that reports no error against NaN would pass any build; it must report the mismatch."""
    m = corpus("vad", "dynamo").exported
    feeds = dict(m.sample_inputs, sr=np.array(0, dtype=np.int64))
    ref = run_ort(m.model, feeds)
    assert any(np.isnan(r).any() for r in ref)
    finite = [np.nan_to_num(r) for r in ref]
    assert not max_abs_err(ref, finite) <= 1e-4
