"""``--precision int8`` (pipeline.quantize): the method chosen per model, onnxruntime's quantization of a tiny
conv net (static QDQ, per-channel) and a tiny transformer (dynamic), the accuracy against fp32, the
refusals, and one whole build through optimize-model.

Cheap: the models have a few thousand weights; only the last test compiles (one conv net, --skip-graph).
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

os.environ.setdefault("TVM_NUM_THREADS", "2")

from graphopt.errors import UserError  # noqa: E402
from graphopt.onnx_io import import_onnx  # noqa: E402
from models.bert import BertConfig, build_bert  # noqa: E402
from models.builder import GraphBuilder  # noqa: E402
from models.mlp import build_mlp  # noqa: E402
from pipeline import quantize  # noqa: E402
from pipeline.context import BuildContext  # noqa: E402

BATCH = 4


def conv_net() -> onnx.ModelProto:
    """Conv+Relu, strided Conv+Relu, GlobalAveragePool, Flatten, Gemm: 10 classes, a batch of 4 images."""
    b = GraphBuilder("tiny-conv", seed=0)
    x = b.input("x", (BATCH, 3, 16, 16))
    h = b.op("Relu", [b.op("Conv", [x, b.he("w1", (8, 3, 3, 3), 27), b.normal("b1", (8,), 0.05)], pads=[1] * 4)])
    h = b.op("Relu", [b.op("Conv", [h, b.he("w2", (16, 8, 3, 3), 72)], pads=[1] * 4, strides=[2, 2])])
    h = b.op("Flatten", [b.op("GlobalAveragePool", [h])])
    b.op("Gemm", [h, b.normal("wf", (10, 16), 0.25), b.normal("bf", (10,), 0.05)], transB=1, out="y")
    b.output("y", (BATCH, 10))
    return b.model("tiny conv net")


def transformer() -> onnx.ModelProto:
    return build_bert(BertConfig(layers=1, hidden=32, heads=2, intermediate=64, seq=8, vocab=100), name="tiny-bert")


def added() -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def saved(model: onnx.ModelProto, tmp_path, name: str = "model.onnx") -> str:
    path = tmp_path / name
    onnx.save(model, str(path))
    return str(path)


def int8_context(target: str = "llvm", **options) -> BuildContext:
    return BuildContext.create(target, precision="int8", threads=2, **options)


# ------------------------------------------------------------------------------------------------ the choice

def test_conv_nets_get_static_qdq_transformers_dynamic_gemm_mlps_static():
    conv = quantize.choose_method(import_onnx(conv_net()))
    assert conv.method == quantize.STATIC and conv.flops["conv"] > 10 * conv.flops["gemm"] and "Conv" in conv.why
    bert = quantize.choose_method(import_onnx(transformer()))
    assert bert.method == quantize.DYNAMIC and bert.flops["conv"] == 0 and "transformer" in bert.why
    # an MLP of Gemms: onnxruntime's dynamic quantization has no integer Gemm, static QDQ quantizes it
    mlp = quantize.choose_method(import_onnx(build_mlp(batch=2, sizes=(16, 32, 32, 4))))
    assert mlp.method == quantize.STATIC and "Gemm" in mlp.why
    with pytest.raises(UserError, match="no Conv, MatMul or Gemm.*drop --precision int8"):
        quantize.choose_method(import_onnx(added()))


# ------------------------------------------------------------------------------------------------ quantizing

def test_a_conv_net_is_quantized_static_qdq_calibrated_on_the_samples(tmp_path):
    path = saved(conv_net(), tmp_path)
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "in.npz", x=rng.uniform(0, 1, (BATCH, 3, 16, 16)).astype(np.float32))
    model, prec = quantize.checked_model(path, int8_context(inputs=str(tmp_path / "in.npz")))
    ops = {n.op_type for n in model.proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops
    per_channel = [n for n in model.proto.graph.node if n.op_type == "DequantizeLinear"
                   and any(a.name == "axis" for a in n.attribute)]
    assert per_channel, "the conv weights are quantized per output channel"
    assert model.path == path and model.samples is not None  # report.json names the user's file
    assert (prec.method, prec.calibration, prec.measured_on) == (quantize.STATIC, "samples", "samples")
    assert "quant_pre_process" in prec.pre_processed
    acc = prec.accuracy
    assert acc.input_sets == 1 and acc.top1_rows == BATCH
    assert 0.9 < acc.cosine_similarity <= 1.0 and acc.top1_agreement is not None
    assert 0 < acc.max_abs_err < 0.5


def test_without_inputs_calibration_is_random_and_one_warning_says_so(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    _, prec = quantize.checked_model(saved(conv_net(), tmp_path), int8_context())
    assert prec.calibration == "random" and prec.accuracy.input_sets == 3 and prec.accuracy.top1_rows == 3 * BATCH
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "not measured on real data" in lines[0] and "--inputs" in lines[0], lines
    assert not any("pre-processing" in ln for ln in lines)  # onnxruntime's advice: we ran it


def test_where_pre_processing_fails_the_model_is_quantized_as_is_without_onnxruntime_s_advice(tmp_path, caplog,
                                                                                                monkeypatch):
    import onnxruntime.quantization.shape_inference as pre

    def fails(*args, **kwargs):
        raise RuntimeError("symbolic shape inference failed\non some op")

    monkeypatch.setattr(pre, "quant_pre_process", fails)
    caplog.set_level(logging.WARNING)
    model, prec = quantize.checked_model(saved(conv_net(), tmp_path), int8_context())
    assert prec.pre_processed == "skipped: it failed (RuntimeError: symbolic shape inference failed)"
    assert "QuantizeLinear" in prec.quantized_ops
    messages = [r.getMessage() for r in caplog.records]
    assert not any("pre-processing" in m for m in messages) and len(messages) == 1, messages  # the random-inputs one


def test_a_transformer_is_quantized_dynamically(tmp_path, caplog):
    model, prec = quantize.checked_model(saved(transformer(), tmp_path), int8_context())
    ops = {n.op_type for n in model.proto.graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops
    assert prec.method == quantize.DYNAMIC and prec.calibration is None and prec.measured_on == "random"
    assert prec.quantized_ops["MatMulInteger"] >= 6  # Q, K, V, output, two FFN projections
    assert prec.accuracy.cosine_similarity > 0.9


# ------------------------------------------------------------------------------------------------ accuracy

def test_accuracy_figures():
    rng = np.random.default_rng(0)
    logits = [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(2)]
    same = quantize.accuracy([[x] for x in logits], [[x.copy()] for x in logits])
    assert (same.max_abs_err, same.cosine_similarity, same.top1_agreement, same.top1_rows) == (0.0, 1.0, 1.0, 10)
    flipped = [x.copy() for x in logits]
    row = flipped[1][2]
    row[np.argmax(row)] -= 10.0  # one row's arg-max moves
    off = quantize.accuracy([[x] for x in logits], [[x] for x in flipped])
    assert off.top1_agreement == pytest.approx(0.9) and off.max_abs_err == pytest.approx(10.0)
    assert 0 < off.cosine_similarity < 1
    # not classifier-like (rank 4 feature maps, an integer output): no top-1, the cosine of the floats only
    maps = quantize.accuracy([[np.ones((1, 2, 3, 3), np.float32), np.arange(3)]],
                             [[-np.ones((1, 2, 3, 3), np.float32), np.arange(3)]])
    assert maps.top1_agreement is None and maps.top1_rows == 0 and maps.cosine_similarity == pytest.approx(-1.0)


# ------------------------------------------------------------------------------------------------ refusals

def test_an_already_quantized_model_is_refused(tmp_path):
    model, _ = quantize.checked_model(saved(conv_net(), tmp_path), int8_context())
    path = saved(model.proto, tmp_path, "int8.onnx")
    with pytest.raises(UserError, match=r"already quantized \(DequantizeLinear.*: drop --precision int8") as info:
        quantize.checked_model(path, int8_context())
    assert "\n" not in str(info.value)
    assert quantize.quantized_ops(conv_net()) == []
    assert quantize.checked_model(path, BuildContext.create("llvm"))[1] is None  # at fp32 it is a model like any


def test_gpu_targets_and_unknown_precisions_are_refused_before_the_model_is_read(tmp_path):
    with pytest.raises(UserError, match="--precision int8 with --target cuda.*CPU.*drop --precision int8"):
        quantize.checked_model(str(tmp_path / "absent.onnx"), int8_context("cuda"))
    with pytest.raises(UserError, match=r"--precision 'int4': use one of fp32, int8"):
        BuildContext.create("llvm", precision="int4")


def test_the_cli_and_the_api_take_the_precision(tmp_path, capsys, monkeypatch):
    import pipeline
    import pipeline.optimize_model
    from pipeline.cli import optimize_model_main

    path = saved(conv_net(), tmp_path)
    assert optimize_model_main([path, "--precision", "int4", "-o", str(tmp_path / "o")]) == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"precision='int4': give one of fp32, int8"):
        pipeline.optimize(path, precision="int4")
    seen = []
    monkeypatch.setattr(pipeline.optimize_model, "optimize_model",
                        lambda model, out, ctx: seen.append(ctx.precision) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pipeline.optimize(path, precision="int8")
    assert seen == ["int8"]


# ------------------------------------------------------------------------------------------------ whole build

def test_optimize_model_int8_builds_reports_and_prints_the_accuracy(tmp_path, capsys):
    from pipeline.cli import optimize_model_main

    path, out = saved(conv_net(), tmp_path), tmp_path / "out"
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(2).uniform(0, 1, (BATCH, 3, 16, 16)).astype(np.float32))
    # --skip-graph, --layout nchw: neither stage is what this tests (8 s less on 2 cores)
    assert optimize_model_main([path, "--precision", "int8", "--inputs", str(tmp_path / "in.npz"), "--threads", "2",
                                "--skip-graph", "--layout", "nchw", "-o", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "compiled model vs onnxruntime" in last and "int8 vs fp32: cosine " in last and "top-1 " in last
    report = json.loads((out / "report.json").read_text())
    prec = report["precision"]
    assert {k: prec[k] for k in ("precision", "method", "calibration")} == \
        {"precision": "int8", "method": "static_qdq_per_channel", "calibration": "samples"}
    assert prec["onnxruntime_version"] and prec["accuracy_vs_fp32"]["cosine_similarity"] > 0.9
    assert report["model"].endswith("model.onnx")  # the user's file, not the temporary int8 one
    shipped = onnx.load(str(out / "optimized.onnx"))
    assert any(n.op_type == "DequantizeLinear" for n in shipped.graph.node)  # the quantized model was compiled
    assert "## Precision" in (out / "report.md").read_text()


# ------------------------------------------------------------------------------------------------ --calibration

def test_calibration_sets_split_stacked_samples_and_refuse_what_does_not_fit(tmp_path):
    graph = import_onnx(conv_net())
    sets = np.random.default_rng(3).uniform(0, 1, (5, BATCH, 3, 16, 16)).astype(np.float32)
    np.savez(tmp_path / "cal.npz", x=sets)
    got = quantize.calibration_sets(str(tmp_path / "cal.npz"), graph)
    assert len(got) == 5 and all(np.array_equal(g["x"], sets[i]) for i, g in enumerate(got))
    np.savez(tmp_path / "flat.npz", x=sets[0])  # one set, not stacked: the shape names the fix
    with pytest.raises(UserError, match=r"give N sets of float32\[4, 3, 16, 16\] stacked on a first axis"):
        quantize.calibration_sets(str(tmp_path / "flat.npz"), graph)
    np.savez(tmp_path / "other.npz", images=sets)
    with pytest.raises(UserError, match="holds images: name the model's inputs \\(x\\)"):
        quantize.calibration_sets(str(tmp_path / "other.npz"), graph)
    with pytest.raises(UserError, match="add --precision int8, or drop --calibration"):
        BuildContext.create("llvm", calibration=str(tmp_path / "cal.npz"))
