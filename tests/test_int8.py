"""Quantized models computed in integers (pipeline.passes.int8), the VNNI template (kerneltune.templates.int8) and
the quantized check's tolerance (graphopt.quant_tolerance).

Models are quantized with onnxruntime's own tools, as users do; each is a few thousand weights.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

os.environ.setdefault("TVM_NUM_THREADS", "2")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from graphopt.compare import compare_runs  # noqa: E402
from graphopt.feeds import feed_sets, run_ort_sets  # noqa: E402
from graphopt.quant_tolerance import model_tolerance  # noqa: E402
from kerneltune.targets.host import llvm_target  # noqa: E402
from models.builder import GraphBuilder  # noqa: E402
from pipeline.passes.int8 import Lowering  # noqa: E402
from pipeline.relax_import import import_model  # noqa: E402


def _quantize(model: onnx.ModelProto, tmp_path, static: bool, samples=None) -> onnx.ModelProto:
    """``model`` quantized as --precision int8 quantizes (onnxruntime's tools, pipeline.quantize's recipe)."""
    from pipeline.quantize import DYNAMIC, STATIC, FeedReader, quantize

    src, dst = tmp_path / "fp32.onnx", tmp_path / "int8.onnx"
    onnx.save(model, str(src))
    quantize(src, dst, STATIC if static else DYNAMIC, FeedReader(samples) if static else None, large=False)
    return onnx.load(str(dst))


def conv_net(batch: int = 1) -> onnx.ModelProto:
    """Conv (padded, bias) -> Relu -> depthwise Conv -> Relu -> Conv (stride 2) -> Relu, then GAP, Gemm."""
    b = GraphBuilder("int8-conv", seed=3)
    x = b.input("x", (batch, 3, 12, 12))
    h = b.op("Relu", [b.op("Conv", [x, b.he("w1", (16, 3, 3, 3), 27), b.normal("b1", (16,), 0.1)], pads=[1] * 4)])
    h = b.op("Relu", [b.op("Conv", [h, b.he("wd", (16, 1, 3, 3), 9), b.normal("bd", (16,), 0.1)], pads=[1] * 4,
                           group=16)])
    h = b.op("Relu", [b.op("Conv", [h, b.he("w2", (32, 16, 3, 3), 144), b.normal("b2", (32,), 0.1)],
                           pads=[1] * 4, strides=[2, 2])])
    h = b.op("Flatten", [b.op("GlobalAveragePool", [h])])
    b.op("Gemm", [h, b.normal("wf", (10, 32), 0.3), b.normal("bf", (10,), 0.05)], transB=1, out="y")
    b.output("y", (batch, 10))
    return b.model("int8 conv net")


def mlp(rows: int = 8) -> onnx.ModelProto:
    """Two MatMul + bias layers with a GELU-free Relu between: quantize_dynamic's MatMulInteger form."""
    b = GraphBuilder("int8-mlp", seed=4)
    x = b.input("x", (rows, 64))
    h = b.op("Relu", [b.op("Add", [b.op("MatMul", [x, b.normal("w1", (64, 96), 0.15)]), b.normal("b1", (96,), 0.1)])])
    b.op("Add", [b.op("MatMul", [h, b.normal("w2", (96, 32), 0.12)]), b.normal("b2", (32,), 0.1)], out="y")
    b.output("y", (rows, 32))
    return b.model("int8 mlp")


def _ops(mod: tvm.IRModule) -> list[tuple[str, tuple[str, ...]]]:
    """(op name, argument dtypes) of every call in main."""
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            found.append((e.op.name, tuple(str(getattr(a.ty, "dtype", "")) for a in e.args)))

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def _built_check(model: onnx.ModelProto, tmp_path, target: str = "llvm"):
    """optimize() the model (no graph stage, untuned) and return report.json's compile facts."""
    import json

    from pipeline.api import optimize

    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    optimize(str(path), output=tmp_path / "out", skip_graph=True, threads=2, target=target)
    return json.loads((tmp_path / "out" / "report.json").read_text())["stages"]["compile"]


def test_static_qdq_conv_net_computes_in_integers_and_matches_onnxruntime(tmp_path):
    rng = np.random.default_rng(0)
    samples = [{"x": rng.uniform(-1, 1, (1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    model = _quantize(conv_net(), tmp_path, static=True, samples=samples)
    mod = import_model(model).mod
    ops = _ops(mod)
    # both dense convs (as matmuls of their patches), the depthwise conv (an NHWC gather-multiply-add) and
    # the classifier multiply u8 activations by s8 weights into int32: no float product left
    assert not [a for name, a in ops if name == "relax.nn.conv2d"]
    assert sum(name == "relax.call_tir" for name, _ in ops) >= 3  # the input's layout, the patches, the depthwise
    # the quantized input reaches the first conv transposed to NHWC and padded (borders and a 4th channel) by
    # one kernel of the pass's own schedule
    layouts = [f for gv, f in mod.functions_items() if gv.name_hint.startswith("nhwc_padded")]
    assert len(layouts) == 1 and str(layouts[0].attrs["optimize_model.scheduled_by"]) == "int8 input layout"
    assert [a for name, a in ops if name == "relax.matmul"] == [("uint8", "int8")] * 3
    assert not any(name == "relax.dequantize" and a[0] == "int8" for name, a in ops)  # weights stay int8
    # where the target has a dot-product instruction the dense convs read their input in place: no patches
    implicit = import_model(model, int8=Lowering(implicit_conv=True)).mod
    names = [gv.name_hint for gv, f in implicit.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sum(n.startswith("conv2d_nhwc") for n in names) == 2 and not any(n.startswith("patches") for n in names)
    assert [a for name, a in _ops(implicit) if name == "relax.matmul"] == [("uint8", "int8")]  # the classifier
    facts = _built_check(model, tmp_path)
    assert facts["ok"] and facts["max_abs_err"] <= facts["quantization"]["outputs"][0]["step"] + 1e-6


def test_avx2_products_read_weights_widened_at_build_time_and_match_onnxruntime(tmp_path):
    """Without VNNI (x86-64-v3) the products multiply-add in 16 bits: the pass stores each s8 weight as int16
    once, so no kernel sign-extends it in its inner loop, and the int8 template takes them (it takes a weight
    of its instruction's type only).  The build matches onnxruntime."""
    from kerneltune.targets.host import missing_cpu_features

    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"})
    if missing_cpu_features(target):
        pytest.skip(f"this CPU cannot run x86-64-v3 code (lacks {missing_cpu_features(target)})")
    rng = np.random.default_rng(0)
    samples = [{"x": rng.uniform(-1, 1, (1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    model = _quantize(conv_net(), tmp_path, static=True, samples=samples)
    from kerneltune.targets.parse import parse_target
    from pipeline.passes.int8 import lowering_for

    lowering = lowering_for(parse_target("llvm -mcpu=x86-64-v3", 2))
    assert lowering.weight_dtype == "int16" and lowering.implicit_conv
    mod = import_model(model, int8=lowering).mod
    assert [a for name, a in _ops(mod) if name == "relax.matmul"] == [("uint8", "int16")]  # the classifier
    convs = [f for gv, f in mod.functions_items() if gv.name_hint.startswith("conv2d_nhwc")]
    assert len(convs) == 2 and all(str(f.params[1].ty.dtype) == "int16" for f in convs)  # params: x, weight
    from kerneltune.templates import int8
    from pipeline.partition import partition

    products = {t.task.kind + str(t.task.dims["N"]): int8.applies(t.task, target) for t in partition(mod).tasks
                if t.task is not None and t.task.kind in ("matmul", "conv2d_nhwc")}
    # the convs' 16 and 32 filters are whole 8-lane vectors; the classifier's 10 columns are not (generic template)
    assert products == {"conv2d_nhwc16": True, "conv2d_nhwc32": True, "matmul10": False}
    facts = _built_check(model, tmp_path, "llvm -mcpu=x86-64-v3")
    assert facts["ok"] and facts["max_abs_err"] <= facts["quantization"]["outputs"][0]["step"] + 1e-6


def test_dynamic_matmul_integer_is_a_u8_s8_product_equal_to_onnxruntime(tmp_path):
    model = _quantize(mlp(), tmp_path, static=False)
    ops = _ops(import_model(model).mod)
    assert [a for name, a in ops if name == "relax.matmul"] == [("uint8", "int8")] * 2
    facts = _built_check(model, tmp_path)
    assert facts["ok"] and facts["quantization"] is not None


def test_u8_weights_and_s8_activations_are_shifted_exactly(tmp_path):
    """QUInt8 weights (zero point 128-ish) and s8 activations: computed as u8 x s8 with the shifts in the
    zero-point terms; MatMulInteger's int32 output must equal onnxruntime's exactly."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(5)
    w = rng.integers(0, 256, (24, 16)).astype(np.uint8)
    nodes = [helper.make_node("MatMulInteger", ["a", "w", "az", "wz"], ["y"])]
    graph = helper.make_graph(nodes, "mixed", [helper.make_tensor_value_info("a", TensorProto.INT8, [4, 24])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [4, 16])],
                              [onnx.numpy_helper.from_array(w, "w"),
                               onnx.numpy_helper.from_array(np.array(-3, np.int8), "az"),
                               onnx.numpy_helper.from_array(rng.integers(100, 150, 16).astype(np.uint8), "wz")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    ops = _ops(import_model(model).mod)
    assert ("relax.matmul", ("uint8", "int8")) in ops
    facts = _built_check(model, tmp_path)
    assert facts["ok"] and facts["max_abs_err"] == 0.0


def test_quantized_tolerance_takes_one_step_and_refuses_a_zero_point_error(tmp_path):
    rng = np.random.default_rng(1)
    samples = [{"x": rng.uniform(-1, 1, (1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    model = _quantize(conv_net(), tmp_path, static=True, samples=samples)
    graph = import_model(model).graph
    sets = feed_sets(graph, 0, None)
    refs = run_ort_sets(model, sets)
    tol = model_tolerance(model, sets, refs)
    step = tol.outputs[0].step
    assert step > 0 and tol.outputs[0].allowance >= step
    one_step = [[r[0] + step * np.sign(rng.uniform(-1, 1, r[0].shape)).astype(np.float32)] for r in refs]
    assert compare_runs(list(zip(refs, one_step)), tol.tolerances).ok
    # a zero point applied twice shifts outputs by many steps: refused
    shifted = [[r[0] + 8 * tol.outputs[0].allowance] for r in refs]
    assert not compare_runs(list(zip(refs, shifted)), tol.tolerances).ok
    assert model_tolerance(conv_net(), sets, run_ort_sets(conv_net(), sets)) is None  # fp32: dtype table


def _fused_int8_task(product):
    """The one fused kernel of ``product(bb, x) -> int32`` with a float epilogue, as the pipeline fuses it, as a
    task."""
    from kerneltune.task import classify_primfunc

    bb = relax.BlockBuilder()
    x, emit = product
    with bb.function("main", [x]):
        with bb.dataflow():
            acc = emit(bb, x)
            out = bb.emit_output(relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(np.float32(0.5))))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(mod)))
    mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)  # the weight: packed at build time
    funcs = [(gv.name_hint, f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(funcs) == 1  # the epilogue fused into the product
    return classify_primfunc(*funcs[0])


def _matmul(m=8, k=64, n=48, weight="int8"):
    """``a @ W`` as the int8 pass emits it: u8 rows by an s8 weight, stored as ``weight`` (int16 for the 16-bit
    multiply-adds)."""
    def emit(bb, a):
        w = relax.const(np.random.default_rng(0).integers(-128, 128, (k, n)).astype(weight))
        return bb.emit(relax.op.matmul(a, w, out_dtype="int32"))
    return relax.Var("a", relax.TensorType([m, k], "uint8")), emit


def _implicit_conv(stride=2, h=9, c=8, o=48, weight="int8"):
    """The int8 pass's NHWC conv read in place (3x3, ``stride``, input padded already), as it emits it."""
    from pipeline.passes.int8 import implicit_conv

    oh = (h - 3) // stride + 1
    w = np.random.default_rng(0).integers(-128, 128, (3, 3, c, o)).astype(weight)
    return relax.Var("x", relax.TensorType([1, h, h, c], "uint8")), \
        lambda bb, xt: implicit_conv(bb, xt, w, (stride, stride), oh, oh)


@pytest.mark.parametrize("mcpu, instruction", [("native", None), ("sapphirerapids", "VNNI_512"),
                                               ("x86-64-v3+avxvnni", "VNNI_256"), ("skylake-avx512", "MADD_512"),
                                               ("x86-64-v3", "MADD_256")])
def test_int8_template_schedules_u8_s8_products_with_each_instruction_exactly(mcpu, instruction):
    """Every instruction family (VNNI 512 / 256, exact 16-bit multiply-adds on AVX-512BW / AVX2) computes the
    reference's int32 sums bit for bit, at the default config and at sampled ones: a matmul and an implicit-GEMM
    conv (stride 2, its taps reduction loops around the channels)."""
    import random

    from kerneltune.prepack import pack_inputs, strip
    from kerneltune.targets.host import missing_cpu_features
    from kerneltune.task import IMPLICIT_CONV, build_func, run_func
    from kerneltune.templates import apply, default_config, int8, int8_intrin, space_for, task_for

    cpu, _, extra = mcpu.partition("+")
    target = llvm_target() if mcpu == "native" else tvm.target.Target(
        {"kind": "llvm", "mcpu": cpu, **({"mattr": [f"+{extra}"]} if extra else {})})
    if missing_cpu_features(target):
        pytest.skip(f"this CPU cannot run -mcpu={mcpu} code (lacks {missing_cpu_features(target)})")
    if instruction is not None:
        assert int8_intrin.instruction_for(target) == getattr(int8_intrin, instruction)
    if instruction == "VNNI_512":  # 24 columns (MobileNet-v2's): the 8-lane VL form, not the generic path
        assert int8_intrin.instruction_for(target, 24) == int8_intrin.VNNI_256
    weight = int8_intrin.instruction_for(target).weight  # int16 for the 16-bit multiply-adds
    for product, kind, samples in ((_matmul(weight=weight), "matmul", 3),
                                   (_implicit_conv(weight=weight), IMPLICIT_CONV, 2)):
        task = _fused_int8_task(product)
        assert task is not None and task.kind == kind and int8.applies(task, target)
        assert task_for(task.name, task.func) is not None  # the pipeline takes it as a task on any host
        # full-range operands: the 16-bit path must not saturate where vpmaddubsw would (255 x 127 x 2 > 32767)
        inputs = task.make_inputs(0)
        if instruction == "MADD_256":
            inputs[0] = np.full(inputs[0].shape, 255, np.uint8)
            inputs[1] = np.where(np.arange(inputs[1].size).reshape(inputs[1].shape) % 3, 127, -128).astype(weight)
        want = task.reference(inputs)
        space, rng = space_for(task, target), random.Random(1)
        for config in [default_config(task, target)] + [space.sample(rng) for _ in range(samples)]:
            kernel, packings = strip(apply(task, config, target))
            got = run_func(build_func(kernel, target), task, pack_inputs(inputs, packings), tvm.cpu())
            np.testing.assert_array_equal(got[0], want[0])


def test_quantize_rounds_half_to_even_as_onnx_does():
    """Ties: ONNX (and onnxruntime) round x / scale half to even (0.5 -> 0, 2.5 -> 2).  A quantize left to
    TVM's legalization computes ``round``, which TVM's LLVM codegen lowers to ``nearbyint``: the same, and
    vectorized; this holds the build to it on every tie."""
    from onnx import TensorProto, helper, numpy_helper

    from kerneltune.targets.parse import parse_target
    from pipeline.compile import compile_partition, device_for, run, to_device
    from pipeline.partition import partition

    scale, zp = numpy_helper.from_array(np.array(0.5, np.float32), "s"), numpy_helper.from_array(np.array(3, np.uint8), "z")
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])]  # a quantized output: left as it is
    g = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                          [helper.make_tensor_value_info("q", TensorProto.UINT8, [2, 16])], [scale, zp])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = (np.arange(32, dtype=np.float32).reshape(2, 16) - 10) * 0.25  # every other value a tie (k + 0.5 steps)
    (ref,) = run_ort_sets(model, [{"x": x}], 1)[0]
    llvm = parse_target("llvm", 1)
    imported = import_model(model)
    compiled = compile_partition(imported, partition(imported.mod), llvm)
    (got,) = run(compiled.vm(), to_device({"x": x}, compiled.input_names, device_for(llvm)))
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("rounding_conversion", [False, True])
def test_requantization_rounds_ties_to_even_with_an_odd_zero_point(rounding_conversion):
    """The requantization ``clip(round(acc * m) + zp)``, here with every product a tie (m = 0.5, odd sums) and
    an odd zero point: computed as written, or with one rounding conversion of the clamped value (x86:
    ``lrint``, the zero point added after rounding), it equals onnxruntime's on every element."""
    from onnx import TensorProto, helper, numpy_helper

    from kerneltune.targets.parse import parse_target
    from pipeline.compile import compile_partition, device_for, run, to_device
    from pipeline.partition import partition

    def const(name, value, dtype):
        return numpy_helper.from_array(np.array(value, dtype), name)

    inits = [const("one", 1.0, np.float32), const("two", 2.0, np.float32), const("z0", 0, np.uint8),
             const("z3", 3, np.uint8), const("wz", 0, np.int8),
             numpy_helper.from_array(np.ones((4, 16), np.int8), "w")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "one", "z0"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "one", "z0"], ["xf"]),
             helper.make_node("DequantizeLinear", ["w", "one", "wz"], ["wf"]),
             helper.make_node("MatMul", ["xf", "wf"], ["y"]),
             helper.make_node("QuantizeLinear", ["y", "two", "z3"], ["q"])]
    g = helper.make_graph(nodes, "requant", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 4])],
                          [helper.make_tensor_value_info("q", TensorProto.UINT8, [32, 16])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = np.random.default_rng(5).integers(0, 130, (32, 4)).astype(np.float32)
    x[:, 0] += (x.sum(axis=1) % 2 == 0)  # odd row sums: acc * 0.5 is a tie in every row; sums past 510 clip
    (ref,) = run_ort_sets(model, [{"x": x}], 1)[0]
    imported = import_model(model, int8=Lowering(rounding_conversion=rounding_conversion))
    llvm = parse_target("llvm", 1)
    compiled = compile_partition(imported, partition(imported.mod), llvm)
    (got,) = run(compiled.vm(), to_device({"x": x}, compiled.input_names, device_for(llvm)))
    assert [a for name, a in _ops(imported.mod) if name == "relax.matmul"] == [("uint8", "int8")]
    np.testing.assert_array_equal(got, ref)


def test_a_max_pool_between_quantized_convs_pools_the_u8_values(tmp_path):
    """ResNet's stem: Conv -> Relu -> QDQ -> MaxPool -> QDQ -> Conv.  Dequantizing is monotonic, so the pool
    runs on the u8 tensor the first conv writes, and the quantize after it (same parameters) folds away;
    the outputs stay onnxruntime's."""
    b = GraphBuilder("int8-pool", seed=6)
    x = b.input("x", (1, 3, 16, 16))
    h = b.op("Relu", [b.op("Conv", [x, b.he("w1", (16, 3, 3, 3), 27), b.normal("b1", (16,), 0.1)], pads=[1] * 4)])
    h = b.op("MaxPool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    h = b.op("Relu", [b.op("Conv", [h, b.he("w2", (16, 16, 3, 3), 144), b.normal("b2", (16,), 0.1)], pads=[1] * 4)])
    b.op("Flatten", [b.op("GlobalAveragePool", [h])], out="y")
    b.output("y", (1, 16))
    rng = np.random.default_rng(1)
    samples = [{"x": rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(4)]
    model = _quantize(b.model("int8 pool"), tmp_path, static=True, samples=samples)
    ops = _ops(import_model(model).mod)
    assert [a for name, a in ops if name == "relax.nn.max_pool2d"] == [("uint8",)]
    # every QuantizeLinear becomes a rounding (the convs' in their epilogues, the others times the reciprocal
    # scale) except the max pool's, folded away
    quantizes = sum(n.op_type == "QuantizeLinear" for n in model.graph.node)
    assert sum(name == "relax.round" for name, _ in ops) == quantizes - 1
    facts = _built_check(model, tmp_path)
    assert facts["ok"] and facts["max_abs_err"] <= facts["quantization"]["outputs"][0]["step"] + 1e-6


def test_a_residual_add_reads_both_products_in_u8(tmp_path):
    """ResNet's downsample block: two quantized convs of one input meet in a residual add.  Each product's
    kernel ends at its requantize and writes u8; the add's dequantizes fuse into the kernel computed last, so
    no kernel writes the first product's result as floats (4x the bytes, read back by the add's kernel); the
    outputs stay onnxruntime's."""
    from pipeline.partition import partition

    b = GraphBuilder("int8-residual", seed=7)
    x = b.input("x", (1, 8, 6, 6))
    h = b.op("Relu", [b.op("Conv", [x, b.he("wa", (16, 8, 1, 1), 8), b.normal("ba", (16,), 0.1)])])
    h = b.op("Conv", [h, b.he("wb", (32, 16, 1, 1), 16), b.normal("bb", (32,), 0.1)])
    d = b.op("Conv", [x, b.he("wd", (32, 8, 1, 1), 8), b.normal("bd", (32,), 0.1)])
    h = b.op("Relu", [b.op("Add", [h, d])])
    b.op("Flatten", [b.op("GlobalAveragePool", [h])], out="y")
    b.output("y", (1, 32))
    rng = np.random.default_rng(2)
    samples = [{"x": rng.uniform(-1, 1, (1, 8, 6, 6)).astype(np.float32)} for _ in range(4)]
    model = _quantize(b.model("int8 residual"), tmp_path, static=True, samples=samples)
    fused = partition(import_model(model).mod).mod
    products = {}  # fused kernel name -> its output dtype, for every kernel holding an integer product

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir":
            name = e.args[0].name_hint
            if "matmul" in name or "conv2d" in name:
                products[name] = str(e.ty.dtype)

    relax.analysis.post_order_visit(fused["main"], visit)
    # the add's kernel dequantizes both products (and its own result, for the pool); the other two write u8
    adds = [n for n in products if n.count("dequantize") >= 2]
    assert len(products) == 3 and len(adds) == 1, products
    assert all(dtype == "uint8" for n, dtype in products.items() if n not in adds), products
    facts = _built_check(model, tmp_path)
    assert facts["ok"] and facts["max_abs_err"] <= facts["quantization"]["outputs"][0]["step"] + 1e-6
