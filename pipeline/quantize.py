"""``--precision int8``: the user's fp32 model quantized to int8 by onnxruntime's own quantization tools
(``onnxruntime.quantization``), then compiled as any quantized model a user passes would be.

We write no quantizer: onnxruntime's is the reference every int8 deployment of an ONNX model is compared
with, and its formats (QDQ, MatMulInteger) are what exporters and other runtimes read.  What this module
decides is what onnxruntime's documentation leaves to the user
(https://onnxruntime.ai/docs/performance/model-optimizations/quantization.html):

* the method, per model (:func:`choose_method`): static QDQ with per-channel weights for conv nets,
  dynamic for MatMul-dominated models (transformers), as the docs' "Method selection" recommends;
* the calibration data: the ``--inputs`` samples, else the check's seeded random input sets
  (:func:`graphopt.feeds.feed_sets`; a warning says the accuracy is then not measured on real data);
* the pre-processing the docs recommend before quantizing (``quant_pre_process``: symbolic shape
  inference and onnxruntime's basic graph optimizations), where it works on the model.

The quantized model replaces the input before the model checks (:func:`checked_model`), so every later
stage sees it, and the end-to-end check compares the compiled model with onnxruntime on the *quantized*
model (what the compiler was given).  The int8 model's accuracy against the fp32 model (:class:`Accuracy`)
is reported in report.json's ``precision`` section and on optimize-model's last line, not judged: how much
error an application tolerates is its own call.

Refused in one line, before any long work: a model that is already quantized, a GPU target (see
:func:`check_target`), a model with nothing onnxruntime quantizes.

No TVM here; onnxruntime's quantization package is imported when a model is quantized, not at import.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import onnx

from graphopt.compare import compare_outputs
from graphopt.cost.analytic import op_flops
from graphopt.errors import UserError
from graphopt.feeds import feed_sets, run_ort_sets
from graphopt.ir import Graph, Node
from graphopt.onnx_io import EXTERNAL_DATA_ABOVE, import_onnx, save_model
from graphopt.validate import ModelInput, check_model
from kerneltune.targets.registry import REGISTRY
from pipeline.context import BuildContext

log = logging.getLogger(__name__)

DOCS = "https://onnxruntime.ai/docs/performance/model-optimizations/quantization.html"
PRECISION_HELP = ("int8: quantize the fp32 model with onnxruntime's quantization tools first (static QDQ with "
                  "per-channel weights for conv nets, calibrated on --inputs; dynamic for transformers), then "
                  "compile it; its accuracy vs fp32 goes to report.json (default fp32)")

STATIC, DYNAMIC = "static_qdq_per_channel", "dynamic"

# Operators that mean a model is quantized already: the QDQ pair, onnxruntime's dynamic-quantization ops, the
# QOperator format (QLinearConv, QLinearMatMul, ...: the QLinear prefix) and its com.microsoft relatives.
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
                           "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QGemm", "QAttention",
                           "QEmbedLayerNormalization", "DynamicQuantizeLSTM", "MatMulNBits"})
CONV_OPS, MATMUL_OPS, GEMM_OPS = ("Conv", "ConvTranspose"), ("MatMul",), ("Gemm",)


def is_quantized_op(op_type: str) -> bool:
    return op_type in QUANTIZED_OPS or op_type.startswith("QLinear")


def quantized_ops(model: onnx.ModelProto) -> list[str]:
    """The quantized operator types in ``model`` (subgraphs of If/Loop/Scan included), sorted; [] for a float
    model."""
    found: set[str] = set()

    def walk(g: onnx.GraphProto) -> None:
        for n in g.node:
            if is_quantized_op(n.op_type):
                found.add(n.op_type)
            for a in n.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(sub)

    walk(model.graph)
    return sorted(found)


def check_target(ctx: BuildContext) -> None:
    """int8 is built for CPU targets only.  onnxruntime's int8 formats are made for its CPU kernels (U8S8
    integer dot products); on GPUs its docs point to TensorRT's int8 Tensor Core kernels ("Quantization on
    GPU", :data:`DOCS`), and this project's GPU templates compute in fp32, so a GPU build would dequantize
    back to fp32: the accuracy lost, nothing gained."""
    kind = REGISTRY.get(ctx.target.kind)
    if kind is not None and kind.is_gpu:
        raise UserError(f"--precision int8 with --target {ctx.target.kind}: int8 models are built for CPU targets "
                        "only (onnxruntime's int8 formats target CPU kernels): use --target llvm or drop "
                        "--precision int8")


# ---- the method ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MethodChoice:
    """Which onnxruntime quantization a model gets, and the FLOPs it was decided on."""

    method: str  # STATIC | DYNAMIC
    why: str
    flops: dict[str, float] = field(default_factory=dict)  # {"conv", "matmul", "gemm"}: FLOPs of one run


def _node_flops(graph: Graph, node: Node) -> float:
    """One Conv/MatMul/Gemm's FLOPs from its inferred shapes; where a shape is unknown, twice its weight's
    elements (the FLOPs of one output position: a lower bound, of the same unit)."""
    ins = [graph.shape(t) if t else None for t in node.inputs]
    outs = [graph.shape(t) for t in node.outputs[:1]]
    if all(s is not None and all(isinstance(d, int) for d in s) for s in ins[:2] + outs):
        return float(op_flops(node.op_type, {}, ins, outs))
    weight = graph.initializers.get(node.inputs[1]) if len(node.inputs) > 1 else None
    return 2.0 * weight.size if weight is not None else 0.0


def choose_method(graph: Graph) -> MethodChoice:
    """Static QDQ with per-channel weights, or dynamic quantization, from where the model's FLOPs are.

    onnxruntime's docs ("Method selection", :data:`DOCS`): "it is recommended to use dynamic quantization
    for RNNs and transformer-based models, and static quantization for CNN models".  Dynamic quantization
    computes each activation's range at run time (no calibration set to get wrong: transformers' activations
    vary widely from input to input), but its integer ops cover MatMul and Conv, not Gemm; static QDQ covers
    all three, with ranges calibrated once, and per-channel weight scales keep a conv's narrow filters from
    sharing a wide filter's scale.  So: dynamic when MatMul carries more FLOPs than Conv and Gemm together
    (a transformer; a ViT's patch-embedding Conv is a few percent), static otherwise (a conv net, and an MLP
    of Gemms, which dynamic quantization would leave in fp32).  A model with none of the three has nothing
    onnxruntime quantizes: refused."""
    flops = {"conv": 0.0, "matmul": 0.0, "gemm": 0.0}
    for n in graph.nodes:
        kind = ("conv" if n.op_type in CONV_OPS else "matmul" if n.op_type in MATMUL_OPS
                else "gemm" if n.op_type in GEMM_OPS else None)
        if kind and n.domain in ("", "ai.onnx"):
            flops[kind] += _node_flops(graph, n)
    total = sum(flops.values())
    if total <= 0:
        raise UserError("--precision int8: the model has no Conv, MatMul or Gemm for onnxruntime to quantize: "
                        "drop --precision int8")
    share = {k: v / total for k, v in flops.items()}
    if flops["matmul"] > flops["conv"] + flops["gemm"]:
        why = (f"MatMul carries {share['matmul']:.0%} of the Conv/MatMul/Gemm FLOPs (a transformer): dynamic "
               "quantization, onnxruntime's recommendation for transformers")
        return MethodChoice(DYNAMIC, why, flops)
    top = max(("conv", "gemm"), key=lambda k: flops[k])
    why = (f"{'Conv' if top == 'conv' else 'Gemm'} carries {share[top]:.0%} of the Conv/MatMul/Gemm FLOPs: "
           "static QDQ with per-channel weights, onnxruntime's recommendation for CNNs"
           + ("" if top == "conv" else " (its dynamic quantization has no integer Gemm)"))
    return MethodChoice(STATIC, why, flops)


# ---- calibration -----------------------------------------------------------------------------------------

@dataclass
class FeedReader:
    """The calibration inputs, one set per call: onnxruntime's ``CalibrationDataReader`` protocol (any class
    with ``get_next`` is one: its ``__subclasshook__``), fed only the model's runtime inputs."""

    sets: Sequence[dict[str, np.ndarray]]
    names: frozenset[str] | None = None  # the model's runtime inputs; None: every array
    _next: int = field(default=0, init=False)

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._next >= len(self.sets):
            return None
        feeds = self.sets[self._next]
        self._next += 1
        return {k: v for k, v in feeds.items() if self.names is None or k in self.names}


# ---- accuracy --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Accuracy:
    """The int8 model's outputs against the fp32 model's, both in onnxruntime, on the same input sets.

    ``max_abs_err`` / ``max_rel_err`` and ``top1_agreement`` come from :func:`graphopt.compare.compare_outputs`
    on every set's outputs pooled (top-1: the fraction of rows of a classifier-like output, float of rank 2
    or 3 with a last axis of at least 2 classes, whose arg-max agrees, over all rows of all sets; the lowest
    over such outputs); ``cosine_similarity`` is the lowest over the float outputs of the cosine of the
    angle between the two flattened results, the usual single figure for how far quantization moved an
    output as a whole."""

    max_abs_err: float
    max_rel_err: float
    cosine_similarity: float | None
    top1_agreement: float | None
    top1_rows: int
    input_sets: int

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for k, v in out.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = str(v)  # JSON holds no inf/nan
        return out


def _pooled(outputs: Sequence[np.ndarray]) -> np.ndarray:
    """One output over all input sets: rows of classes for a classifier-like output (so its top-1 counts
    every row), else flattened (no arg-max: rank 1)."""
    first = np.asarray(outputs[0])
    if np.issubdtype(first.dtype, np.floating) and first.ndim in (2, 3) and first.shape[-1] >= 2:
        return np.concatenate([np.asarray(o).reshape(-1, first.shape[-1]) for o in outputs])
    return np.concatenate([np.asarray(o).reshape(-1) for o in outputs])


def _cosine(a: np.ndarray, b: np.ndarray) -> float | None:
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.any():
        return None
    x, y = a[finite].astype(np.float64), b[finite].astype(np.float64)
    nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    if nx == 0.0 or ny == 0.0:
        return 1.0 if nx == ny else 0.0
    return float(np.clip(np.dot(x, y) / (nx * ny), -1.0, 1.0))


def accuracy(fp32_runs: Sequence[Sequence[np.ndarray]], int8_runs: Sequence[Sequence[np.ndarray]]) -> Accuracy:
    """:class:`Accuracy` of ``int8_runs`` against ``fp32_runs`` (per input set, the outputs in order)."""
    count = len(fp32_runs[0]) if fp32_runs else 0
    ref = [_pooled([run[i] for run in fp32_runs]) for i in range(count)]
    got = [_pooled([run[i] for run in int8_runs]) for i in range(count)]
    comp = compare_outputs(ref, got)
    cosines = [c for r, g in zip(ref, got) if np.issubdtype(r.dtype, np.floating) and r.shape == g.shape
               and (c := _cosine(r, g)) is not None]
    rows = sum(r.shape[0] for r in ref if r.ndim == 2)
    return Accuracy(comp.max_abs_err, comp.max_rel_err, min(cosines) if cosines else None, comp.top1_agreement,
                    rows if comp.top1_agreement is not None else 0, len(fp32_runs))


# ---- the report ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Precision:
    """report.json's ``precision`` section of an int8 build."""

    method: str
    why: str
    calibration: str | None  # "calibration" | "samples" | "random"; None: dynamic quantization calibrates nothing
    measured_on: str  # the inputs of the accuracy figures: "calibration" (--calibration) | "samples" | "random"
    pre_processed: str  # what onnxruntime's quant_pre_process did (or why it was skipped)
    quantized_ops: dict[str, int]
    accuracy: Accuracy
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"precision": "int8", "method": self.method, "why": self.why, "calibration": self.calibration,
                "measured_on": self.measured_on, "accuracy_vs_fp32": self.accuracy.to_json(),
                "onnxruntime_version": _ort_version(), "pre_processing": self.pre_processed,
                "quantized_ops": self.quantized_ops, "time_s": round(self.seconds, 3), "docs": DOCS}


FP32 = {"precision": "fp32"}  # report.json's section of a build that was not quantized


def _ort_version() -> str:
    try:
        return importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        return "unknown"


def accuracy_phrase(section: dict[str, Any] | None) -> str:
    """The phrase optimize-model appends to its last line for an int8 build ("" for fp32), from report.json's
    ``precision`` section: "int8 vs fp32: cosine 0.9991, top-1 98.4%"."""
    if not section or section.get("precision") != "int8":
        return ""
    acc = section["accuracy_vs_fp32"]
    parts = []
    if acc.get("cosine_similarity") is not None:
        parts.append(f"cosine {cosine_text(float(acc['cosine_similarity']))}")
    if acc.get("top1_agreement") is not None:
        parts.append(f"top-1 {acc['top1_agreement']:.1%}")
    if not parts:
        parts.append(f"max abs err {float(acc['max_abs_err']):.3g}")
    where = " (random inputs)" if section.get("measured_on") == "random" else ""
    return f"int8 vs fp32{where}: {', '.join(parts)}"


def cosine_text(c: float) -> str:
    """Four decimals, more where four would round a cosine short of 1 up to 1.0000 (0.99998 is not 1)."""
    digits = 4
    while c < 1.0 and f"{c:.{digits}f}" == f"{1.0:.{digits}f}" and digits < 8:
        digits += 1
    return f"{c:.{digits}f}"


# ---- quantizing ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_onnxruntime() -> Iterator[list[logging.LogRecord]]:
    """onnxruntime's quantization tools log to the root logger (``logging.warning``): their advice to run
    pre-processing is dropped (we run it where it works), and a process without logging handlers gets no
    ``logging.basicConfig`` from them.  Pre-processing's own errors (its graph optimization failing, with a
    traceback) are collected instead, for the report."""
    root = logging.getLogger()
    advice = _DropAdvice()
    root.addFilter(advice)
    placeholder = logging.NullHandler() if not root.handlers else None
    if placeholder:
        root.addHandler(placeholder)
    pre = logging.getLogger("onnxruntime.quantization.shape_inference")
    collected: list[logging.LogRecord] = []
    collector = _Collect(collected)
    saved = pre.propagate
    pre.addHandler(collector)
    pre.propagate = False
    try:
        yield collected
    finally:
        pre.propagate = saved
        pre.removeHandler(collector)
        if placeholder:
            root.removeHandler(placeholder)
        root.removeFilter(advice)


class _DropAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Please consider")


class _Collect(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


def _pre_process(src: Path, dst: Path, large: bool, collected: list[logging.LogRecord]) -> tuple[Path, str]:
    """onnxruntime's ``quant_pre_process`` (symbolic shape inference, then its basic graph optimizations: the
    docs' recommended first step) of ``src`` into ``dst``; ``src`` itself where it fails on the model."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    before = len(collected)
    try:
        quant_pre_process(src, dst, skip_optimization=large, save_as_external_data=large,
                          all_tensors_to_one_file=True, external_data_location=dst.name + ".data")
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - symbolic shape inference fails on some models: quantize as is
        log.info("onnxruntime's quantization pre-processing failed on the model (%s: %s); quantized without it",
                 type(exc).__name__, _first_line(exc))
        return src, f"skipped: it failed ({type(exc).__name__}: {_first_line(exc)})"
    if len(collected) > before:  # its graph optimization failed; the shape inference still ran
        log.info("onnxruntime's quantization pre-processing could not optimize the model: shape inference only")
        return dst, "shape inference only (onnxruntime's graph optimization failed on the model)"
    return dst, "symbolic shape inference and onnxruntime's basic graph optimizations (quant_pre_process)"


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]


def quantize(src: Path, dst: Path, method: str, reader: FeedReader | None, large: bool) -> None:
    """onnxruntime's quantizer, as :func:`choose_method` decided: static QDQ (QInt8 weights per channel,
    QUInt8 activations calibrated by MinMax on ``reader``'s sets: the docs' default U8S8 format) or dynamic
    (QInt8 weights; activations quantized per run)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    if method == STATIC:
        quantize_static(src, dst, reader, quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        use_external_data_format=large)
    else:
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, use_external_data_format=large)


def calibration_sets(path: str, graph: Graph) -> list[dict[str, np.ndarray]]:
    """``--calibration FILE.npz``: N sample sets stacked on a new first axis (an array ``[N, *shape]`` per
    runtime input), split into N feeds.  onnxruntime's calibration reads a set at a time, as does its
    accuracy run; a user calibrates on a few hundred images, which ``--inputs`` (one set, the check's)
    cannot hold for a batch-1 model.  Every array is checked before any quantizing: a name the model does
    not have, a set of another shape or dtype, or counts that differ, is one line."""
    inputs = {i.name: i for i in graph.inputs if i.name not in graph.initializers}
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError) as exc:
        raise UserError(f"--calibration {path!r} cannot be read ({_first_line(exc)}): pass an .npz written by "
                        "numpy.savez(FILE, input_name=array_of_N_sets, ...)") from None
    unknown = sorted(set(arrays) - set(inputs))
    if unknown or not arrays:
        raise UserError(f"--calibration {path!r} holds {', '.join(unknown) or 'no arrays'}: name the model's "
                        f"inputs ({', '.join(inputs)})")
    counts = set()
    for name, a in arrays.items():
        want = tuple(int(d) for d in inputs[name].shape)
        if a.shape[1:] != want or np.dtype(a.dtype) != np.dtype(inputs[name].dtype) or a.shape[0] < 1:
            stacked = ", ".join(map(str, want))
            raise UserError(f"--calibration {path!r}: {name} is {a.dtype}{list(a.shape)}; give N sets of "
                            f"{inputs[name].dtype}{list(want)} stacked on a first axis: [N, {stacked}]")
        counts.add(a.shape[0])
    if len(counts) > 1:
        raise UserError(f"--calibration {path!r}: the arrays hold {sorted(counts)} sets; give every input the "
                        "same number of sets")
    missing = [n for n in inputs if n not in arrays]
    if missing:
        raise UserError(f"--calibration {path!r} gives no {', '.join(missing)}: stack a set of each input")
    return [{k: a[i] for k, a in arrays.items()} for i in range(counts.pop())]


def checked_model(model_path: str, ctx: BuildContext) -> tuple[ModelInput, Precision | None]:
    """The model every stage works on, checked (:func:`graphopt.validate.check_model`): the input at fp32;
    with ``ctx.precision`` int8, onnxruntime's int8 model of it (checked too, in a temporary folder that is
    gone once it is loaded) with the :class:`Precision` of the build.  ``path``, ``upgrade``, the shapes and
    the samples stay the input's: report.json names the user's file and an opset upgrade it needed, and
    ``--inputs`` is read once."""
    if ctx.precision != "int8":
        return check_model(model_path, ctx.input_shapes, ctx.inputs), None
    check_target(ctx)
    fp32 = check_model(model_path, ctx.input_shapes, ctx.inputs)
    already = quantized_ops(fp32.proto)
    if already:
        raise UserError(f"{Path(model_path).name} is already quantized ({', '.join(already[:4])} nodes): drop "
                        "--precision int8")
    t0 = time.perf_counter()
    graph = import_onnx(fp32.proto, fp32.input_shapes)
    choice = choose_method(graph)
    log.info("--precision int8: %s", choice.why)
    if ctx.calibration is not None:
        sets, measured_on = calibration_sets(ctx.calibration, graph), "calibration"
    else:
        sets = feed_sets(graph, ctx.seed, fp32.samples)
        measured_on = "samples" if fp32.samples else "random"
    if measured_on == "random":
        log.warning("warning: --precision int8 without --inputs: %s on %d seeded random input sets, so the int8 "
                    "accuracy vs fp32 is not measured on real data; pass --inputs FILE.npz with real samples",
                    "calibrated and measured" if choice.method == STATIC else "measured", len(sets))
    large = fp32.proto.ByteSize() > EXTERNAL_DATA_ABOVE
    with tempfile.TemporaryDirectory(prefix="optimize-model-int8-") as tmp, _quiet_onnxruntime() as collected:
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        save_model(fp32.proto, src)  # as checked (an opset upgrade included); its weights beside it when large
        source, pre = _pre_process(src, Path(tmp) / "pre.onnx", large, collected)
        names = frozenset(i.name for i in fp32.proto.graph.input) - {t.name for t in fp32.proto.graph.initializer}
        try:
            quantize(source, dst, choice.method, FeedReader(sets, names) if choice.method == STATIC else None, large)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime's quantizer fails in its own ways on some models
            raise UserError(f"onnxruntime could not quantize {Path(model_path).name} ({type(exc).__name__}: "
                            f"{_first_line(exc)}): drop --precision int8, or pass a model quantized elsewhere") \
                from None
        try:  # at the sizes the fp32 model was checked at; --inputs was read then (and its warnings given)
            int8 = check_model(dst, fp32.input_shapes)
        except UserError as exc:
            raise UserError(f"onnxruntime's int8 model of {Path(model_path).name} fails the model checks ({exc}): "
                            "drop --precision int8") from None
        ops = Counter(n.op_type for n in int8.proto.graph.node if is_quantized_op(n.op_type))
        if not ops:
            raise UserError(f"onnxruntime quantized none of {Path(model_path).name}'s operators: drop "
                            "--precision int8")
        threads = int(ctx.threads or 0)
        acc = accuracy(run_ort_sets(str(src), sets, threads), run_ort_sets(str(dst), sets, threads))
    precision = Precision(method=choice.method, why=choice.why,
                          calibration=measured_on if choice.method == STATIC else None, measured_on=measured_on,
                          pre_processed=pre, quantized_ops=dict(sorted(ops.items())), accuracy=acc,
                          seconds=time.perf_counter() - t0)
    return replace(int8, path=fp32.path, upgrade=fp32.upgrade, input_shapes=fp32.input_shapes,
                   samples=fp32.samples, ranges=fp32.ranges), precision
