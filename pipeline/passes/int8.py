"""Quantized operators computed in integers: u8 x s8 -> s32 products, the requantization in the epilogue.

TVM's ONNX importer keeps a quantized model's meaning but not its arithmetic: QDQ (onnxruntime's
``quantize_static``) becomes ``dequantize -> float conv/matmul -> quantize``, and ``MatMulInteger``
(``quantize_dynamic``) becomes a product of int32-widened operands.  Both run as float or int32 kernels,
slower than the fp32 model.  This pass rewrites them, right after the import (before constants fold, so the
int8 weights are still int8), into what onnxruntime's own kernels compute (its QLinearConv and MLAS QGEMM):

* **the product** in integers, ``A (u8) x B (s8) -> s32``, the operand types every x86 dot-product
  instruction takes (AVX-512 VNNI ``vpdpbusd``, AVX-VNNI, and AVX2's ``vpmaddubsw``); an s8 activation is
  shifted to u8 (+128) and a u8 weight to s8 (-128), the shifts moved into the zero-point terms;
* **the zero points** as corrections outside the product: ``(A - za)(B - zb) = AB - za colsum(B)
  - zb rowsum(A) + K za zb``, where ``colsum(B)`` of a constant weight is a constant.  A conv's padding is
  the input's zero point (a padded element dequantizes to 0), padded explicitly before the product;
* **the bias** (quantize_static's int32 bias, scale ``xs * ws``) added to the accumulator in integers;
* **the requantization** ``round(acc * (xs * ws / ys)) + yz``, with the multiplier computed in float32 as
  onnxruntime computes it, so a following ``quantize`` rounds the same value onnxruntime rounds; where no
  ``quantize`` follows, ``acc * (xs * ws)`` (the dequantized product).

Everything after the product is elementwise, so Relax's fusion puts it into the product's kernel as its
epilogue; the ``dequantize`` of the next layer's input disappears, so u8 activations stay u8 between
layers.  A residual add of two products dequantizes the one computed first inside the add's kernel
(:meth:`_IntegerCompute.residual_in_consumer`), so both products write u8.  Convs run in NHWC, as
onnxruntime's do: a dense conv is a matmul of its u8 patches by the weight, read in place (an implicit
GEMM: the taps are reduction loops) where the target has a dot-product instruction, else copied first
(im2col); a depthwise conv is a vector of channels per output pixel; their results stay NHWC through
residual adds, pools and the spatial mean (each seen as an NCHW view of the flat result), so no layout copy
sits between layers.  DynamicQuantizeLinear's whole-tensor max / min reduce in
vector lanes first.

Patterns that do not fit (a weight with nonzero zero points in a conv, a per-channel activation
scale, a non-constant weight) keep the importer's form, which is correct, only slower.

Reference: ONNX operators QuantizeLinear, DequantizeLinear, MatMulInteger, QLinearConv
(https://onnx.ai/onnx/operators/); onnxruntime's quantization docs
(https://onnxruntime.ai/docs/performance/model-optimizations/quantization.html).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

from kerneltune.templates.int8_intrin import INSTRUCTIONS, MAX_DEPTH, instruction_for
from kerneltune.vector_intrinsics import lrint_i32, rounding_conversion
from pipeline.passes.provenance import tag_normalized

INT8_TYPES = ("uint8", "int8")
# the attribute of a kernel this pass scheduled itself: its name in report.json's schedules (pipeline.compile)
SCHEDULED_BY = "optimize_model.scheduled_by"
# elementwise ops :meth:`_IntegerCompute.on_flat` computes on a conv's NHWC result
ELEMENTWISE = ("relax.quantize", "relax.dequantize", "relax.add", "relax.maximum", "relax.clip")
# Relax's OpPatternKind of a product whose elementwise consumers fuse into it (kOutEWiseFusable)
OUT_ELEMWISE_FUSABLE = 4
# ... and of an elementwise op that FuseOps fuses into its consumer's kernel only, never into its producer's
# (kBroadcast: a producer's epilogue takes elementwise consumers alone)
BROADCAST = 1
# an implicit conv's filters come in whole vectors of the narrowest instruction (8 int32 lanes); others take
# the patches
IMPLICIT_COLUMNS = min(i.lanes for i in INSTRUCTIONS)


@dataclass(frozen=True)
class Lowering:
    """What the int8 kernels of the target built for can use (:func:`lowering_for`).

    ``rounding_conversion``: requantize with one rounding conversion
    (:func:`kerneltune.vector_intrinsics.rounding_conversion`: LLVM x86 targets only).
    ``implicit_conv``: dense convs read their input in place (:func:`_implicit_conv`), scheduled by the int8
    template's dot-product instruction; without one they are copied to patches and multiplied.
    ``weight_dtype``: int16 where that instruction is a 16-bit multiply-add (AVX2 and AVX-512BW without VNNI):
    the s8 weights are widened once, at build time, not in every kernel's inner loop
    (:mod:`kerneltune.templates.int8_intrin`)."""

    rounding_conversion: bool = False
    implicit_conv: bool = False
    weight_dtype: str = "int8"  # how the products' constant weights are stored: the instruction's ``weight``


def lowering_for(spec) -> Lowering:
    """The :class:`Lowering` for ``spec`` (a kerneltune ``TargetSpec``)."""
    ins = instruction_for(spec.target)
    return Lowering(rounding_conversion(spec), ins is not None, ins.weight if ins is not None else "int8")


@dataclass
class _Dequantized:
    """``dequantize(q, scale, zp, axis)``: the quantized tensor and its constant parameters."""

    q: relax.Expr
    scale: np.ndarray  # float32, scalar or per-channel along ``axis``
    zp: np.ndarray  # int32, same shape as ``scale``
    axis: int


def _op_name(e) -> str | None:
    return e.op.name if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None


def _dtype(e: relax.Expr) -> str:
    return str(getattr(e.ty, "dtype", ""))


def _shape(e: relax.Expr) -> tuple[int, ...] | None:
    shape = getattr(e.ty, "shape", None)
    try:
        return tuple(int(d) for d in shape) if shape is not None else None
    except (TypeError, ValueError):
        return None


@mutator
class _IntegerCompute(PyExprMutator):
    """Rewrites every quantized product it recognizes; see the module docstring."""

    def value(self, e: relax.Expr) -> relax.Expr:
        """What ``e`` is bound to (through variables), else ``e``."""
        while isinstance(e, relax.Var):
            bound = self.lookup_binding(e)
            if bound is None:
                return e
            e = bound
        return e

    def const(self, e: relax.Expr) -> np.ndarray | None:
        """The value of a constant, seen through variables, casts and reshapes; None when not constant."""
        e = self.value(e)
        name = _op_name(e)
        if isinstance(e, tvm.ir.Constant):
            return np.asarray(e.value.numpy())
        if name == "relax.astype":
            inner = self.const(e.args[0])
            return None if inner is None else np.asarray(inner.astype(str(e.attrs.dtype)))
        if name in ("relax.reshape", "relax.expand_dims", "relax.squeeze"):  # shape-only: the values reshaped
            inner, shape = self.const(e.args[0]), _shape(e)
            return None if inner is None or shape is None else inner.reshape(shape)
        return None

    def dequantized(self, e: relax.Expr) -> _Dequantized | None:
        """``e`` as a dequantize of an 8-bit tensor with constant scale and zero point."""
        flat, nhwc = self.conv_output(e)
        e = self.value(flat)
        if _op_name(e) != "relax.dequantize" or _dtype(e.args[0]) not in INT8_TYPES:
            return None
        scale, zp = self.const(e.args[1]), self.const(e.args[2])
        if scale is None or zp is None or scale.dtype != np.float32:
            return None
        if nhwc is not None:  # computed on a conv's flat result (on_flat): the quantized tensor as NCHW again
            if scale.size != 1:
                return None
            return _Dequantized(self.emit(self.nchw(e.args[0], nhwc)), scale, zp.astype(np.int32), 1)
        return _Dequantized(e.args[0], scale, zp.astype(np.int32), int(e.attrs.axis))

    lowering = Lowering()  # integer_compute's argument
    order: dict  # each variable this pass emitted -> its position (set by integer_compute)
    span = None  # the span of the call being rewritten: the ONNX node what it emits computes (pipeline.passes.provenance)

    def emit(self, expr: relax.Expr) -> relax.Var:
        var = self.builder_.emit(tag_normalized(self.builder_, expr, self.span))
        self.order[var] = len(self.order)
        return var

    # -- operands in the form the dot-product instructions take ---------------------------------------------

    def unsigned(self, q: relax.Expr, zp):
        """An activation as u8 with its zero point: an s8 tensor shifted by +128 (zp too)."""
        if _dtype(q) == "uint8":
            return q, zp
        shifted = self.emit(relax.op.add(relax.op.astype(q, "int32"), relax.const(128, "int32")))
        if isinstance(zp, (int, np.ndarray, np.generic)):
            shifted_zp = zp + 128
        else:  # a zero point computed at run time
            shifted_zp = self.emit(relax.op.add(zp, relax.const(128, "int32")))
        return self.emit(relax.op.astype(shifted, "uint8")), shifted_zp

    @staticmethod
    def signed_weight(w: np.ndarray, zp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A constant weight as s8 with its zero point: a u8 weight shifted by -128 (zp too)."""
        if w.dtype == np.int8:
            return w, zp.astype(np.int32)
        return (w.astype(np.int16) - 128).astype(np.int8), zp.astype(np.int32) - 128

    # -- the rewrites ---------------------------------------------------------------------------------------

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        call = super().visit_call_(call)
        self.span = call.span
        name = _op_name(call)
        out = None
        if name == "relax.nn.conv2d" and _dtype(call).startswith("float"):
            out = self.quantized_conv(call)
        elif name == "relax.matmul" and _dtype(call).startswith("float"):
            out = self.quantized_matmul(call)
        elif name == "relax.matmul" and _dtype(call) == "int32":
            out = self.integer_matmul(call)
        elif name == "relax.add":
            out = self.integer_bias(call)
        elif name == "relax.quantize":
            out = self.requantize(call)
        elif name in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.mean"):
            out = self.pool_nhwc(call)
        elif name in ("relax.max", "relax.min"):
            out = self.two_stage_extreme(call)
        if out is None and name in ELEMENTWISE:  # not a product's epilogue: still kept on a conv's NHWC result
            out = self.on_flat(call)
        return call if out is None else tag_normalized(self.builder_, out, call.span)

    def two_stage_extreme(self, call: relax.Call) -> relax.Expr | None:
        """``max(x)`` / ``min(x)`` over a whole tensor (DynamicQuantizeLinear's range, once per quantized
        matmul input) as the lane-wise extreme of 16-wide vectors, then of those 16 x rows values: TVM
        schedules a reduction to one scalar as one serial scalar loop (BERT-base, 128 x 3072 floats: 0.6 ms
        per call, 24 ms of a 60 ms model); the first stage is parallel over rows and vectorized over lanes."""
        shape = _shape(call.args[0])
        if call.attrs.axis is not None or shape is None or len(shape) < 2 or int(np.prod(shape)) < 4096 \
                or shape[-1] % 16:
            return None
        op = relax.op.max if _op_name(call) == "relax.max" else relax.op.min
        rows = int(np.prod(shape[:-1]))
        lanes = self.emit(relax.op.reshape(call.args[0], [rows, shape[-1] // 16, 16]))
        partial = self.emit(op(lanes, axis=[1]))
        return op(partial, axis=None, keepdims=bool(call.attrs.keepdims))

    def pool_nhwc(self, call: relax.Call) -> relax.Expr | None:
        """A pool or a spatial mean of a conv's NCHW view, computed in NHWC (ResNet's max pool after the stem,
        the global average pool before the classifier): no transpose of the conv's output.

        ``max_pool(dequantize(q))`` is computed as ``dequantize(max_pool(q))`` (a positive scale keeps the
        order; the padding, q's least value, never wins a window that holds an element): ResNet's stem then
        writes u8, not float, and its pool reads a quarter of the bytes; the ``quantize`` that follows with the
        same parameters folds away (:meth:`requantize`)."""
        flat, nhwc = self.conv_output(call.args[0])
        if nhwc is None:
            return None
        if _op_name(call) == "relax.mean":
            x = self.emit(relax.op.reshape(flat, list(nhwc)))
            axes = sorted(int(i) % 4 for i in call.attrs.axis) if call.attrs.axis is not None else None
            if axes != [2, 3]:
                return None
            return relax.op.mean(x, axis=[1, 2], keepdims=bool(call.attrs.keepdims)) if not call.attrs.keepdims \
                else relax.op.permute_dims(self.emit(relax.op.mean(x, axis=[1, 2], keepdims=True)), [0, 3, 1, 2])
        a = call.attrs
        if a.layout != "NCHW" or (a.out_layout or "NCHW") != "NCHW":
            return None
        is_max = _op_name(call) == "relax.nn.max_pool2d"
        d = self.dequantized(flat) if is_max else None
        if d is not None and (d.scale.size != 1 or d.zp.size != 1 or not float(d.scale.ravel()[0]) > 0):
            d = None
        x = self.emit(relax.op.reshape(flat if d is None else d.q, list(nhwc)))
        op = relax.op.nn.max_pool2d if is_max else relax.op.nn.avg_pool2d
        kwargs = dict(pool_size=a.pool_size, strides=a.strides, padding=a.padding, dilation=a.dilation,
                      ceil_mode=bool(a.ceil_mode), layout="NHWC")
        if not is_max:
            kwargs["count_include_pad"] = bool(a.count_include_pad)
        pooled = self.emit(op(x, **kwargs))
        n, oh, ow, c = _shape(pooled)
        out = self.emit(relax.op.reshape(pooled, [n * oh * ow, c]))
        if d is not None:
            out = self.emit(relax.op.dequantize(out, relax.const(d.scale.reshape(()).astype(np.float32)),
                                                relax.const(d.zp.reshape(()).astype(_dtype(d.q))), axis=1))
        return self.nchw(out, (n, oh, ow, c))

    def on_flat(self, call: relax.Call) -> relax.Expr | None:
        """An elementwise op (a residual add, its dequantize / quantize) whose tensor operands are all NCHW
        views of conv results (:meth:`nchw`) with one shape, computed on the flat NHWC tensors instead and
        viewed as NCHW again: so ResNet's residual adds read and write contiguous memory and the next conv
        reads NHWC without a transpose.  Per-channel parameters along axis 1 stay along axis 1 ([P, O])."""
        args, shape = [], None
        for arg in call.args:
            flat, nhwc = self.conv_output(arg)
            if nhwc is not None:
                if shape not in (None, nhwc):
                    return None
                shape = nhwc
                args.append(flat)
            elif len(_shape(arg) or (0,)) == 4:
                return None  # another NCHW tensor
            else:
                args.append(arg)  # a scalar or a per-channel vector (quantize's scale along axis 1)
        per_axis = call.attrs is not None and hasattr(call.attrs, "axis")
        if shape is None or (per_axis and int(call.attrs.axis) not in (1, -3)):
            return None
        if per_axis:  # quantize / dequantize: their channel axis 1 is the flat result's axis 1
            op = relax.op.quantize if _op_name(call) == "relax.quantize" else relax.op.dequantize
            flat = op(*args, axis=1, out_dtype=str(call.attrs.out_dtype))
        else:
            if _op_name(call) == "relax.add":
                args = self.residual_in_consumer(args)
            flat = relax.Call(call.op, args, call.attrs)
        return self.nchw(self.emit(flat), shape)

    def residual_in_consumer(self, args: list[relax.Expr]) -> list[relax.Expr]:
        """A residual add of two dequantized results: the operand computed first (ResNet's downsample conv)
        dequantized inside the add's kernel, from its u8.  FuseOps would put that dequantize into its
        producer's kernel (an elementwise epilogue), which then writes floats, 4x the bytes, and the add's
        kernel reads them back: ResNet-50's first downsample wrote 3.2 MB for 0.8 MB of u8.  Emitted as a
        broadcast-pattern kernel (``op_pattern`` 1), the producer's epilogue stops at its requantize and the
        dequantize fuses forward into the add's kernel, as onnxruntime's QLinearAdd reads both operands in u8."""
        parts = []
        for arg in args:
            bound = self.value(arg)
            if _op_name(bound) != "relax.dequantize" or _dtype(bound.args[0]) not in INT8_TYPES:
                return args
            scale, zp = self.const(bound.args[1]), self.const(bound.args[2])
            if scale is None or zp is None or scale.size != 1 or zp.size != 1 or not isinstance(arg, relax.Var):
                return args
            parts.append((self.order.get(arg, -1), arg, bound.args[0], np.float32(scale.ravel()[0]),
                          int(zp.ravel()[0])))
        if len(parts) != 2 or min(p[0] for p in parts) < 0:
            return args
        first = min(parts, key=lambda p: p[0])
        _, var, q, scale, zp = first
        moved = self.builder_.emit_te(_dequantized, q, float(scale), zp, primfunc_name_hint="dequantize")
        gv = self.builder_.lookup_binding(moved).args[0]
        self.builder_.update_func(gv, self.builder_.get()[gv].with_attr("op_pattern", BROADCAST))
        return [moved if a.same_as(var) else a for a in args]

    def quantized_conv(self, call: relax.Call) -> relax.Expr | None:
        """``conv2d(dequantize(x), dequantize(W))`` -> the integer product times ``xs ws``.  A dense conv
        (groups 1) becomes a matmul of the input's patches (NHWC, ``[N OH OW, KH KW C]``, u8) by the weight
        ``[KH KW C, O]``: the form the VNNI template computes (:mod:`kerneltune.templates.int8`), the patches
        read in place (:func:`_implicit_conv`) or, without a dot-product instruction, copied first as
        onnxruntime's QLinearConv does (im2col + its int8 GEMM).  The
        result goes back to NCHW after the epilogue, in u8 where a quantize follows; the next conv reads
        that u8 in NHWC without the round trip.  Grouped and dilated convs stay convs, in int32."""
        a = call.attrs
        x, w = self.dequantized(call.args[0]), self.dequantized(call.args[1])
        if (x is None or w is None or x.scale.size != 1 or a.data_layout != "NCHW" or a.kernel_layout != "OIHW"
                or a.out_layout not in ("", "NCHW") or _shape(x.q) is None):
            return None
        weight = self.const(w.q)
        out_channels = weight.shape[0] if weight is not None else 0
        if weight is None or w.scale.size not in (1, out_channels) or (w.scale.size > 1 and w.axis != 0):
            return None
        weight, wz = self.signed_weight(weight, w.zp)
        if np.any(wz != 0):
            return None  # window sums of x would be needed: keep the float form
        xq, xz = self.unsigned(x.q, int(x.zp.ravel()[0]))
        scale = (np.float32(x.scale.ravel()[0]) * np.broadcast_to(w.scale.ravel(), (out_channels,))).astype(np.float32)
        if int(a.groups) == 1 and all(int(d) == 1 for d in a.dilation):
            return self.patches_product(xq, xz, weight, scale, a)
        if int(a.groups) == out_channels == weight.shape[0] and weight.shape[1] == 1 \
                and all(int(d) == 1 for d in a.dilation) and int(a.groups) == _shape(xq)[1]:
            return self.depthwise(xq, xz, weight, scale, a)
        pad = [int(p) for p in a.padding]  # top, left, bottom, right
        if any(pad):
            xq = self.emit(relax.op.nn.pad(xq, [0, 0, 0, 0, pad[0], pad[2], pad[1], pad[3]], pad_value=float(xz)))
        acc = self.emit(relax.op.nn.conv2d(xq, relax.const(weight), strides=a.strides, padding=(0, 0, 0, 0),
                                           dilation=a.dilation, groups=int(a.groups), out_dtype="int32"))
        correction = xz * weight.astype(np.int32).reshape(out_channels, -1).sum(axis=1)
        if np.any(correction != 0):
            acc = self.emit(relax.op.subtract(acc, relax.const(correction.reshape(1, -1, 1, 1).astype(np.int32))))
        return self.scaled(acc, scale.reshape(1, -1, 1, 1))

    def patches_product(self, xq: relax.Expr, xz: int, weight: np.ndarray, scale: np.ndarray, a) -> relax.Expr:
        """A dense conv as ``patches(x) @ W'`` (see :meth:`quantized_conv`), returned as
        ``nchw(float(acc) * scale)``, the form :meth:`integer_bias` and :meth:`requantize` see through."""
        n, c, h, w = _shape(xq)
        o, _, kh, kw = weight.shape
        top, left, bottom, right = (int(p) for p in a.padding)
        sh, sw = (int(s) for s in a.strides)
        oh, ow = (h + top + bottom - kh) // sh + 1, (w + left + right - kw) // sw + 1
        # input channels padded to a multiple of 4 (the instruction's depth; an RGB stem's 3): the padded
        # weight rows are 0, so the padding value never counts
        c4 = -(-c // MAX_DEPTH) * MAX_DEPTH
        weight = np.pad(weight, ((0, 0), (0, c4 - c), (0, 0), (0, 0)))
        pads = (top, bottom, left, right)
        if self.is_nhwc_view(xq) or not (any(pads) or c4 != c):
            xt = self.nhwc(xq)
            if any(pads) or c4 != c:
                xt = self.emit(relax.op.nn.pad(xt, [0, 0, top, bottom, left, right, 0, c4 - c], pad_value=float(xz)))
        else:  # an NCHW tensor (the model's quantized input): transposed and padded in one pass
            xt = self.builder_.emit_te(_nhwc_padded, xq, pads, c4, int(xz), primfunc_name_hint="nhwc_padded")
            gv = self.value(xt).args[0]
            self.builder_.update_func(gv, _scheduled_nhwc_padded(self.builder_.get()[gv]))
        w2 = np.ascontiguousarray(weight.transpose(2, 3, 1, 0).reshape(kh * kw * c4, o))  # rows (r, s, c)
        if (kh, kw, sh, sw) == (1, 1, 1, 1):
            acc = self.integer_product(self.emit(relax.op.reshape(xt, [n * oh * ow, c4])), np.array(xz, np.int32),
                                       w2, np.zeros(1, np.int32))
        elif self.lowering.implicit_conv and o % IMPLICIT_COLUMNS == 0:
            acc = self.integer_product(xt, np.array(xz, np.int32), w2, np.zeros(1, np.int32), product=lambda x: (
                implicit_conv(self.builder_, x, w2.reshape(kh, kw, c4, o).astype(self.lowering.weight_dtype),
                              (sh, sw), oh, ow)))
        else:
            patches = self.builder_.emit_te(_patches, xt, kh, kw, sh, sw, oh, ow, primfunc_name_hint="patches")
            gv = self.value(patches).args[0]
            self.builder_.update_func(gv, _scheduled_patches(self.builder_.get()[gv]))
            flat = self.emit(relax.op.reshape(patches, [n * oh * ow, kh * kw * c4]))
            acc = self.integer_product(flat, np.array(xz, np.int32), w2, np.zeros(1, np.int32))
        return self.nchw(self.emit(self.scaled(acc, scale)), (n, oh, ow, o))

    def depthwise(self, xq: relax.Expr, xz: int, weight: np.ndarray, scale: np.ndarray, a) -> relax.Expr:
        """A depthwise conv (MobileNet's, one filter per channel) in NHWC: each output pixel's channels are
        one contiguous vector of multiply-adds over the KH x KW taps (u8 x s8 < 2^15, summed in int32).  As
        an NCHW int32 conv it ran scalar per channel (MobileNet-v2 int8 at 2.5x its fp32 build)."""
        n, c, h, w = _shape(xq)
        kh, kw = weight.shape[2:]
        top, left, bottom, right = (int(p) for p in a.padding)
        sh, sw = (int(s) for s in a.strides)
        oh, ow = (h + top + bottom - kh) // sh + 1, (w + left + right - kw) // sw + 1
        xt = self.nhwc(xq)
        taps = np.ascontiguousarray(weight[:, 0].transpose(1, 2, 0))  # [KH, KW, C]
        acc = self.builder_.emit_te(_depthwise, xt, relax.const(taps), int(xz), (top, left), (sh, sw), oh, ow,
                                    primfunc_name_hint="depthwise")
        gv = self.value(acc).args[0]
        self.builder_.update_func(gv, _scheduled_depthwise(self.builder_.get()[gv]))
        flat = self.emit(relax.op.reshape(acc, [n * oh * ow, c]))
        correction = xz * taps.astype(np.int32).sum(axis=(0, 1))
        if np.any(correction != 0):
            flat = self.emit(relax.op.subtract(flat, relax.const(correction.astype(np.int32))))
        return self.nchw(self.emit(self.scaled(flat, scale)), (n, oh, ow, c))

    def is_nhwc_view(self, xq: relax.Expr) -> bool:
        """Whether ``xq`` (NCHW) is a view of an NHWC tensor (a previous conv's output, :meth:`nchw`)."""
        inner = self.value(xq)
        return _op_name(inner) == "relax.permute_dims" and [int(i) for i in inner.attrs.axes] == [0, 3, 1, 2]

    def nhwc(self, xq: relax.Expr) -> relax.Expr:
        """``xq`` (NCHW) as NHWC: the NHWC tensor it was made from (a previous conv's output), else a transpose."""
        if self.is_nhwc_view(xq):
            return self.value(xq).args[0]
        return self.emit(relax.op.permute_dims(xq, [0, 2, 3, 1]))

    def nchw(self, flat: relax.Expr, nhwc: tuple[int, ...]) -> relax.Expr:
        """A conv's ``[N OH OW, O]`` result as NCHW."""
        return relax.op.permute_dims(self.emit(relax.op.reshape(flat, list(nhwc))), [0, 3, 1, 2])

    def conv_output(self, e: relax.Expr) -> tuple[relax.Expr, tuple[int, ...] | None]:
        """``e`` as ``nchw(flat)`` (:meth:`nchw`): (flat, its NHWC shape); else (e, None)."""
        if self.is_nhwc_view(e):
            reshaped = self.value(self.value(e).args[0])
            if _op_name(reshaped) == "relax.reshape" and len(_shape(reshaped) or ()) == 4:
                return reshaped.args[0], _shape(reshaped)
        return e, None

    def quantized_matmul(self, call: relax.Call) -> relax.Expr | None:
        """``matmul(dequantize(x), W')`` with ``W'`` a dequantized constant (or its transpose, a Gemm's
        ``transB``) -> the integer product times ``xs ws``."""
        x = self.dequantized(call.args[0])
        b = self.value(call.args[1])
        transposed = _op_name(b) == "relax.permute_dims"
        if transposed:
            axes = [int(i) for i in b.attrs.axes] if b.attrs.axes is not None else [1, 0]
            if axes != [1, 0]:
                return None
        w = self.dequantized(b.args[0] if transposed else b)
        if x is None or w is None or x.scale.size != 1:
            return None
        weight = self.const(w.q)
        if weight is None or weight.ndim != 2:
            return None
        # per-column parameters: along N, axis 1 of [K, N] (or axis 0 of the transposed [N, K])
        column_axis = 0 if transposed else 1
        if w.scale.size > 1 and w.axis != column_axis:
            return None
        if transposed:
            weight = np.ascontiguousarray(weight.T)
        n = weight.shape[1]
        if w.scale.size not in (1, n) or w.zp.size not in (1, n):
            return None
        weight, wz = self.signed_weight(weight, w.zp.ravel())
        acc = self.integer_product(x.q, relax.const(int(x.zp.ravel()[0]), "int32"), weight, wz.ravel())
        scale = (np.float32(x.scale.ravel()[0]) * np.broadcast_to(w.scale.ravel(), (n,))).astype(np.float32)
        return self.scaled(acc, scale)

    def integer_matmul(self, call: relax.Call) -> relax.Expr | None:
        """The importer's ``MatMulInteger``: ``matmul(astype(A, i32) - za, astype(B, i32) - zb)`` with B a
        constant -> the u8 x s8 product and its zero-point terms."""
        a, az = self._widened(call.args[0])
        az_shape = _shape(az) if az is not None else ()
        if a is None or az_shape is None or int(np.prod(az_shape)) != 1:
            return None  # a per-row zero point of A: keep the int32 product
        b, bz = self._widened(call.args[1])
        if b is not None:
            weight = self.const(b)
            wz = np.zeros(1, np.int32) if bz is None else self.const(bz)
        else:  # the importer folded ``astype(B) - zb`` of constants into one int32 constant
            weight, wz = self._int8_span(self.const(call.args[1]))
        if weight is None or wz is None or weight.ndim != 2:
            return None
        wz = wz.astype(np.int32).ravel()
        if wz.size not in (1, weight.shape[1]):
            return None
        weight, wz = self.signed_weight(weight, wz)
        return self.integer_product(a, az, weight, wz)

    @staticmethod
    def _int8_span(values: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """A 2-D integer constant ``[K, N]`` whose columns each span at most 256 values, as ``s8 - zp`` with a
        zero point per column (``values = s8 - zp``): ``astype(B) - zb`` folded by the importer."""
        if values is None or values.ndim != 2 or not np.issubdtype(values.dtype, np.integer) or values.size == 0:
            return None, None
        low, high = values.min(axis=0).astype(np.int64), values.max(axis=0).astype(np.int64)
        if np.any(high - low > 255):
            return None, None
        offset = low + 128
        return (values.astype(np.int64) - offset).astype(np.int8), (-offset).astype(np.int32)

    def _widened(self, e: relax.Expr) -> tuple[relax.Expr | None, relax.Expr | None]:
        """``astype(q, int32) [- zp]`` with ``q`` 8-bit and ``zp`` one value or one per column -> (q, zp as an
        int32 expression or None)."""
        e = self.value(e)
        zp = None
        if _op_name(e) == "relax.subtract":
            e, zp = self.value(e.args[0]), e.args[1]
        if _op_name(e) != "relax.astype" or _dtype(e.args[0]) not in INT8_TYPES:
            return None, None
        if zp is not None:
            shape, columns = _shape(zp), (_shape(e) or (0,))[-1]
            size = int(np.prod(shape)) if shape is not None else -1
            if _dtype(zp) != "int32" or size not in (1, columns) or (size > 1 and shape[-1] != columns):
                return None, None
        return e.args[0], zp

    def integer_product(self, a: relax.Expr, az: relax.Expr | None, weight: np.ndarray, wz: np.ndarray,
                        product: Callable[[relax.Expr], relax.Expr] | None = None) -> relax.Expr:
        """``(A - az)(W - wz)`` over the last axis of ``A`` (u8 or s8, any leading axes), W an s8 constant
        ``[K, N]`` and ``wz`` its zero point (scalar or per column): the u8 x s8 product plus the zero-point
        terms, in int32.  ``product``: the u8 x s8 accumulation of the unsigned ``a`` when it is not
        ``a @ W`` (a conv reading its padded input in place, :func:`implicit_conv`; its weight's zero point is
        0, so no row sums of ``a`` are needed)."""
        k = weight.shape[0]
        const_az = self.const(az) if az is not None else np.zeros((), np.int32)
        a, az = self.unsigned(a, const_az.astype(np.int32) if const_az is not None else az)
        if product is not None and np.any(wz != 0):
            raise ValueError("a product other than a @ W takes a weight without zero points")
        acc = product(a) if product is not None else self.emit(relax.op.matmul(
            a, relax.const(weight.astype(self.lowering.weight_dtype)), out_dtype="int32"))
        if np.any(wz != 0):
            rows = self.emit(relax.op.sum(relax.op.astype(a, "int32"), axis=[-1], keepdims=True))
            acc = self.emit(relax.op.subtract(acc, relax.op.multiply(rows, relax.const(wz.astype(np.int32)))))
        colsum = weight.astype(np.int32).sum(axis=0)
        if isinstance(az, (np.ndarray, np.generic)):  # a constant zero point: one constant vector
            term = int(np.asarray(az).ravel()[0]) * (colsum - k * wz)
            if np.any(term != 0):
                acc = self.emit(relax.op.subtract(acc, relax.const(term.astype(np.int32))))
        else:  # a zero point computed at run time (DynamicQuantizeLinear): za (colsum - K wz)
            term = relax.op.multiply(relax.op.reshape(az, ()) if _shape(az) != () else az,
                                     relax.const((colsum - k * wz).astype(np.int32)))
            acc = self.emit(relax.op.subtract(acc, term))
        return acc

    def scaled(self, acc: relax.Expr, scale: np.ndarray) -> relax.Expr:
        """The dequantized accumulator ``float(acc) * scale``, in the form :meth:`integer_bias` and
        :meth:`requantize` recognize."""
        return relax.op.multiply(self.emit(relax.op.astype(acc, "float32")), relax.const(scale))

    def _scaled_parts(self, e: relax.Expr) -> tuple[relax.Expr, np.ndarray] | None:
        """``e`` as ``float(acc) * scale`` (what :meth:`scaled` made): (acc, scale)."""
        e = self.value(e)
        if _op_name(e) != "relax.multiply":
            return None
        cast = self.value(e.args[0])
        scale = self.const(e.args[1])
        if _op_name(cast) != "relax.astype" or _dtype(cast.args[0]) != "int32" or scale is None:
            return None
        return cast.args[0], scale

    def integer_bias(self, call: relax.Call) -> relax.Expr | None:
        """``float(acc) * s + dequantize(b_int32, s)`` -> ``float(acc + b) * s``: quantize_static's bias is
        int32 at the product's scale, added in integers as onnxruntime's QLinearConv adds it."""
        inner, nhwc = self.conv_output(call.args[0])
        parts = self._scaled_parts(inner)
        bias = self.value(call.args[1])
        reshape_to = None
        if _op_name(bias) == "relax.reshape":
            reshape_to, bias = _shape(bias), self.value(bias.args[0])
        if parts is None or _op_name(bias) != "relax.dequantize" or _dtype(bias.args[0]) != "int32":
            return None
        acc, scale = parts
        b, bs, bz = self.const(bias.args[0]), self.const(bias.args[1]), self.const(bias.args[2])
        if b is None or bs is None or bz is None or np.any(bz != 0):
            return None
        b = b.reshape(reshape_to) if reshape_to else b
        if nhwc is not None:  # a per-channel bias [1, O, 1, 1] of the NCHW result: [O] on the flat one
            if b.size not in (1, nhwc[3]) or (b.size > 1 and b.shape[1:2] != (nhwc[3],)):
                return None
            b = b.reshape(-1)
        if b.shape != np.broadcast_shapes(b.shape, scale.shape) and b.size != scale.size:
            return None
        bs = np.broadcast_to(bs.reshape(bs.shape if bs.size == 1 else b.shape), b.shape)
        if not np.allclose(bs.astype(np.float32), np.broadcast_to(scale, b.shape), rtol=1e-6, atol=0):
            return None
        total = self.emit(relax.op.add(acc, relax.const(b.astype(np.int32))))
        out = self.scaled(total, scale)
        return out if nhwc is None else self.nchw(self.emit(out), nhwc)

    def requantize(self, call: relax.Call) -> relax.Expr | None:
        """``quantize(float(acc) * s, ys, yz)`` -> ``clip(round(float(acc) * (s / ys)) + yz)``: onnxruntime's
        requantization, with its float32 multiplier."""
        inner, nhwc = self.conv_output(call.args[0])
        ys, yz = self.const(call.args[1]), self.const(call.args[2])
        out_dtype = str(call.attrs.out_dtype)
        same = self.dequantized(inner)  # quantize(dequantize(q)) with q's own parameters: q itself
        if same is not None and ys is not None and yz is not None and ys.size == 1 == yz.size == same.scale.size \
                and same.zp.size == 1 and _dtype(same.q) == out_dtype and ys.ravel()[0] == same.scale.ravel()[0] \
                and int(yz.ravel()[0]) == int(same.zp.ravel()[0]):
            return same.q if nhwc is None else self.nchw(same.q, nhwc)
        if ys is None or yz is None or ys.size != 1 or yz.size != 1 or out_dtype not in INT8_TYPES:
            return None
        parts = self._scaled_parts(inner)
        if parts is not None:
            acc, scale = parts
            multiplier = (scale / np.float32(ys.ravel()[0])).astype(np.float32)
            scaled = relax.op.multiply(self.emit(relax.op.astype(acc, "float32")), relax.const(multiplier))
        elif _dtype(inner) == "float32" and float(ys.ravel()[0]) > 0:
            # any other float (a residual add, the model's input): times the reciprocal, not divided: a vector
            # division is ~16 cycles of port 0 per 16 values (onnxruntime's QLinearAdd multiplies too); the
            # result may differ from x / ys in the last bit, so a tie can round one step the other way
            scaled = relax.op.multiply(inner, relax.const(np.float32(1.0) / np.float32(ys.ravel()[0])))
        else:
            return None
        out = self.rounded(self.emit(scaled), np.float32(yz.ravel()[0]), out_dtype)
        return out if nhwc is None else self.nchw(self.emit(out), nhwc)

    def rounded(self, scaled: relax.Expr, zp: np.float32, out_dtype: str) -> relax.Expr:
        """``out_dtype(clip(round(scaled) + zp))``, on x86 in one rounding conversion (:func:`_rounded`)."""
        info = np.iinfo(out_dtype)
        if self.lowering.rounding_conversion:  # clamp, then one rounding conversion (kerneltune.vector_intrinsics)
            return self.builder_.call_te(_rounded, scaled, float(zp), int(info.min), int(info.max), out_dtype,
                                         primfunc_name_hint="requantize")
        shifted = relax.op.add(relax.op.round(scaled), relax.const(zp))
        return relax.op.astype(relax.op.clip(shifted, int(info.min), int(info.max)), out_dtype)


def _rounded(x: te.Tensor, zp: float, lo: int, hi: int, dtype: str) -> te.Tensor:
    """``dtype(clip(round(x) + zp, lo, hi))`` as ``dtype(lrint(clip(x, lo - zp, hi - zp)) + zp)``: the same
    values (the bounds are whole numbers, so clamping before rounding changes nothing, and ``zp`` is added to
    the rounded integer: ``round(x + zp)`` would break ties the other way for an odd ``zp``), with one rounding
    conversion instead of a round, a float clamp and a truncating one."""
    def element(*i):
        clamped = tvm.tirx.max(tvm.tirx.min(x(*i), tvm.tirx.const(hi - zp, "float32")),
                               tvm.tirx.const(lo - zp, "float32"))
        return (lrint_i32(clamped) + tvm.tirx.const(int(zp), "int32")).astype(dtype)

    return te.compute(x.shape, element, name="requantize")


def _dequantized(q: te.Tensor, scale: float, zp: int) -> te.Tensor:
    """``float(q - zp) * scale``: ONNX DequantizeLinear (the difference is exact in int32)."""
    return te.compute(q.shape, lambda *i: (q(*i).astype("int32") - zp).astype("float32")
                      * tvm.tirx.const(scale, "float32"), name="dequantize")


def _patches(x: te.Tensor, kh: int, kw: int, sh: int, sw: int, oh: int, ow: int) -> te.Tensor:
    """im2col of an NHWC tensor (padded already), as ``[N, OH, OW, KH, KW, C]`` (a reshape makes it the
    ``[N OH OW, KH KW C]`` operand): element ``x[n, y sh + r, x sw + s, c]``.  Affine indices, so the inner
    ``(s, c)`` loops copy contiguous bytes; as Relax slices and a concat it was a chain of 49 selects per
    element, and with the row/column index divided back it ran scalar (ResNet's 7 x 7 stem: 5 ms)."""
    n, c = x.shape[0], x.shape[3]
    return te.compute((n, oh, ow, kh, kw, c),
                      lambda b, y, w, r, s, ch: x[b, y * sh + r, w * sw + s, ch], name="patches")


def implicit_conv(builder: relax.BlockBuilder, x: relax.Expr, weight: np.ndarray, strides: tuple[int, int],
                  oh: int, ow: int) -> relax.Var:
    """Emit :func:`_implicit_conv` of ``x`` (NHWC u8, padded) by the constant ``weight`` ``[KH, KW, C, O]`` (s8)
    as a product whose elementwise epilogue fuses into it (FuseOps' kOutEWiseFusable), as a matmul's does."""
    acc = builder.emit_te(_implicit_conv, x, relax.const(weight), strides, oh, ow, primfunc_name_hint="conv2d_nhwc")
    gv = builder.lookup_binding(acc).args[0]
    builder.update_func(gv, builder.get()[gv].with_attr("op_pattern", OUT_ELEMWISE_FUSABLE))
    return acc


def _implicit_conv(x: te.Tensor, w: te.Tensor, strides: tuple[int, int], oh: int, ow: int) -> te.Tensor:
    """A dense conv of an NHWC u8 tensor (padded already) by ``w`` ``[KH, KW, C, O]`` (s8), in int32, as
    ``[N OH OW, O]``: ``out[p, o] = sum_{r, s, c} x[n, y sh + r, x sw + s, c] w[r, s, c, o]`` with ``(n, y, x)``
    the pixel ``p``.  The patches matrix is read in place: no im2col copy (ResNet-50's int8 3x3 convs' copies
    took 0.55 ms of 9.6).  The pixels are one iterator here, not ``y`` and ``x`` fused by a
    schedule, whose bindings ``tensorize`` cannot blockize (:mod:`kerneltune.templates.int8`)."""
    n, c = x.shape[0], x.shape[3]
    kh, kw, _, o = (int(d) for d in w.shape)
    sh, sw = strides
    r, s, ch = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx"), te.reduce_axis((0, c), "rc")
    return te.compute(
        (int(n) * oh * ow, o),
        lambda p, f: te.sum(x[p // (oh * ow), p // ow % oh * sh + r, p % ow * sw + s, ch].astype("int32")
                            * w[r, s, ch, f].astype("int32"), axis=[r, s, ch]),
        name="conv2d_nhwc")


def _nhwc_padded(x: te.Tensor, pads: tuple[int, int, int, int], c4: int, value: int) -> te.Tensor:
    """An NCHW tensor as NHWC, its spatial borders (``pads``: top, bottom, left, right) and its channels up to
    ``c4`` filled with ``value`` (the zero point): the layout a network's first conv reads its input in."""
    n, c, h, w = (int(d) for d in x.shape)
    top, bottom, left, right = pads

    def element(b, y, xx, ch):
        inside = tvm.tirx.all(y >= top, y < top + h, xx >= left, xx < left + w, ch < c)
        return te.if_then_else(inside, x[b, ch, y - top, xx - left], tvm.tirx.const(value, x.dtype))

    return te.compute((n, h + top + bottom, w + left + right, c4), element, name="nhwc_padded")


def _scheduled_nhwc_padded(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """Rows over the cores; in a row, the pixels in a loop LLVM vectorizes, each pixel's channels unrolled,
    so one vector reads a run of each channel plane and the stores interleave them.  The injective rule
    vectorized the 4 channels of one pixel, each lane a load from another plane: the stem's quantize,
    transpose and pad took 0.15-0.20 ms (MobileNet-v2, ResNet-50), this 0.02 (Intel Xeon, 2 threads)."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    b, y, _, ch = sch.get_loops(sch.get_sblock("nhwc_padded"))
    sch.parallel(sch.fuse(b, y))
    sch.unroll(ch)
    return _own_schedule(sch.mod["main"], "int8 input layout")


def _depthwise(x: te.Tensor, taps: te.Tensor, xz: int, pads: tuple[int, int], strides: tuple[int, int],
               oh: int, ow: int) -> te.Tensor:
    """``out[n, y, x, c] = sum_{r, s} x[n, y sh + r - top, x sw + s - left, c] * taps[r, s, c]`` in int32
    (NHWC), the input's zero point where the window leaves the image: the padding is read, not copied."""
    (kh, kw), (top, left), (sh, sw) = (int(d) for d in taps.shape[:2]), pads, strides
    h, w = x.shape[1], x.shape[2]

    def pixel(b, y, xx, ch):
        # the taps summed as one expression (no reduction axis): a spatial block, vectorized along channels
        total = None
        for r in range(kh):
            for s in range(kw):
                iy, ix = y * sh + r - top, xx * sw + s - left
                inside = tvm.tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
                value = te.if_then_else(inside, x[b, iy, ix, ch], tvm.tirx.const(xz, x.dtype))
                term = value.astype("int32") * taps[r, s, ch].astype("int32")
                total = term if total is None else total + term
        return total

    return te.compute((x.shape[0], oh, ow, x.shape[3]), pixel, name="depthwise")


def _scheduled_depthwise(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """Output rows over the cores; for each output pixel its channels as vectors of int32 multiply-adds over
    the unrolled taps.  TVM's default rule reduced each channel's
    taps in a scalar loop (MobileNet-v2's 112 x 112 x 96 depthwise: 1.5 ms).  Opaque to fusion: the
    requantization runs as its own vectorized pass over the int32 result."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    b, y, xx, ch = sch.get_loops(sch.get_sblock("depthwise"))
    sch.parallel(sch.fuse(b, y))
    extent = int(sch.get(ch).extent)
    lanes = next((n for n in (16, 8) if extent % n == 0), 0)
    if lanes:
        _, inner = sch.split(ch, [None, lanes])
        sch.vectorize(inner)
    return _own_schedule(sch.mod["main"], "int8 depthwise")


def _own_schedule(func: tvm.tirx.PrimFunc, name: str) -> tvm.tirx.PrimFunc:
    """A kernel this pass scheduled itself: left alone by the compile's schedule sources, named ``name`` in
    report.json, and opaque to fusion (``op_pattern`` 8)."""
    return (func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)
            .with_attr(SCHEDULED_BY, name))


def _scheduled_patches(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """The gather's own schedule: rows of output pixels over the cores, and for each pixel and kernel row
    the ``KW x C`` bytes it copies as one vector: they are contiguous in the input when the stride is 1, and
    ``C``-byte runs otherwise.  TVM's default rule vectorized only ``C`` (4 bytes in an RGB stem): ResNet's
    stem gather took 1.2 ms for 2.5 MB.  Opaque to fusion (``op_pattern`` 8): fused with its producers (the
    stem's quantize, the pad) each ran once per patch element, 49 times per input element."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    b, y, w, r, s, c = sch.get_loops(sch.get_sblock("patches"))
    sch.parallel(sch.fuse(b, y))
    sch.vectorize(sch.fuse(s, c))
    return _own_schedule(sch.mod["main"], "int8 gather")


def integer_compute(mod: tvm.IRModule, lowering: Lowering = Lowering()) -> tvm.IRModule:
    """``mod`` with every recognized quantized product computed in integers (module docstring); a module
    without quantized operators comes back unchanged.  ``lowering``: what the target's kernels can use."""
    if not any(_has_quantized(f) for _, f in mod.functions_items() if isinstance(f, relax.Function)):
        return mod
    rewriter = _IntegerCompute(mod)
    rewriter.lowering = lowering
    rewriter.order = {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            new = rewriter.visit_expr(func)
            rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
    return rewriter.builder_.get()


def _has_quantized(func: relax.Function) -> bool:
    found = []

    def visit(e):
        if _op_name(e) in ("relax.dequantize", "relax.quantize") or (
                _op_name(e) == "relax.matmul" and _dtype(e) == "int32"):
            found.append(e)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)
