"""Fuse a Relax module into kernels and list them as tuning tasks.

TVM's default CPU build legalizes every operator into its own PrimFunc and never fuses, so a BERT layer
becomes ~40 kernels whose intermediates round-trip through memory.  We run the fusion passes ourselves
(LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR): a matmul then carries its bias, GELU
or residual add as an epilogue, and each fused PrimFunc is one task.

Tasks are what kernel tuning and the task scheduler work on: identical kernels (the same PrimFunc, up to
structure, e.g. the QKV projections of every layer) are one task whose weight is how often the model calls
it, so the scheduler's objective sum(weight x latency) is the model's kernel time.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import tvm
import tvm_ffi
from tvm import relax

from graphopt.errors import UserError
from kerneltune import templates
from kerneltune.describe import describe
from kerneltune.native_log import quiet_native_stderr
from kerneltune.opkinds import KINDS as OP_KINDS
from kerneltune.opkinds import VARIANTS, base_kind
from kerneltune.task import symbolic_axes
from pipeline.passes import provenance
from pipeline.passes.fast_sigmoid import FastSigmoid
from pipeline.passes.fold import FoldConstants
from pipeline.passes.lane_softmax import LaneSoftmax
from pipeline.passes.grouped_reshape import legalize_reshape
from pipeline.passes.provenance import CallSite
from pipeline.symbolic import at_sizes, specialize

KINDS = OP_KINDS + tuple(VARIANTS) + ("other",)  # FusedTask.kind: a tunable kind, or a kernel no template covers

# FastMathTransform first (with our LaneSoftmax and FastSigmoid, pipeline.passes.lane_softmax and pipeline.passes.fast_sigmoid,
# just before it): it swaps
# erf/exp/tanh/softmax for TOPI's polynomial versions, which vectorize;
# the exact ones lower to scalar libm calls, and on BERT the GELU's erf alone made the FFN1 kernel ~4x
# slower than the same matmul without it.  The approximations are accurate to ~1e-7 relative; the whole
# model stays within ~2e-6 of onnxruntime.
#
# LegalizeOps with our rule for a reshape over a symbolic size (pipeline.passes.grouped_reshape: no division by
# the size, so it fuses as a fixed-size reshape does).
#
# AttachAttrLayoutFreeBuffers last: it marks each kernel's parameters that the graph feeds with constants
# (the weights), which the CPU template may then store pre-packed (kerneltune.prepack).
FUSION_PASSES = (
    "FastMathTransform", "LegalizeOps", "AnnotateTIROpPattern", "FoldConstant", "FuseOps", "FuseTIR",
    "DeadCodeElimination", "CanonicalizeBindings", "AttachAttrLayoutFreeBuffers",
)


@dataclass
class FusedTask:
    """One distinct fused kernel of the model."""

    index: int
    name: str  # the PrimFunc's global name (first occurrence)
    kind: str  # matmul | batch_matmul | conv2d | conv2d_nchwc | other
    shapes: list[tuple[int, ...]]  # argument shapes, inputs then output
    dtype: str
    weight: int  # calls per model run
    flops: float  # per call
    func: tvm.tirx.PrimFunc
    names: list[str] = field(default_factory=list)  # every global name merged into this task
    task: Any = None  # kerneltune Task when a template covers the kernel, else None
    symbolic: bool = False  # ``func`` has a symbolic extent; ``task`` is its instance at the representative size
    # a symbolic kernel's growth with each served dimension: name -> (FLOPs exponent, bytes exponent), so
    # ``flops`` and the argument bytes at the representative size scale to a call at another (:func:`_scaling`)
    scaling: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def scheduled_task(self) -> Any:
        """The kerneltune Task a config is applied to: ``task`` itself, or for a symbolic kernel its instance
        with the kernel as ``func``, so that the template schedules the kernel that ships (its symbolic tiles)
        with the instance's axes - in the build and when the tuner measures a config alike."""
        return replace(self.task, func=self.func) if self.symbolic and self.task is not None else self.task

    def summary(self) -> dict:
        out = {"index": self.index, "name": self.name, "names": list(self.names), "kind": self.kind,
               "weight": self.weight,
               "flops": self.flops, "shapes": [list(s) for s in self.shapes], "dtype": self.dtype,
               "template": None if self.task is None else getattr(self.task, "key", str(self.task))}
        if self.scaling:
            out["scaling"] = {name: list(e) for name, e in self.scaling.items()}
        return out


@dataclass
class Partition:
    """The fused module and its tasks (ordered as the model first calls them)."""

    mod: tvm.IRModule
    tasks: list[FusedTask]
    layout: dict | None = None  # what the layout stage did (pipeline.layout.search), for report.json
    sites: list[CallSite] = field(default_factory=list)  # main's kernel calls in order, with their ONNX nodes

    def total_flops(self) -> float:
        return sum(t.weight * t.flops for t in self.tasks)


def fuse(mod: tvm.IRModule, known: dict | None = None) -> tuple[tvm.IRModule, list[CallSite]]:
    """Run the fusion passes (the part of the default CPU pipeline that the VM build leaves out); with the
    ONNX nodes each kernel call of the result computes (:mod:`pipeline.passes.provenance`: read from the calls' spans
    just before LegalizeOps drops them, then carried by the bound variables through FuseOps; ``known``: the
    nodes of ``main``'s variables before a stage that rebuilt calls without their spans, the layout stage's)."""
    passes = [FoldConstants, LaneSoftmax(), FastSigmoid()] + [
        relax.transform.LegalizeOps({"relax.reshape": legalize_reshape}) if p == "LegalizeOps"
        else getattr(relax.transform, p)() for p in FUSION_PASSES]
    legalize, fused_at = 3 + FUSION_PASSES.index("LegalizeOps"), 3 + FUSION_PASSES.index("FuseOps") + 1
    with quiet_native_stderr():  # TOPI's fast take warns once per Gather
        imported = provenance.binding_nodes(mod["main"], known)  # FastMathTransform rebuilds exp/erf/softmax
        mod = tvm.transform.Sequential(passes[:legalize])(mod)
        nodes = provenance.binding_nodes(mod["main"], imported)
        mod = tvm.transform.Sequential(passes[legalize:fused_at - 1])(mod)
        legal = mod["main"]
        mod = passes[fused_at - 1](mod)
        traced = provenance.fused_nodes(mod, nodes, legal)
        mod = tvm.transform.Sequential(passes[fused_at:])(mod)
    return mod, provenance.call_sites(mod, traced)


def _shape(ty, at: Mapping[str, int]) -> tuple[int, ...]:
    """A tensor's shape, a symbolic size read as its representative size ``at`` (a build serving a range)."""
    shape = getattr(ty, "shape", None)
    if shape is None:
        return ()
    try:
        return tuple(int(d) for d in at_sizes(getattr(shape, "values", shape), at))
    except TypeError:  # a symbolic size no range names: imports are static otherwise, so this is a bug upstream
        raise UserError(f"a fused kernel has a non-static shape {shape}; pass --input-shape for every "
                        "dynamic input") from None


def call_sites(mod: tvm.IRModule, at: Mapping[str, int] | None = None):
    """(global var, argument shapes + output shape, dtype) of every call_tir in ``main``, in order (symbolic
    sizes at ``at``)."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    main = mod["main"]
    for block in main.body.blocks:
        for binding in block.bindings:
            call = binding.value
            if isinstance(call, relax.Call) and call.op.same_as(call_tir):
                gv = call.args[0]
                args = list(call.args[1].fields)
                shapes = [_shape(a.ty, at or {}) for a in args] + [_shape(call.ty, at or {})]
                yield gv, shapes, getattr(call.ty, "dtype", "")


def _flops(func: tvm.tirx.PrimFunc) -> float:
    from tvm.s_tir.analysis import estimate_tir_flops

    try:
        return float(estimate_tir_flops(tvm.IRModule({"main": func})))
    except Exception:  # noqa: BLE001 - some opaque kernels (e.g. take) have no estimate
        return 0.0


def _bytes(func: tvm.tirx.PrimFunc) -> float:
    total = 0.0
    for p in func.params:
        shape = getattr(p, "shape", None)
        if shape is not None and all(isinstance(d, tvm.tirx.IntImm) for d in shape):
            total += math.prod(int(d) for d in shape) * tvm.DataType(str(p.dtype)).bits / 8
    return total


def _scaling(func: tvm.tirx.PrimFunc, instance: tvm.tirx.PrimFunc, at: Mapping[str, int]) -> dict:
    """How a symbolic kernel's FLOPs and argument bytes grow with each served dimension: the exponent
    ``log2(cost at twice the size / cost at the size)``, for a per-length profile's rates.  A kernel's FLOPs
    are mostly one product of its extents (exponent 1 for a projection's rows, 2 for attention's scores); a
    fused epilogue of lower degree and the bytes (weights and activations) make it the local growth at the
    representative size: ``scores V`` plus a residual add, 2 * n^2 * 32 + 32 n FLOPs, grows as n^1.99 at 40
    and is priced 4% low at 8."""
    out = {}
    flops, nbytes = _flops(instance), _bytes(instance)
    for name, size in at.items():
        twice = specialize(func, {**at, name: 2 * size})
        if twice.same_as(func) or flops <= 0:
            continue
        f2, b2 = _flops(twice), _bytes(twice)
        if f2 > 0 and (f2 != flops or b2 != nbytes):
            out[name] = (round(math.log2(f2 / flops), 3), round(math.log2(b2 / nbytes), 3) if nbytes and b2 else 0.0)
    return out


def list_tasks(fused: tvm.IRModule, at: Mapping[str, int] | None = None) -> list[FusedTask]:
    """Distinct fused kernels with weights; structurally equal PrimFuncs are merged into one task.  ``at``:
    the representative sizes of a build serving a range (:mod:`pipeline.symbolic`): a kernel with a symbolic
    extent is tuned and priced as its instance at them (its ``task``), and built symbolic (its ``func``)."""
    by_hash: dict[int, FusedTask] = {}
    tasks: list[FusedTask] = []
    for gv, shapes, dtype in call_sites(fused, at):
        func = fused[gv]
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        key = tvm_ffi.structural_hash(func)
        task = by_hash.get(key)
        if task is not None and tvm_ffi.structural_equal(task.func, func):
            task.weight += 1
            if gv.name_hint not in task.names:
                task.names.append(gv.name_hint)
            continue
        instance = specialize(func, at) if at else func
        symbolic = not instance.same_as(func)
        kt = templates.task_for(gv.name_hint, instance)
        if symbolic and kt is not None:
            kt = replace(kt, served=frozenset(symbolic_axes(replace(kt, func=func))))
        kind = getattr(kt, "kind", None) or "other"
        flops = float(getattr(kt, "flops", 0) or 0) or _flops(instance)
        task = FusedTask(index=len(tasks), name=gv.name_hint, kind=kind, shapes=shapes, dtype=str(dtype), weight=1,
                         flops=flops, func=func, names=[gv.name_hint], task=kt, symbolic=symbolic,
                         scaling=_scaling(func, instance, at) if symbolic else {})
        by_hash[key] = task
        tasks.append(task)
    return tasks


def partition(mod: tvm.IRModule, at: Mapping[str, int] | None = None, known: dict | None = None) -> Partition:
    """Fuse ``mod`` and list its tasks (``at``: :func:`list_tasks`; ``known``: :func:`fuse`)."""
    fused, sites = fuse(mod, known)
    return Partition(fused, list_tasks(fused, at), sites=sites)


def select_tasks(tasks: list[FusedTask], selector: str | None) -> list[FusedTask]:
    """Tasks picked by ``--kernels``: indices (``0,3``), op kinds (``matmul``) or name globs (``fused_*``).

    Without a selector every task a kernel template covers is picked (the others have no search space).
    """
    if not selector:
        return [t for t in tasks if t.task is not None]
    picked: dict[int, FusedTask] = {}
    for part in (p.strip() for p in selector.split(",")):
        if not part:
            continue
        if part.isdigit():
            idx = int(part)
            if idx >= len(tasks):
                raise UserError(f"--kernels {part}: there are only {len(tasks)} tasks (0..{len(tasks) - 1}); "
                                "list them with `tune-kernels MODEL --list`")
            hits = [tasks[idx]]
        elif part in KINDS:  # an op kind selects its layout variants too (conv2d: conv2d_nchwc)
            hits = [t for t in tasks if t.kind == part or base_kind(t.kind) == part]
        else:
            hits = [t for t in tasks if any(fnmatch.fnmatchcase(n, part) for n in t.names)]
            if not hits:
                raise UserError(f"--kernels {part!r} matches no task: use indices, an op kind "
                                f"({', '.join(KINDS)}) or a name glob; list tasks with `tune-kernels MODEL --list`")
        for t in hits:
            picked[t.index] = t
    return [picked[i] for i in sorted(picked)]


LIST_LEGEND = (
    "calls: times one inference runs the kernel; MFLOP: per call; tunable: a template covers it "
    "(optimize-model --kernels IDX,KIND,GLOB picks tasks)\n"
    "conv: logical NCHW data * OIHW weights (pad top,left,bottom,right when not one number) -> output, then the "
    "layout the kernel reads -> writes (NCHW16c: blocks of 16 channels, NCHW: unblocked); other kernels: "
    "argument shapes -> output shape")


def format_tasks(tasks: list[FusedTask]) -> str:
    """The ``--list`` table: index, kind, calls, MFLOP per call, tunable, what the kernel computes (in the
    operator's own terms, :func:`kerneltune.describe.describe`, or its argument shapes) and its name; then
    :data:`LIST_LEGEND`."""
    lines = [f"{'idx':>3}  {'kind':<12} {'calls':>5} {'MFLOP':>10}  {'tunable':<7}  what it computes  [kernel name]"]
    for t in tasks:
        if t.task is not None:
            what = describe(t.task)
        else:
            dims = ["x".join(map(str, s)) or "scalar" for s in t.shapes]
            what = f"{' '.join(dims[:-1])} -> {dims[-1]}"
        lines.append(f"{t.index:>3}  {t.kind:<12} {t.weight:>5} {t.flops / 1e6:>10.3f}  "
                     f"{'yes' if t.task is not None else 'no':<7}  {what}  [{t.name}]")
    return "\n".join(lines + [LIST_LEGEND])
