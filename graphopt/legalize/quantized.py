"""QLinearConv, QLinearMatMul and ConvInteger rewritten into DequantizeLinear -> Conv/MatMul (-> QuantizeLinear).

TVM 0.27's ONNX importer has no converter for these three operators, but it converts DequantizeLinear,
QuantizeLinear, Conv and MatMul; the pipeline's int8 pass recognizes exactly that "QDQ" form (the one
onnxruntime's own ``quantize_static`` writes) and computes it with integer kernels.  The rewrites, by the ONNX
operator specs (https://onnx.ai/onnx/operators/onnx__QLinearConv.html, ``__QLinearMatMul``, ``__ConvInteger``,
``__DequantizeLinear``, ``__QuantizeLinear``):

* ``QLinearConv(x, xs, xz, w, ws, wz, ys, yz[, B])`` -> ``DQ(x, xs, xz)``, ``DQ(w, ws, wz, axis=0)`` (``ws``
  per output channel or per tensor), ``DQ(B, xs * ws)`` (the spec: the int32 bias is quantized with scale
  ``xs * ws`` and zero point 0; that scale a float weight when both are weights), ``Conv`` with the node's
  attributes, ``QuantizeLinear(y, ys, yz)``;
* ``QLinearMatMul(a, as, az, b, bs, bz, ys, yz)`` -> ``DQ(a)`` (``as`` per row: axis ``rank - 2``), ``DQ(b)``
  (``bs`` per column: axis ``rank - 1``), ``MatMul``, ``QuantizeLinear`` (``ys`` per row of the output);
* ``ConvInteger(x, w[, xz][, wz])`` -> ``DQ(x, 1, xz)``, ``DQ(w, 1, wz, axis=0)``, a float32 ``Conv``, ``Cast``
  to int32.  Not an int32 ``Conv``: ONNX's Conv takes floats only (onnxruntime and ``onnx.checker`` refuse an
  int32 one, and the legalized graph is what optimized.onnx ships), nor a float64 one (onnxruntime has no
  kernel).  The float32 sums are exact as long as every partial sum is an integer of at most 2**24: each
  product ``(x - xz) * (w - wz)`` is, and the bound ``max |x - xz| * sum |w - wz|`` per output channel is
  computed from the weights; input channels are split into as many Convs as keep each one under it (a Slice of
  ``x``, read before its DequantizeLinear), and their int32 results added.  Exact, bit for bit, then.

Requantization (QLinear*) is the QDQ form's, in float: ``saturate(round(y / ys) + yz)``.  onnxruntime's own
QLinear kernels instead rescale the int32 sum by one float multiplier ``xs * ws / ys``; the two agree except
where the exact value sits within float rounding of a .5 boundary, where they differ by one quantization step
(measured, float path: 1 to 2 elements in 20,000-40,000 of a 32-channel conv and a K=256 matmul; 0 once
``pipeline.passes.int8`` computes the product in integers with onnxruntime's multiplier).

A per-axis scale needs DequantizeLinear's ``axis`` (opset 13); in older opsets the same arithmetic is written as
``(Cast(x) - zero point) * scale`` with the parameters reshaped to broadcast along the axis, folded into one
float weight for a constant ``w`` (and the other operand dequantized the same way: :func:`_weight_is_float`).
"""
from __future__ import annotations

import math

import numpy as np

from graphopt.errors import UserError
from graphopt.ir import Node
from graphopt.legalize.builder import Builder
from graphopt.legalize.registry import register

FLOAT = "float32"
# float32 holds every integer of magnitude at most 2**24 exactly.
EXACT_FLOAT32 = 2 ** 24
_RANGE = {"uint8": (0, 255), "int8": (-128, 127)}
_EITHER = (-128, 255)  # the widest a value of either type can be taken at


def _input(node: Node, k: int) -> str:
    """The node's k-th input name, "" when absent (omitted or past the end)."""
    return node.inputs[k] if k < len(node.inputs) else ""


def _fail(node: Node, what: str) -> UserError:
    return UserError(f"{node.op_type} node {node.name!r}: {what}")


def _size(b: Builder, node: Node, name: str) -> int:
    shape = b.graph.shape(name)
    if shape is None or not all(isinstance(d, int) for d in shape):
        raise _fail(node, f"{name!r} has unknown shape {shape}; pass --input-shape for the model inputs")
    return math.prod(shape)


def _rank(b: Builder, node: Node, name: str) -> int:
    shape = b.graph.shape(name)
    if shape is None:
        raise _fail(node, f"{name!r} has unknown rank; pass --input-shape for the model inputs")
    return len(shape)


def _scalar(b: Builder, name: str) -> str:
    """A one-element scale or zero point as a scalar: opsets 10-12 and TVM's per-tensor path want rank 0."""
    return b.reshape(name, []) if name and b.shape(name) != () else name


def _float32(b: Builder, scale: str) -> str:
    """A scale as float32 (a float16 one, which QLinearMatMul takes from opset 21, widened exactly): the
    products and sums are computed in float32 whatever the scales' type, as close to the spec's integer sum
    as float gets."""
    return b.cast(scale, FLOAT)


def dequantize(b: Builder, node: Node, x: str, scale: str, zero: str, axis: int | None,
               elementwise: bool = False) -> str:
    """``(x - zero) * scale`` in float32 (DequantizeLinear); ``axis`` None: the scale must be per tensor.

    A DequantizeLinear node where one can say it; else, and with ``elementwise`` (:func:`_weight_is_float`),
    the same arithmetic as Cast, Sub and Mul, the parameters reshaped to broadcast along ``axis`` (folded into
    a float weight for a weight ``x``): exact but for the product's one rounding, as DequantizeLinear."""
    per_tensor = _size(b, node, scale) == 1
    if not per_tensor and axis is None:
        raise _fail(node, f"scale {scale!r} has {_size(b, node, scale)} elements where the operator takes one "
                          "(per-tensor quantization); requantize the model with a per-tensor scale")
    scale = _float32(b, scale)
    if per_tensor and not elementwise:
        ins = [x, _scalar(b, scale)] + ([_scalar(b, zero)] if zero else [])
        return b.op("DequantizeLinear", ins, b.shape(x), FLOAT)
    if b.opset >= 13 and not elementwise:  # DequantizeLinear takes ``axis`` from opset 13 on
        return b.op("DequantizeLinear", [x, scale] + ([zero] if zero else []), b.shape(x), FLOAT, axis=axis)
    along = [1] * len(b.shape(x))
    if not per_tensor:
        along[axis] = _size(b, node, scale)  # type: ignore[index]
    xf = b.cast(x, FLOAT)
    if zero:
        xf = b.binary("Sub", xf, b.reshape(b.cast(zero, FLOAT), along))
    return b.mul(xf, b.reshape(scale, along))


def _weight_is_float(b: Builder, node: Node, w_scale: str) -> bool:
    """A per-axis weight scale before opset 13: the weight becomes a float weight (DequantizeLinear has no
    ``axis`` yet), and the other operand is then dequantized elementwise too.  Why: onnxruntime's optimizer
    re-quantizes the float weight of a ``DequantizeLinear -> Conv/MatMul -> QuantizeLinear`` (its
    WeightBiasQuantization, even at the basic level; it also writes a Round, which opset 10 lacks, so the
    session fails), and an elementwise dequantization is not that pattern."""
    return _size(b, node, w_scale) > 1 and b.opset < 13


def quantize(b: Builder, node: Node, y: str, scale: str, zero: str, axis: int | None) -> str:
    """QuantizeLinear(y, scale, zero): ``saturate(round(y / scale) + zero)`` in the zero point's type."""
    dtype = b.dtype(zero) if zero else "uint8"
    scale = _float32(b, scale)
    if _size(b, node, scale) == 1:
        ins = [y, _scalar(b, scale)] + ([_scalar(b, zero)] if zero else [])
        return b.op("QuantizeLinear", ins, b.shape(y), dtype)
    if axis is None:
        raise _fail(node, f"output scale {scale!r} has {_size(b, node, scale)} elements where the operator takes "
                          "one (per-tensor quantization); requantize the model with a per-tensor scale")
    if b.opset < 13:
        raise _fail(node, f"output scale {scale!r} is per axis, which QuantizeLinear takes from opset 13 on; "
                          "re-export the model at opset 13 or newer")
    return b.op("QuantizeLinear", [y, scale] + ([zero] if zero else []), b.shape(y), dtype, axis=axis)


def _bias(b: Builder, node: Node, bias: str, x_scale: str, w_scale: str) -> str:
    """QLinearConv's int32 bias dequantized: its scale is ``x_scale * w_scale`` and its zero point 0 (spec).

    ``DequantizeLinear(B, xs * ws)``, the form ``quantize_static`` writes, so that the integer pass adds ``B`` to
    the int32 sum as onnxruntime's QLinearConv does; the scale is a float weight when both scales are weights
    (the Builder's helpers fold).  A per-channel scale before opset 13 (no ``axis``): ``Cast(B) * scale``."""
    per_tensor = _size(b, node, w_scale) == 1
    x_scale, w_scale = _float32(b, x_scale), _float32(b, w_scale)
    scale = b.mul(_scalar(b, x_scale), _scalar(b, w_scale) if per_tensor else w_scale)
    if per_tensor:
        return b.op("DequantizeLinear", [bias, scale], b.shape(bias), FLOAT)
    if b.opset >= 13:
        return b.op("DequantizeLinear", [bias, scale], b.shape(bias), FLOAT, axis=0)
    return b.mul(b.cast(bias, FLOAT), scale)


@register("QLinearConv")
def lower_qlinear_conv(node: Node, b: Builder) -> dict[str, str]:
    x, xs, xz, w, ws, wz, ys, yz = (_input(node, k) for k in range(8))
    bias = _input(node, 8)
    ins = [dequantize(b, node, x, xs, xz, None, _weight_is_float(b, node, ws)), dequantize(b, node, w, ws, wz, 0)]
    if bias:
        ins.append(_bias(b, node, bias, xs, ws))
    out = node.outputs[0]
    y = b.op("Conv", ins, b.shape(out), FLOAT, **node.attrs)
    return {out: quantize(b, node, y, ys, yz, None)}


@register("QLinearMatMul")
def lower_qlinear_matmul(node: Node, b: Builder) -> dict[str, str]:
    a, a_s, az, w, ws, wz, ys, yz = (_input(node, k) for k in range(8))
    out = node.outputs[0]
    ra, rw, ry = _rank(b, node, a), _rank(b, node, w), _rank(b, node, out)
    af = dequantize(b, node, a, a_s, az, ra - 2 if ra >= 2 else None, _weight_is_float(b, node, ws))  # per row
    wf = dequantize(b, node, w, ws, wz, rw - 1 if rw >= 2 else None)  # per column of b
    y = b.op("MatMul", [af, wf], b.shape(out), FLOAT)
    return {out: quantize(b, node, y, ys, yz, ry - 2 if ry >= 2 else None)}  # per row of the output


def exact_chunks(b: Builder, node: Node, x: str, w: str, xz: str, wz: str) -> list[tuple[int, int]]:
    """Ranges of w's input channels (its axis 1) whose float32 Conv sums stay exact (module docstring).

    The bound of one output channel's sum over a range is ``max |x - xz| * sum |w - wz|`` over the range; with
    a weight or zero point that is not a constant, every ``|w - wz|`` is taken at its type's widest."""
    x_lo, x_hi = _RANGE.get(b.dtype(x), _EITHER)
    xzv = b.value(xz) if xz else np.zeros((), np.int64)
    if xzv is None:
        x_max = x_hi - x_lo
    else:
        z = int(np.asarray(xzv).reshape(-1)[0])
        x_max = max(abs(x_lo - z), abs(x_hi - z))
    shape = b.shape(w)
    wv = b.value(w)
    wzv = b.value(wz) if wz else np.zeros((), np.int64)
    if wv is not None and wzv is not None:
        zero = np.asarray(wzv, np.int64).reshape(-1, *[1] * (len(shape) - 1)) if np.size(wzv) > 1 else \
            np.asarray(wzv, np.int64).reshape(())
        spread = np.abs(wv.astype(np.int64) - zero)
    else:
        w_lo, w_hi = _RANGE.get(b.dtype(w), _EITHER)
        spread = np.full(shape, w_hi - w_lo, np.int64)
    per_channel = x_max * spread.reshape(shape[0], shape[1], -1).sum(axis=2)  # [M, C/group]
    chunks, start, running = [], 0, np.zeros(shape[0], np.int64)
    for c in range(shape[1]):
        if (running + per_channel[:, c]).max() > EXACT_FLOAT32:
            if c == start:
                raise _fail(node, f"one input channel's sum can reach {int(per_channel[:, c].max())}, beyond the "
                                  "2**24 float32 computes exactly; re-export with a smaller kernel or a "
                                  "quantized Conv (QDQ form)")
            chunks.append((start, c))
            start, running = c, np.zeros(shape[0], np.int64)
        running += per_channel[:, c]
    chunks.append((start, shape[1]))
    return chunks


@register("ConvInteger")
def lower_conv_integer(node: Node, b: Builder) -> dict[str, str]:
    x, w, xz, wz = (_input(node, k) for k in range(4))
    out = node.outputs[0]
    shape = b.shape(w)
    if shape is None or not all(isinstance(d, int) for d in shape):
        raise _fail(node, f"weight {w!r} has unknown shape {shape}; it needs a static [M, C/group, k...] shape")
    chunks = exact_chunks(b, node, x, w, xz, wz)
    if len(chunks) > 1 and int(node.attr("group", 1)) != 1:
        raise _fail(node, "its grouped sums can exceed the 2**24 float32 computes exactly, and a grouped Conv "
                          "cannot be split by input channel here; re-export it as a quantized Conv (QDQ form)")
    one = b.const(np.float32(1.0), hint="unit_scale")
    w_scale = one if not wz or _size(b, node, wz) == 1 else b.const(np.ones(_size(b, node, wz), np.float32),
                                                                     hint="unit_scale")
    total = None
    for c0, c1 in chunks:
        xc = x if len(chunks) == 1 else b.slice(x, 1, c0, c1)
        wc = w if len(chunks) == 1 else b.slice(w, 1, c0, c1)
        conv = b.op("Conv", [dequantize(b, node, xc, one, xz, None), dequantize(b, node, wc, w_scale, wz, 0)],
                    b.shape(out), FLOAT, **node.attrs)
        # through int64: TVM converts a float -> int32 Cast with 32-bit wrap-around (an int64 floor_mod), which
        # took LLVM 3.8 s to compile for one 4-channel conv, against 0.2 s this way; both casts are exact here.
        part = b.cast(b.cast(conv, "int64"), "int32")
        total = part if total is None else b.add(total, part)
    assert total is not None
    return {out: total}
