"""Convolutions in the blocked NCHW[x]c layout (NeoCPU), as TE computes, Relax legalizations and tuning tasks.

Why a blocked layout: in plain NCHW a conv's inner loop broadcasts one weight and streams a row of one input
channel, and the output-channel dimension -- the one every input value is reused across -- is a whole plane
apart in memory.  NCHW[x]c keeps ``x`` channels of one pixel contiguous, so the kernel reads one vector of
output-channel weights and broadcasts one input value per FMA, with a register tile over output width
(Liu et al., "Optimizing CNN Model Inference on CPUs", USENIX ATC'19, https://arxiv.org/abs/1809.02697).

Layouts (``a`` = input channel block, ``d`` = output channel block; both chosen by the graph, see
``ConvSpec``):

* data ``[N, C/a, H, W, a]`` (``NCHW{a}c``), output ``[N, F/d, OH, OW, d]`` (``NCHW{d}c``);
* weights stay logical ``[F, C/groups, KH, KW]`` (``OIHW``) in the graph: they are constants, and the
  schedule template (:mod:`kerneltune.templates.cpu_nchwc`) packs them into the ``OIHW[ic_bn]i[oc_bn]o``
  panels its loop order reads, once, at build time (the layout-rewrite mechanism of :mod:`kerneltune.prepack`),
  so ``ic_bn``/``oc_bn`` are tuning knobs rather than graph decisions.

Two computes:

* :func:`conv2d_nchwc`: dense and grouped convolution, any stride / padding / dilation.  Groups must be
  *aligned* with the blocks (``a`` divides ``C/groups`` and ``d`` divides ``F/groups``), so one output
  block reads whole input blocks of one group; ResNeXt's 4-channel groups are first merged into wider
  block-diagonal groups (:func:`merge_groups`, exact: the added weights are zeros).
* :func:`depthwise_conv2d_nchwc`: ``groups == C == F``, ``a == d``; the channel lanes are independent.

Channel counts need not be multiples of the blocks: the blocked tensors are padded to whole blocks
(``ceil(C/a)`` blocks).  The reduction reads padded input lanes but their weights are zero (reads beyond
``C`` are masked), so only finite values are required there; padded output lanes hold the epilogue of 0.

Each compute tags its reduction block with :data:`ANCHOR_ATTR` (the :class:`ConvSpec` as JSON), which is how
:func:`classify` recognises the kernel after FuseOps/FuseTIR have added its epilogue.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from functools import reduce
from typing import Callable

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, te, tirx
from tvm.relax.transform.legalize_ops.nn import _nn_conv2d

from ..task import Axis, Task, _epilogue_names, _int, _io_specs, layout_free_params, root_blocks
from .cpu import _largest_divisor_at_most

# the annotation key the computes tag their anchor with: part of every task key (records), so it keeps
# the name of this module's former home (kerneltune/conv_nchwc.py)
ANCHOR_ATTR = "kerneltune.conv_nchwc"
KIND = "conv2d_nchwc"

_BLOCKED = re.compile(r"^NCHW(\d+)c$")


def layout_block(layout: str) -> int | None:
    """``"NCHW16c"`` -> 16, ``"NCHW"`` -> None (anything else: ValueError)."""
    if layout == "NCHW":
        return None
    m = _BLOCKED.match(layout)
    if not m:
        raise ValueError(f"unsupported conv layout {layout!r}: NCHW or NCHW<x>c expected")
    return int(m.group(1))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ConvSpec:
    """Everything that defines one NCHWc convolution (its logical NCHW/OIHW parameters plus the blocks)."""

    n: int
    c: int
    h: int
    w: int
    f: int
    kh: int
    kw: int
    stride: tuple[int, int] = (1, 1)
    pad: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, left, bottom, right
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    ic_block: int = 16  # a: channels per block of the data
    oc_block: int = 16  # d: channels per block of the output
    dtype: str = "float32"

    @property
    def depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.c == self.f

    @property
    def cg(self) -> int:
        return self.c // self.groups

    @property
    def fg(self) -> int:
        return self.f // self.groups

    @property
    def out_h(self) -> int:
        return (self.h + self.pad[0] + self.pad[2] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1

    @property
    def out_w(self) -> int:
        return (self.w + self.pad[1] + self.pad[3] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1

    @property
    def data_shape(self) -> tuple[int, ...]:
        return (self.n, _ceil(self.c, self.ic_block), self.h, self.w, self.ic_block)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.f, self.cg, self.kh, self.kw)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.n, _ceil(self.f, self.oc_block), self.out_h, self.out_w, self.oc_block)

    @property
    def flops(self) -> int:
        """Useful FLOPs (2 per multiply-add of the logical convolution)."""
        return 2 * self.n * self.f * self.out_h * self.out_w * self.cg * self.kh * self.kw

    def check(self) -> None:
        """ValueError for a spec the computes do not implement (see the module docstring)."""
        if min(self.n, self.c, self.h, self.w, self.f, self.kh, self.kw, self.groups) <= 0:
            raise ValueError(f"non-positive size in {self}")
        if self.c % self.groups or self.f % self.groups:
            raise ValueError(f"groups={self.groups} must divide C={self.c} and F={self.f}")
        if self.out_h <= 0 or self.out_w <= 0:
            raise ValueError(f"kernel {self.kh}x{self.kw} does not fit the padded input {self.h}x{self.w}")
        if self.depthwise:
            if self.ic_block != self.oc_block:
                raise ValueError("depthwise NCHWc needs the same input and output block")
        elif self.groups > 1 and (self.cg % self.ic_block or self.fg % self.oc_block):
            raise ValueError(f"grouped conv with {self.cg}->{self.fg} channels per group is not aligned with "
                             f"blocks {self.ic_block}/{self.oc_block}: merge groups first (merge_groups)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "ConvSpec":
        d = json.loads(text)
        for k in ("stride", "pad", "dilation"):
            d[k] = tuple(d[k])
        return ConvSpec(**d)


# ------------------------------------------------------------------------------------------------ computes

# Output widths whose register tile would be thin are computed as if wider: the widest tile of X_TILES that
# wastes the fewest columns (see compute_width).
X_TILES = range(4, 13)
# Kernels at most this wide have their taps unrolled by the template's default (cpu_nchwc: unroll_kw), and
# only those are computed at the padded width (conv2d_nchwc).
MAX_UNROLLED_TAPS = 5


def compute_width(ow: int) -> int:
    """The output width a conv is computed at.  Inception-v3's 71- and 17-wide maps (primes) left 1-column
    register tiles, 2 vector accumulators: its 80->192 3x3 conv ran at 120 GFLOP/s of 466 and the model at
    2.3x onnxruntime on an Intel Xeon.  Computed 72 (12 x 6) or 18 (9 x 2) wide, a tile holds 9-12
    columns."""
    if ow <= max(X_TILES) or _largest_divisor_at_most(ow, max(X_TILES)) >= min(X_TILES):
        return ow
    return min((-(-ow // t) * t for t in X_TILES), key=lambda p: (p, -max(t for t in X_TILES if p % t == 0)))


def _padded(data: te.Tensor, spec: ConvSpec) -> te.Tensor:
    """Zero padding of H and W as its own block (the template inlines it or keeps it as a parallel copy)."""
    top, left, bottom, right = spec.pad
    if not any(spec.pad):
        return data
    n, cb, h, w, lanes = data.shape
    shape = (n, cb, h + top + bottom, w + left + right, lanes)

    def body(i, c, y, x, j):
        inside = tirx.all(y >= top, y < h + top, x >= left, x < w + left)
        return tirx.if_then_else(inside, data[i, c, y - top, x - left, j], tirx.const(0, data.dtype))

    return te.compute(shape, body, name="pad_nchwc")


def conv2d_nchwc(data: te.Tensor, weight: te.Tensor, spec: ConvSpec) -> te.Tensor:
    """Dense or (block-aligned) grouped conv: data ``NCHW{a}c``, weight ``OIHW``, output ``NCHW{d}c``.

    Reduction axes ``rco`` (input blocks of the group), ``ry``, ``rx``, ``rci`` (lanes of one input block),
    in that order: the template's ``ic_bn`` splits ``rco``.  Input channels past ``C/groups`` (a padded
    last block) are masked out of the sum.

    A width :func:`compute_width` pads is computed whole when the kernel's taps are unrolled (at most
    :data:`MAX_UNROLLED_TAPS` wide), and cropped by a copy after the anchor (which the epilogue absorbs): the
    extra columns read the input's last column (a clamped index, hoisted out of the reduction) instead of
    being skipped by a predicate inside it, where LLVM kept the masked column's accumulators in memory
    between the unrolled taps (Intel Xeon, Inception-v3's 80->192 3x3 on 71 columns: 5.7 ms predicated, 4.7
    ms computed 72 wide).  With the tap loop kept (1x1, 1x7, 7x1) the predicate costs less than the extra
    column's FLOPs (768->192 1x1 at 17x17: 0.342 ms predicated, 0.351 computed 18 wide; 1x7: 0.513,
    0.533), so those are split as if padded by the template instead.
    """
    spec.check()
    a, d = spec.ic_block, spec.oc_block
    sh, sw = spec.stride
    dh, dw = spec.dilation
    blocks_per_group = _ceil(spec.cg, a)
    fg_blocks = max(1, spec.fg // d)  # output blocks per group (grouped convs are aligned: exact)
    padded = _padded(data, spec)
    rco = te.reduce_axis((0, blocks_per_group), name="rco")
    ry = te.reduce_axis((0, spec.kh), name="ry")
    rx = te.reduce_axis((0, spec.kw), name="rx")
    rci = te.reduce_axis((0, a), name="rci")
    masked = spec.cg % a != 0
    padded_f = spec.f % d != 0
    width = compute_width(spec.out_w) if 1 < spec.kw <= MAX_UNROLLED_TAPS else spec.out_w
    last_column = int(padded.shape[3]) - 1

    def body(n, ob, y, x, o):
        g = ob // fg_blocks if spec.groups > 1 else 0
        cin = rco * a + rci
        f = ob * d + o
        if padded_f:  # padded output lanes read filter F-1 (in bounds); their product is masked below
            f = tirx.min(f, spec.f - 1)
        column = x * sw + rx * dw
        if width != spec.out_w:  # the extra columns read the last one: cropped away after the anchor
            column = tirx.min(column, last_column)
        prod = (padded[n, g * blocks_per_group + rco, y * sh + ry * dh, column, rci].astype(spec.dtype)
                * weight[f, tirx.min(cin, spec.cg - 1) if masked else cin, ry, rx])
        # Masked with if_then_else: te.sum's ``where`` is dropped by create_prim_func (TVM 0.27).
        valid = [c for c, on in ((cin < spec.cg, masked), (ob * d + o < spec.f, padded_f)) if on]
        if valid:
            prod = tirx.if_then_else(tirx.all(*valid), prod, tirx.const(0, spec.dtype))
        return te.sum(prod, axis=[rco, ry, rx, rci])

    shape = spec.out_shape[:3] + (width,) + spec.out_shape[4:]
    out = te.compute(shape, body, name="conv2d_nchwc", attrs={ANCHOR_ATTR: spec.to_json()})
    if width == spec.out_w:
        return out
    return te.compute(spec.out_shape, lambda n, ob, y, x, o: out[n, ob, y, x, o], name="conv2d_nchwc_crop")


def depthwise_conv2d_nchwc(data: te.Tensor, weight: te.Tensor, spec: ConvSpec) -> te.Tensor:
    """Depthwise conv (``groups == C == F``): output lane ``c`` of block ``cb`` reads only input lane ``c``."""
    spec.check()
    d = spec.oc_block
    sh, sw = spec.stride
    dh, dw = spec.dilation
    padded = _padded(data, spec)
    ry = te.reduce_axis((0, spec.kh), name="ry")
    rx = te.reduce_axis((0, spec.kw), name="rx")
    padded_c = spec.c % d != 0

    def body(n, cb, y, x, c):
        ch = cb * d + c
        prod = (padded[n, cb, y * sh + ry * dh, x * sw + rx * dw, c]
                * weight[tirx.min(ch, spec.c - 1) if padded_c else ch, 0, ry, rx])
        if padded_c:
            prod = tirx.if_then_else(ch < spec.c, prod, tirx.const(0, spec.dtype))
        return te.sum(prod, axis=[ry, rx])

    return te.compute(spec.out_shape, body, name="conv2d_nchwc", attrs={ANCHOR_ATTR: spec.to_json()})


def compute(data: te.Tensor, weight: te.Tensor, spec: ConvSpec) -> te.Tensor:
    return depthwise_conv2d_nchwc(data, weight, spec) if spec.depthwise else conv2d_nchwc(data, weight, spec)


# ----------------------------------------------------------------------------------------- graph helpers

def merge_groups(weight: np.ndarray, groups: int, factor: int) -> np.ndarray:
    """Weights of the same convolution with ``groups // factor`` groups: each new group holds ``factor``
    old ones and the weights between different old groups are zero (block-diagonal), so the result is
    exactly the grouped convolution.  Costs ``factor``x the FLOPs; buys groups wide enough to fill a
    block of vector lanes (ResNeXt-50's 4-channel groups in 8- or 16-channel blocks)."""
    f, cg, kh, kw = weight.shape
    if groups % factor or f % groups:
        raise ValueError(f"cannot merge {groups} groups by {factor}")
    fg = f // groups
    out = np.zeros((f, cg * factor, kh, kw), weight.dtype)
    for fo in range(f):
        slot = (fo // fg) % factor  # position of this filter's old group inside its new group
        out[fo, slot * cg:(slot + 1) * cg] = weight[fo]
    return out


def merge_factor(c: int, f: int, groups: int, ic_block: int, oc_block: int) -> int | None:
    """Smallest factor k dividing ``groups`` with ``k*C/groups`` a multiple of ``ic_block`` and ``k*F/groups``
    a multiple of ``oc_block`` (1 when already aligned); None when no merge aligns the groups."""
    cg, fg = c // groups, f // groups
    for k in range(1, groups + 1):
        if groups % k == 0 and (k * cg) % ic_block == 0 and (k * fg) % oc_block == 0:
            return k
    return None


def legalize(bb, call) -> relax.Expr:
    """Lower a Relax ``nn.conv2d`` whose data/output layouts are ``NCHW<x>c`` and kernel layout ``OIHW`` to
    our compute (LegalizeOps has no lowering for blocked convs).  Usable in ``customize_legalize_map``."""
    spec = spec_of_call(call)
    return bb.call_te(lambda data, weight: compute(data, weight, spec), call.args[0], call.args[1],
                      primfunc_name_hint="conv2d_nchwc")


def spec_of_call(call) -> ConvSpec:
    """The :class:`ConvSpec` of a blocked Relax ``nn.conv2d`` call (ValueError if we do not implement it)."""
    attrs = call.attrs
    a, d = layout_block(str(attrs.data_layout)), layout_block(str(attrs.out_layout))
    if a is None or d is None or str(attrs.kernel_layout) != "OIHW":
        raise ValueError(f"conv2d layouts {attrs.data_layout}/{attrs.kernel_layout}/{attrs.out_layout}: "
                         "NCHW<x>c / OIHW / NCHW<y>c expected")
    if attrs.out_dtype and str(attrs.out_dtype) not in ("", "void", str(call.args[0].ty.dtype)):
        raise ValueError(f"conv2d out_dtype {attrs.out_dtype} differs from the input dtype")
    ds = [int(x) for x in call.args[0].ty.shape]
    ws = [int(x) for x in call.args[1].ty.shape]
    pad = [int(p) for p in attrs.padding]
    if len(pad) == 2:
        pad = pad * 2
    groups = int(attrs.groups)
    spec = ConvSpec(n=ds[0], c=ws[1] * groups, h=ds[2], w=ds[3], f=ws[0], kh=ws[2], kw=ws[3],
                    stride=tuple(int(s) for s in attrs.strides), pad=tuple(pad),
                    dilation=tuple(int(s) for s in attrs.dilation), groups=groups, ic_block=a, oc_block=d,
                    dtype=str(call.args[0].ty.dtype))
    if ds[1] != _ceil(spec.c, a) or ds[4] != a:
        raise ValueError(f"data shape {ds} does not match layout NCHW{a}c with {spec.c} channels")
    spec.check()
    return spec


# ------------------------------------------------------------------------------------------------- tasks

def anchor_spec(block) -> ConvSpec | None:
    """The spec a block carries if it is one of our conv anchors."""
    ann = block.annotations
    if ANCHOR_ATTR not in ann:
        return None
    return ConvSpec.from_json(str(ann[ANCHOR_ATTR]))


def _roles(spec: ConvSpec) -> tuple[str, ...]:
    if spec.depthwise:
        return ("n", "ob", "y", "x", "o", "ry", "rx")
    return ("n", "ob", "y", "x", "o", "rco", "ry", "rx", "rci")


def classify(name: str, func: tirx.PrimFunc) -> Task | None:
    """A Task for a fused PrimFunc whose anchor is one of our NCHWc convs (found by :data:`ANCHOR_ATTR`),
    else None.  Whether the template can schedule it is :func:`kerneltune.templates.task_for`'s call."""
    try:
        blocks = root_blocks(func)
    except Exception:  # noqa: BLE001 - not a TIR body we can walk
        return None
    anchors = [(b, s) for b, s in ((b, anchor_spec(b)) for b in blocks) if s is not None]
    reductions = [b for b in blocks if any(iv.iter_type == tirx.IterVar.CommReduce for iv in b.iter_vars)]
    if len(anchors) != 1 or len(reductions) != 1:
        return None
    anchor, spec = anchors[0]
    ivs = [(iv.var.name, _int(iv.dom.extent)) for iv in anchor.iter_vars]
    roles = _roles(spec)
    if len(ivs) != len(roles):
        return None
    reduce_roles = {"rco", "ry", "rx", "rci"}
    axes = tuple(Axis(r, v, e, r in reduce_roles) for r, (v, e) in zip(roles, ivs))
    executed = 2 * reduce(lambda x, y: x * y, (e for _, e in ivs), 1)
    epi = _epilogue_names(blocks, anchor)
    ins, outs = _io_specs(func, blocks)
    dims = {"N": spec.n, "C": spec.c, "H": spec.h, "W": spec.w, "F": spec.f, "KH": spec.kh, "KW": spec.kw,
            "OH": spec.out_h, "OW": spec.out_w, "G": spec.groups, "SH": spec.stride[0], "SW": spec.stride[1],
            "DH": spec.dilation[0], "DW": spec.dilation[1], "a": spec.ic_block, "d": spec.oc_block,
            "useful_flops": spec.flops}
    shash = tvm_ffi.structural_hash(func) & 0xFFFFFFFF
    shape_part = "x".join(f"{k}{v}" for k, v in dims.items() if k != "useful_flops")
    key = f"{KIND}_{shape_part}_{spec.dtype}_{'+'.join(epi) or 'none'}_{shash:08x}"
    weights = tuple(func.params[i].name for i in layout_free_params(func))
    return Task(name=name, kind=KIND, func=func, flops=executed, key=key, anchor=anchor.name_hint, axes=axes,
                dims=dims, dtype=spec.dtype, epilogue=epi, block_names=tuple(b.name_hint for b in blocks),
                inputs=ins, outputs=outs, weights=weights)


# ------------------------------------------------------------------------------------- standalone tasks

EPILOGUES = ("none", "bias", "bn", "relu", "relu6", "silu", "hardswish", "residual", "bias_relu",
             "bn_relu_residual")


def make_relax(spec: ConvSpec, epilogue: str = "none", weight_const: np.ndarray | None = None,
               kernel: tuple[tuple[int, ...], Callable] | None = None):
    """A Relax module ``main(data, weight, [extra inputs]) -> conv + epilogue`` in the blocked layouts, the
    epilogue written with the Relax ops the ONNX importer produces (``bn``: per-channel multiply + add, as
    BatchNormalization folds to; ``relu6``: maximum/minimum as ONNX Clip imports).  ``kernel``: another
    computation of the same conv, ``(its weight's shape, emit(bb, data, weight))`` (the Winograd kernel's)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}; use one of {', '.join(EPILOGUES)}")
    dt = spec.dtype
    d = spec.oc_block
    chan = (1, _ceil(spec.f, d), 1, 1, d)
    bb = relax.BlockBuilder()
    data = relax.Var("data", relax.TensorType(spec.data_shape, dt))
    weight = relax.Var("weight", relax.TensorType(kernel[0] if kernel else spec.weight_shape, dt))
    params = [data, weight]
    extra = {}
    for part in epilogue.split("_"):
        if part in ("bias", "residual"):
            extra[part] = relax.Var(part, relax.TensorType(chan if part == "bias" else spec.out_shape, dt))
        elif part == "bn":
            extra["scale"] = relax.Var("scale", relax.TensorType(chan, dt))
            extra["shift"] = relax.Var("shift", relax.TensorType(chan, dt))
    params += list(extra.values())
    with bb.function("main", params):
        with bb.dataflow():
            if kernel:
                y = kernel[1](bb, data, weight)
            elif spec.c % spec.ic_block == 0 and spec.f % d == 0:  # what ConvertLayout emits; legalize() lowers it
                y = bb.emit(relax.op.nn.conv2d(data, weight, strides=spec.stride, padding=spec.pad,
                                               dilation=spec.dilation, groups=spec.groups,
                                               data_layout=f"NCHW{spec.ic_block}c", kernel_layout="OIHW",
                                               out_layout=f"NCHW{d}c"))
            else:  # padded blocks: Relax's conv2d cannot describe them, so the compute is called directly
                y = bb.emit(bb.call_te(lambda x, w: compute(x, w, spec), data, weight,
                                       primfunc_name_hint="conv2d_nchwc"))
            for part in ([] if epilogue == "none" else epilogue.split("_")):
                c = lambda v: relax.const(v, dt)  # noqa: E731
                if part == "bias":
                    y = bb.emit(relax.op.add(y, extra["bias"]))
                elif part == "bn":
                    y = bb.emit(relax.op.add(relax.op.multiply(y, extra["scale"]), extra["shift"]))
                elif part == "relu":
                    y = bb.emit(relax.op.nn.relu(y))
                elif part == "relu6":
                    y = bb.emit(relax.op.minimum(relax.op.maximum(y, c(0.0)), c(6.0)))
                elif part == "silu":
                    y = bb.emit(relax.op.multiply(y, relax.op.sigmoid(y)))
                elif part == "hardswish":
                    y = bb.emit(relax.op.multiply(y, relax.op.divide(relax.op.clip(relax.op.add(y, c(3.0)), 0, 6),
                                                                     c(6.0))))
                elif part == "residual":
                    y = bb.emit(relax.op.add(y, extra["residual"]))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    if weight_const is not None:
        mod = relax.transform.BindParams("main", {"weight": weight_const})(mod)
    return mod


def fuse_relax(mod) -> tvm.IRModule:
    """Our conv legalized, everything else by LegalizeOps, then fused as the pipeline fuses (FuseOps attaches
    the elementwise epilogue to the conv; FuseTIR makes one PrimFunc of it)."""
    seq = tvm.transform.Sequential([
        relax.transform.LegalizeOps(customize_legalize_map={"relax.nn.conv2d": _legalize_any}),
        relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(), relax.transform.FuseOps(),
        relax.transform.FuseTIR(), relax.transform.DeadCodeElimination(),
        relax.transform.AttachAttrLayoutFreeBuffers()])
    return seq(mod)


def _legalize_any(bb, call):
    if str(call.attrs.data_layout) == "NCHW":
        return _nn_conv2d(bb, call)
    return legalize(bb, call)


def fused_kernel(mod) -> tuple[str, tirx.PrimFunc]:
    """The one kernel a standalone module fuses into (:func:`fuse_relax`): its name and PrimFunc."""
    fused = fuse_relax(mod)
    funcs = [(gv.name_hint, f) for gv, f in fused.functions.items() if isinstance(f, tirx.PrimFunc)]
    if len(funcs) != 1:
        raise ValueError(f"expected one fused kernel, got {[n for n, _ in funcs]}")
    return funcs[0]


def make_task(spec: ConvSpec, epilogue: str = "none", name: str | None = None) -> Task:
    """A standalone NCHWc conv task shaped exactly like the pipeline's fused kernels.  The weight is a
    parameter marked layout-free (as the pipeline's constant weights are), so the template may pre-pack it."""
    spec.check()
    fname, func = fused_kernel(make_relax(spec, epilogue))
    # The standalone weight is a parameter; in a model it is a constant, which is what layout-free means.
    if not list((func.attrs or {}).get("layout_free_buffers", [])):
        func = func.with_attr("layout_free_buffers", [int(_weight_param(func, spec))])
    task = classify(name or fname, func)
    if task is None:
        raise ValueError(f"{fname} has no NCHWc conv anchor")
    return task


def _weight_param(func: tirx.PrimFunc, spec: ConvSpec) -> int:
    """Index of the OIHW weight among the PrimFunc's parameters (the one with the weight's 4-d shape)."""
    for i, p in enumerate(func.params):
        if tuple(int(s) for s in p.shape) == spec.weight_shape:
            return i
    raise ValueError("no weight parameter")


# ------------------------------------------------------------------------------------------ numpy helpers

def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """NCHW -> NCHW{block}c, zero-padding the channels to whole blocks."""
    n, c, h, w = x.shape
    cb = _ceil(c, block)
    out = np.zeros((n, cb * block, h, w), x.dtype)
    out[:, :c] = x
    return out.reshape(n, cb, block, h, w).transpose(0, 1, 3, 4, 2).copy()


def from_blocked(x: np.ndarray, channels: int) -> np.ndarray:
    """NCHW{x}c -> NCHW with the first ``channels`` channels (padding dropped)."""
    n, cb, h, w, b = x.shape
    return x.transpose(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)[:, :channels]
