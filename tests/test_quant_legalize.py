"""Quantized operators TVM's ONNX importer lacks (QLinearConv, QLinearMatMul, ConvInteger), lowered by
:mod:`graphopt.legalize.quantized`, and the quantization parameters :mod:`graphopt.quant_check` refuses.

Each model is tiny (a few channels), built with ``onnx.helper``, and checked three ways on full-range integer
inputs: the lowered graph (exported back to ONNX) in onnxruntime against the original in onnxruntime, the
lowered graph built by TVM against the original in onnxruntime, and for integer-only operators (ConvInteger,
MatMulInteger) bit for bit.  Requantized outputs (QLinear*) may differ by one quantization step where the exact
value sits on a rounding boundary (onnxruntime's QLinear kernels rescale the int32 sum with one float
multiplier; the QDQ form divides a float sum): the tests print how many did (``pytest -s``).
"""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

os.environ.setdefault("TVM_NUM_THREADS", "2")

from graphopt.errors import UserError  # noqa: E402
from graphopt.feeds import run_ort, run_ort_sets  # noqa: E402
from graphopt.legalize import legalize  # noqa: E402
from graphopt.onnx_io import export_onnx, import_onnx  # noqa: E402

QUANT_OPS = {"QLinearConv", "QLinearMatMul", "ConvInteger"}
V = h.make_tensor_value_info
RNG = np.random.default_rng(7)


def make(nodes: list, inputs: list, outputs: list, inits: list, opset: int = 13) -> onnx.ModelProto:
    g = h.make_graph(nodes, "g", inputs, outputs, inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def const(name: str, value, dtype) -> onnx.TensorProto:
    return nh.from_array(np.asarray(value, dtype), name)


def full_range(shape, dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max + 1, size=shape).astype(dtype)


def lowered(model: onnx.ModelProto) -> onnx.ModelProto:
    legal = legalize(import_onnx(model), QUANT_OPS)
    assert not QUANT_OPS & {n.op_type for n in legal.graph.nodes}
    return export_onnx(legal.graph)


@pytest.fixture(scope="module")
def llvm():
    from kerneltune.targets.parse import parse_target

    return parse_target("llvm", 2)


def tvm_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], llvm) -> list[np.ndarray]:
    from pipeline.compile import compile_partition, device_for, run, to_device
    from pipeline.partition import partition
    from pipeline.relax_import import import_model

    imported = import_model(model)
    assert not QUANT_OPS & {n.op_type for n in imported.graph.nodes}
    compiled = compile_partition(imported, partition(imported.mod), llvm)
    return run(compiled.vm(), to_device(feeds, compiled.input_names, device_for(llvm)))


def within_one_step(name: str, got: np.ndarray, ref: np.ndarray) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    diff = np.abs(got.astype(np.int64) - ref.astype(np.int64))
    assert diff.max() <= 1, f"{name}: differs by up to {diff.max()} steps"
    print(f"{name}: {np.count_nonzero(diff)} of {diff.size} elements differ by one step")


def ort_lowered(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The lowered graph in onnxruntime, with its graph optimizations (what a user of optimized.onnx runs: they
    fuse the QDQ form back into onnxruntime's QLinear kernels) and without them (the lowered arithmetic itself)."""
    low = lowered(model)
    return {"ort": run_ort(low, feeds)[0], "ort-unoptimized": run_ort_sets(low, [feeds], optimize=False)[0][0]}


def check_requantized(name: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray], llvm) -> None:
    (ref,) = run_ort(model, feeds)
    for how, got in ort_lowered(model, feeds).items():
        within_one_step(f"{name} {how}", got, ref)
    (got,) = tvm_run(model, feeds, llvm)
    within_one_step(f"{name} tvm", got, ref)


def check_exact(model: onnx.ModelProto, feeds: dict[str, np.ndarray], llvm) -> None:
    (ref,) = run_ort(model, feeds)
    for got in ort_lowered(model, feeds).values():
        np.testing.assert_array_equal(got, ref)
    (got,) = tvm_run(model, feeds, llvm)
    assert got.dtype == ref.dtype
    np.testing.assert_array_equal(got, ref)


# ---- QLinearConv ----------------------------------------------------------------------------------------------
def qlinear_conv(per_channel: bool, signed: bool = False, opset: int = 13, bias: bool = True):
    """x [1, 3, 9, 9] -> 3x3 conv, pads 1, stride 2 -> y [1, 4, 5, 5]; u8 x s8 -> u8 (or s8 x s8 -> s8)."""
    xt = np.int8 if signed else np.uint8
    m, c = 4, 3
    ws = np.array([0.011, 0.02, 0.006, 0.015], np.float32) if per_channel else np.float32(0.012)
    wz = np.zeros(m, np.int8) if per_channel else np.int8(3)
    inits = [const("xs", 0.021, np.float32), const("xz", -5 if signed else 131, xt),
             nh.from_array(full_range((m, c, 3, 3), np.int8), "w"), const("ws", ws, np.float32),
             const("wz", wz, np.int8), const("ys", 0.07, np.float32), const("yz", 2 if signed else 120, xt)]
    names = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"]
    if bias:
        inits.append(const("B", RNG.integers(-2000, 2000, m), np.int32))
        names.append("B")
    et = T.INT8 if signed else T.UINT8
    node = h.make_node("QLinearConv", names, ["y"], name="qconv", pads=[1, 1, 1, 1], strides=[2, 2],
                       kernel_shape=[3, 3])
    model = make([node], [V("x", et, [1, c, 9, 9])], [V("y", et, [1, m, 5, 5])], inits, opset)
    return model, {"x": full_range((1, c, 9, 9), xt)}


@pytest.mark.parametrize("case", [dict(per_channel=False), dict(per_channel=True),
                                  dict(per_channel=True, signed=True, bias=False),
                                  dict(per_channel=True, opset=10)],
                         ids=["per-tensor", "per-channel", "s8-no-bias", "per-channel-opset10"])
def test_qlinear_conv_matches_onnxruntime_within_one_step(case, llvm):
    model, feeds = qlinear_conv(**case)
    check_requantized(f"QLinearConv {case}", model, feeds, llvm)


def test_qlinear_conv_lowers_to_the_qdq_form():
    model, _ = qlinear_conv(per_channel=True)
    low = lowered(model)
    ops = [n.op_type for n in low.graph.node]
    assert ops.count("DequantizeLinear") == 3 and ops.count("QuantizeLinear") == 1 and ops.count("Conv") == 1
    (dq_w,) = [n for n in low.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w"]
    assert h.get_attribute_value(next(a for a in dq_w.attribute if a.name == "axis")) == 0
    conv = next(n for n in low.graph.node if n.op_type == "Conv")
    (dq_b,) = [n for n in low.graph.node if n.output[0] == conv.input[2]]
    assert dq_b.op_type == "DequantizeLinear" and dq_b.input[0] == "B"  # the int32 bias, scale xs * ws
    scale = nh.to_array(next(t for t in low.graph.initializer if t.name == dq_b.input[1]))
    np.testing.assert_array_equal(scale, np.float32(0.021) * np.array([0.011, 0.02, 0.006, 0.015], np.float32))
    attrs = {a.name: h.get_attribute_value(a) for a in conv.attribute}
    assert attrs["pads"] == [1, 1, 1, 1] and attrs["strides"] == [2, 2]


# ---- QLinearMatMul --------------------------------------------------------------------------------------------
def qlinear_matmul(per_column: bool, batched: bool = False, signed: bool = False, opset: int = 13):
    xt, et = (np.int8, T.INT8) if signed else (np.uint8, T.UINT8)
    k, n = 16, 5
    a_shape = [2, 3, k] if batched else [3, k]
    bs = np.array([0.01, 0.02, 0.015, 0.008, 0.03], np.float32) if per_column else np.float32(0.012)
    bz = np.array([0, 1, -2, 3, 0], np.int8) if per_column else np.int8(-1)
    inits = [const("as", 0.03, np.float32), const("az", 7 if signed else 128, xt),
             nh.from_array(full_range((k, n), np.int8), "b"), const("bs", bs, np.float32), const("bz", bz, np.int8),
             const("ys", 0.1, np.float32), const("yz", 0 if signed else 128, xt)]
    node = h.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"], name="qmm")
    model = make([node], [V("a", et, a_shape)], [V("y", et, a_shape[:-1] + [n])], inits, opset)
    return model, {"a": full_range(a_shape, xt)}


@pytest.mark.parametrize("case", [dict(per_column=False), dict(per_column=True, batched=True),
                                  dict(per_column=True, signed=True), dict(per_column=True, opset=10)],
                         ids=["per-tensor", "per-column-batched", "s8", "per-column-opset10"])
def test_qlinear_matmul_matches_onnxruntime_within_one_step(case, llvm):
    model, feeds = qlinear_matmul(**case)
    check_requantized(f"QLinearMatMul {case}", model, feeds, llvm)


# ---- ConvInteger ----------------------------------------------------------------------------------------------
def conv_integer(zero_points: bool, x_type=np.uint8, w_type=np.uint8):
    m, c = 4, 3
    ex = h.np_dtype_to_tensor_dtype(np.dtype(x_type))
    inits = [nh.from_array(full_range((m, c, 3, 3), w_type), "w")]
    names = ["x", "w"]
    if zero_points:
        inits += [const("xz", 17, x_type), const("wz", 3, w_type)]
        names += ["xz", "wz"]
    node = h.make_node("ConvInteger", names, ["y"], name="cint", pads=[1, 1, 1, 1], strides=[2, 2])
    model = make([node], [V("x", ex, [1, c, 8, 8])], [V("y", T.INT32, [1, m, 4, 4])], inits)
    return model, {"x": full_range((1, c, 8, 8), x_type)}


@pytest.mark.parametrize("case", [dict(zero_points=True), dict(zero_points=False),
                                  dict(zero_points=True, x_type=np.int8, w_type=np.int8)],
                         ids=["zero-points", "no-zero-points", "s8"])
def test_conv_integer_is_exact(case, llvm):
    model, feeds = conv_integer(**case)
    check_exact(model, feeds, llvm)


def test_conv_integer_sums_beyond_float32_are_split_and_exact(llvm):
    """64 channels of 3x3 at the extremes of u8 x s8: a sum reaches -18800385, odd and beyond 2**24, which one
    float32 Conv cannot hold; the lowering splits the input channels into Convs whose sums stay exact."""
    m, c = 2, 64
    w = np.full((m, c, 3, 3), -128, np.int8)
    w[0, 0, 0, 0] = -127  # an odd total
    w[1] = 127
    model = make([h.make_node("ConvInteger", ["x", "w"], ["y"], name="wide")],
                 [V("x", T.UINT8, [1, c, 3, 3])], [V("y", T.INT32, [1, m, 1, 1])], [nh.from_array(w, "w")])
    assert [n.op_type for n in lowered(model).graph.node].count("Conv") == 2
    extreme = np.full((1, c, 3, 3), 255, np.uint8)
    assert run_ort(model, {"x": extreme})[0][0, 0, 0, 0] == 255 * (-128 * c * 9 + 1) == -18800385
    for x in (extreme, full_range((1, c, 3, 3), np.uint8)):
        check_exact(model, {"x": x}, llvm)


# ---- models written by onnxruntime's own quantizers --------------------------------------------------------
def small_cnn() -> onnx.ModelProto:
    """Conv-Relu (stride 2) twice, then a MatMul head: [1, 3, 16, 16] -> [1, 10]."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w1"),
             nh.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b1"),
             nh.from_array(rng.normal(0, 0.1, (16, 8, 3, 3)).astype(np.float32), "w2"),
             nh.from_array(rng.normal(0, 0.1, 16).astype(np.float32), "b2"),
             nh.from_array(rng.normal(0, 0.05, (16 * 4 * 4, 10)).astype(np.float32), "wf"),
             const("shape", [1, -1], np.int64)]
    nodes = [h.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             h.make_node("Relu", ["c1"], ["r1"]),
             h.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             h.make_node("Relu", ["c2"], ["r2"]), h.make_node("Reshape", ["r2", "shape"], ["f"]),
             h.make_node("MatMul", ["f", "wf"], ["y"])]
    return make(nodes, [V("x", T.FLOAT, [1, 3, 16, 16])], [V("y", T.FLOAT, [1, 10])], inits)


@pytest.mark.parametrize("method", ["static-qoperator", "dynamic"])
def test_onnxruntime_quantized_models_lower_and_match(method, tmp_path, llvm, caplog):
    """quantize_static in the QOperator format writes QLinearConv/QLinearMatMul, quantize_dynamic ConvInteger with
    DynamicQuantizeLinear and MatMulInteger: the lowered graphs built by TVM match onnxruntime on the quantized
    model (within one step of the last requantization; the dynamic model's float epilogue to 1e-5)."""
    import logging

    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    from graphopt.quant_check import check_quantization
    from pipeline.quantize import FeedReader

    src, dst = tmp_path / "fp32.onnx", tmp_path / "int8.onnx"
    onnx.save(small_cnn(), str(src))
    feeds = [{"x": RNG.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(4)]
    caplog.set_level(logging.ERROR)  # the quantizers' advice to pre-process the model
    if method == "dynamic":
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["Conv", "MatMul"])
    else:
        quantize_static(str(src), str(dst), FeedReader(feeds), quant_format=QuantFormat.QOperator, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    model = onnx.load(str(dst))
    ops = {n.op_type for n in model.graph.node}
    assert ops >= ({"ConvInteger", "MatMulInteger"} if method == "dynamic" else {"QLinearConv", "QLinearMatMul"})
    check_quantization(model)
    (ref,) = run_ort(model, feeds[0])
    (got,) = tvm_run(model, feeds[0], llvm)
    if method == "dynamic":
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    else:  # y = DequantizeLinear(QLinearMatMul(...)): one step is that DequantizeLinear's scale
        last = next(n for n in model.graph.node if n.output[0] == "y")
        step = float(nh.to_array(next(t for t in model.graph.initializer if t.name == last.input[1])))
        assert np.abs(got - ref).max() <= step * 1.0001


# ---- through optimize-model: a QLinearConv and a mixed-type MatMulInteger ----------------------------------
def test_quantized_model_through_optimize_model(tmp_path):
    """One model, two outputs: a QLinearConv (lowered; its u8 output checked within one step by the pipeline)
    and a MatMulInteger with s8 A and u8 B (legal ONNX; TVM converts it itself), which must come out exact."""
    from pipeline.artifact import Model
    from pipeline.cli import optimize_model_main

    conv, _ = qlinear_conv(per_channel=True)
    k, n = 16, 6
    inits = list(conv.graph.initializer) + [nh.from_array(full_range((k, n), np.uint8), "b"), const("az", -3, np.int8),
                                            const("bz", RNG.integers(0, 255, n), np.uint8)]
    nodes = list(conv.graph.node) + [h.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["mm"], name="mmi")]
    model = make(nodes, list(conv.graph.input) + [V("a", T.INT8, [4, k])],
                 list(conv.graph.output) + [V("mm", T.INT32, [4, n])], inits)
    feeds = {"x": full_range((1, 3, 9, 9), np.uint8), "a": full_range((4, k), np.int8)}
    src, out = tmp_path / "q.onnx", tmp_path / "out"
    onnx.save(model, str(src))
    np.savez(tmp_path / "inputs.npz", **feeds)
    assert optimize_model_main([str(src), "--threads", "2", "--skip-graph", "--skip-tune", "--no-progress",
                                "--inputs", str(tmp_path / "inputs.npz"), "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["stages"]["legalize"]["lowered"] == {"QLinearConv": 1}
    assert report["stages"]["compile"]["ok"]
    ref_y, ref_mm = run_ort(model, feeds)
    got = Model.load(str(out)).run(feeds)
    np.testing.assert_array_equal(got["mm"], ref_mm)
    within_one_step("optimize-model QLinearConv", got["y"], ref_y)
    optimized = onnx.load(str(out / "optimized.onnx"))
    assert "QLinearConv" not in {nd.op_type for nd in optimized.graph.node}
    for got_ort, ref in zip(run_ort(optimized, feeds), (ref_y, ref_mm)):  # the shipped graph runs in onnxruntime
        assert np.abs(got_ort.astype(np.int64) - ref.astype(np.int64)).max() <= (1 if ref.dtype == np.uint8 else 0)


# ---- bad quantization parameters, refused up front (graphopt.quant_check) --------------------------------------
def qdq(scale=0.05, zero=np.uint8(3), axis: int | None = None, opset: int = 13, q_zero=None, output_dtype=None):
    """x [2, 4] float -> QuantizeLinear (node 'quant') -> DequantizeLinear (node 'dequant') -> float."""
    q_attrs = {} if axis is None else {"axis": axis}
    if output_dtype is not None:
        q_attrs["output_dtype"] = output_dtype
    zero_init = zero if isinstance(zero, onnx.TensorProto) else nh.from_array(np.asarray(zero), "zp")
    inits = [nh.from_array(np.asarray(scale, np.float32), "s"), zero_init]
    q_ins = ["x", "s", "zp"]
    if q_zero is not None:
        inits.append(q_zero)
        q_ins = ["x", "s", q_zero.name]
    nodes = [h.make_node("QuantizeLinear", q_ins, ["q"], name="quant", **q_attrs),
             h.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], name="dequant",
                         **({} if axis is None else {"axis": axis}))]
    g = h.make_graph(nodes, "g", [V("x", T.FLOAT, [2, 4])], [V("y", T.FLOAT, [2, 4])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8 if opset < 21 else 10
    return m


def refused(tmp_path, model: onnx.ModelProto) -> str:
    from graphopt.validate import check_model

    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UserError) as info:
        check_model(str(path))
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_a_valid_qdq_model_and_the_quantized_test_models_pass_the_checks(tmp_path):
    from graphopt.validate import check_model

    for k, model in enumerate([qdq(), qdq(scale=[0.1, 0.2, 0.3, 0.4], zero=np.zeros(4, np.int8), axis=1),
                               qlinear_conv(per_channel=True)[0], qlinear_matmul(per_column=True)[0],
                               conv_integer(zero_points=True)[0]]):
        onnx.save(model, str(tmp_path / f"{k}.onnx"))
        check_model(str(tmp_path / f"{k}.onnx"))


@pytest.mark.parametrize("scale, words", [(0.0, "is zero"), (-0.5, "is negative"), (float("nan"), "is NaN"),
                                          (float("inf"), "is infinite"),
                                          ([0.1, 0.0, 0.3, 0.4], "is zero at index 1")])
def test_a_scale_that_is_not_positive_and_finite_is_refused(tmp_path, scale, words):
    axis = 1 if isinstance(scale, list) else None
    zero = np.zeros(4, np.uint8) if axis else np.uint8(3)
    msg = refused(tmp_path, qdq(scale=scale, zero=zero, axis=axis))
    assert "QuantizeLinear node 'quant'" in msg and "y_scale 's'" in msg and words in msg
    assert "positive finite" in msg


def test_a_zero_point_of_another_type_than_its_tensor_is_refused(tmp_path):
    # DequantizeLinear reads the uint8 output of QuantizeLinear (its own zero point 'zq') with an int8 zero point
    msg = refused(tmp_path, qdq(zero=np.int8(0), q_zero=nh.from_array(np.uint8(3), "zq")))
    assert "DequantizeLinear node 'dequant'" in msg and "x_zero_point 'zp' is int8 but x 'q' is uint8" in msg


def test_a_16_bit_zero_point_where_the_operator_takes_8_bits_is_refused(tmp_path):
    model, _ = qlinear_conv(per_channel=False)
    next(t for t in model.graph.initializer if t.name == "yz").CopyFrom(nh.from_array(np.uint16(120), "yz"))
    model.graph.output[0].type.tensor_type.elem_type = T.UINT16
    msg = refused(tmp_path, model)
    assert "QLinearConv node 'qconv'" in msg and "y 'y' is uint16" in msg and "uint8 or int8" in msg


def test_a_per_axis_scale_on_an_axis_that_does_not_exist_is_refused(tmp_path):
    msg = refused(tmp_path, qdq(scale=[0.1, 0.2, 0.3, 0.4], zero=np.zeros(4, np.uint8), axis=2))
    assert "QuantizeLinear node 'quant'" in msg and "axis 2 does not exist" in msg and "rank 2" in msg


def test_a_per_axis_scale_of_the_wrong_length_is_refused(tmp_path):
    msg = refused(tmp_path, qdq(scale=[0.1, 0.2, 0.3], zero=np.zeros(3, np.uint8), axis=1))
    assert "QuantizeLinear node 'quant'" in msg and "has 3 elements" in msg and "4 along axis 1" in msg


def test_a_per_channel_weight_scale_of_the_wrong_length_is_refused(tmp_path):
    model, _ = qlinear_conv(per_channel=True)
    for name, value in (("ws", np.full(3, 0.01, np.float32)), ("wz", np.zeros(3, np.int8))):
        t = next(t for t in model.graph.initializer if t.name == name)
        t.CopyFrom(nh.from_array(value, name))
    msg = refused(tmp_path, model)
    assert "QLinearConv node 'qconv'" in msg and "w_scale 'ws' has 3 elements" in msg and "4 along axis 0" in msg


@pytest.mark.parametrize("elem, name", [(T.INT4, "int4"), (T.UINT4, "uint4"), (T.FLOAT8E4M3FN, "float8")])
def test_int4_and_float8_quantized_types_are_refused(tmp_path, elem, name):
    msg = refused(tmp_path, qdq(zero=h.make_tensor("zp", elem, [], [0]), opset=21))
    assert "QuantizeLinear node 'quant'" in msg and f"quantized to {name}" in msg and "does not compute" in msg


def test_int4_by_output_dtype_is_refused(tmp_path):
    model = qdq(opset=21, q_zero=None, output_dtype=T.INT4)
    model.graph.node[0].input[2] = ""  # no zero point: the type comes from output_dtype
    model.graph.node[1].input[2] = ""
    del model.graph.initializer[1]
    msg = refused(tmp_path, model)
    assert "QuantizeLinear node 'quant'" in msg and "quantized to int4" in msg


def test_forms_onnxruntime_does_not_compute_are_refused(tmp_path):
    model, _ = conv_integer(zero_points=True)
    t = next(t for t in model.graph.initializer if t.name == "wz")
    t.CopyFrom(nh.from_array(np.array([1, 2, 3, 4], np.uint8), "wz"))
    msg = refused(tmp_path, model)
    assert "ConvInteger node 'cint'" in msg and "w_zero_point 'wz' has 4 elements" in msg and "onnxruntime" in msg

    inits = [nh.from_array(full_range((4, 3), np.uint8), "b"), const("az", [1, 2], np.uint8)]
    model = make([h.make_node("MatMulInteger", ["a", "b", "az"], ["y"], name="rows")], [V("a", T.UINT8, [2, 4])],
                 [V("y", T.INT32, [2, 3])], inits)
    msg = refused(tmp_path, model)
    assert "MatMulInteger node 'rows'" in msg and "a_zero_point 'az'" in msg and "per row" in msg


def test_blocked_quantization_is_refused(tmp_path):
    inits = [const("s", np.full((2, 2), 0.1), np.float32), const("zp", np.zeros((2, 2)), np.int8)]
    node = h.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], name="blocks", axis=1, block_size=2)
    g = h.make_graph([node], "g", [V("q", T.INT8, [2, 4])], [V("y", T.FLOAT, [2, 4])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    m.ir_version = 10
    msg = refused(tmp_path, m)
    assert "DequantizeLinear node 'blocks'" in msg and "blocked quantization (block_size 2)" in msg
