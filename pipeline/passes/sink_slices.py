"""Padding slices moved down the graph: ``f(slice(y)) -> slice(f(y))`` while ``f`` treats the sliced axis
element by element.

The import pads a head conv's or a matmul's output channels to whole vectors and slices them off right after
(:mod:`pipeline.relax_import`).  Slicing there cuts the blocked layout: SqueezeNet 1.1's 1024-channel head
(1000 classes) went back to NCHW as a full 1024 x 13 x 13 layout transform right after the conv, and only then
through its bias, ReLU and global mean.  Moved past them, the slice (and the transform back to NCHW) is of the
pooled 1024 values: the model 3.84 -> 3.74 ms on a 2-core Intel Xeon (alternating blocks, one process).

Only slices that keep most of the axis (:data:`MIN_KEPT`: padding, not a split into parts) move, so the ops
they pass compute at most a few percent more; they move past:

* unary elementwise ops (activations, casts);
* elementwise binary ops whose other operand is a constant broadcast along the axis or as long as the slice
  (padded: zeros, ones for a divisor; the padded values are sliced off, so they only have to be finite);
* reductions over other axes (a global mean or max);
* a reshape that only drops or adds unit dimensions around the axis (a flatten of ``[N, C, 1, 1]``);
* a depthwise conv by a constant weight (NCHW, the channel axis sliced): it runs on the padded channels with
  zero weights there;

and a conv by a constant weight that reads the sliced channels takes the whole tensor, with zero weights on
the padded channels: the slice is gone (:func:`pipeline.relax_import._padded_conv`'s channel padding).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from pipeline.passes.relax_rewrite import rewrite_functions, static_shape

# A slice keeping at least this share of its axis is padding (1000 of 1024 classes, 2600 of 2624 gate
# columns); ShuffleNet's halves and attention's q/k/v parts are parts, and stay where they are.
MIN_KEPT = 0.9

# elementwise ops of one tensor (maximum/minimum: with a scalar constant, as a lifted Clip is)
UNARY = {"relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.sigmoid", "relax.tanh",
         "relax.exp", "relax.negative", "relax.abs", "relax.sqrt", "relax.clip", "relax.astype",
         "relax.nn.leakyrelu", "relax.maximum", "relax.minimum"}
# binary op -> the value its padded constant operand is filled with
BINARY = {"relax.add": 0.0, "relax.subtract": 0.0, "relax.multiply": 0.0, "relax.divide": 1.0}
REDUCE = {"relax.mean", "relax.sum", "relax.max", "relax.min"}


def padding_slice(call) -> tuple[relax.Expr, int, int] | None:
    """(source, axis, kept) of a ``strided_slice`` that keeps the first ``kept`` of at least
    :data:`MIN_KEPT` of one axis of ``source``, with unit strides; else None."""
    if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op) or call.op.name != "relax.strided_slice":
        return None
    src, *parts = call.args  # axes, begin, end[, strides]: tuples of integers
    shape = static_shape(src)
    try:
        axes, begin, end, *strides = ([int(v) for v in p] for p in parts)
    except (TypeError, ValueError):  # symbolic bounds
        return None
    if shape is None or len(axes) != 1 or any(s != 1 for st in strides for s in st):
        return None
    axis, begin, end = axes[0] % len(shape), begin[0], end[0]
    full = shape[axis]
    if begin != 0 or not 0 < end < full or end < MIN_KEPT * full:
        return None
    return src, axis, end


def _padded_const(const: tvm.ir.Constant, rank: int, axis: int, kept: int, full: int, fill: float):
    """``const`` (broadcast against a rank-``rank`` tensor) padded to ``full`` along ``axis``; None when it
    does not line up with the slice."""
    value = const.value.numpy()
    if value.ndim > rank:
        return None
    at = axis - (rank - value.ndim)  # the axis in the constant's own dimensions
    if at < 0 or value.shape[at] == 1:
        return const
    if value.shape[at] != kept:
        return None
    widths = [(0, 0)] * value.ndim
    widths[at] = (0, full - kept)
    return relax.const(np.pad(value, widths, constant_values=fill).astype(value.dtype))


def _reshaped(src, shape: tuple[int, ...], axis: int, kept: int, new: tuple[int, ...] | None):
    """The reshape of the unsliced ``src`` and its sliced axis, for a reshape that only drops or adds unit
    dimensions (the non-unit sizes, the sliced one among them, stay in order)."""
    if new is None or kept == 1 or any(not isinstance(d, int) for d in new):
        return None
    sliced = [kept if i == axis else d for i, d in enumerate(shape)]
    if [d for d in sliced if d != 1] != [d for d in new if d != 1]:
        return None
    rank = sum(1 for d in sliced[:axis] if d != 1)  # the sliced axis is the rank-th non-unit dimension
    out_axis = [i for i, d in enumerate(new) if d != 1][rank]
    wide = list(new)
    wide[out_axis] = shape[axis]
    return relax.op.reshape(src, wide), out_axis


@mutator
class _SinkSlices(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not call.args or not isinstance(call.args[0], relax.Var):
            return call
        name = call.op.name
        first = self.lookup_binding(call.args[0])
        found = padding_slice(first) if first is not None else None
        if found is None:
            return call
        src, axis, kept = found
        shape = static_shape(src)
        moved = self._moved(call, name, src, axis, kept, shape)
        if moved is None:
            return call
        out, out_axis = moved
        if out_axis is None:  # the slice was absorbed (a conv reading the padded channels)
            return out
        y = self.builder_.emit(out)
        return relax.op.strided_slice(y, axes=[out_axis], begin=[0], end=[kept])

    def _moved(self, call, name, src, axis, kept, shape):
        """``call`` applied to the unsliced ``src``, and the axis of its result the slice then applies to."""
        args = list(call.args)
        if name in UNARY and all(isinstance(a, tvm.ir.Constant) and not static_shape(a) for a in args[1:]):
            return relax.Call(call.op, [src, *args[1:]], call.attrs, call.ty_args), axis
        if name in BINARY and len(args) == 2 and isinstance(args[1], tvm.ir.Constant) \
                and hasattr(getattr(args[1], "value", None), "numpy"):
            const = _padded_const(args[1], len(shape), axis, kept, shape[axis], BINARY[name])
            if const is None:
                return None
            return relax.Call(call.op, [src, const], call.attrs, call.ty_args), axis
        if name in REDUCE:
            axes = [int(x) % len(shape) for x in call.attrs.axis] if call.attrs.axis is not None else None
            if axes is None or axis in axes:
                return None
            out_axis = axis if call.attrs.keepdims else axis - sum(1 for x in axes if x < axis)
            return relax.Call(call.op, [src], call.attrs, call.ty_args), out_axis
        if name == "relax.reshape":
            target = call.args[1]
            new = tuple(int(v) for v in target.values) if isinstance(target, relax.ShapeExpr) else None
            return _reshaped(src, shape, axis, kept, new)
        if name == "relax.nn.conv2d":
            return _conv_on_padded(call, src, axis, kept, shape[axis])
        return None


def _conv_on_padded(call: relax.Call, src, axis: int, kept: int, full: int):
    """(conv, its output's sliced axis or None) of ``call`` (a conv of the first ``kept`` channels of ``src``)
    on all ``full`` channels of ``src``: a dense conv's weight gets zero input channels and its output needs
    no slice; a depthwise conv's gets zero filters, and its output is sliced as its input was."""
    a, w = call.attrs, call.args[1]
    if (axis != 1 or not isinstance(w, tvm.ir.Constant) or a.data_layout != "NCHW" or a.kernel_layout != "OIHW"
            or a.out_layout not in ("", "NCHW")):
        return None
    value = w.value.numpy()
    groups = int(a.groups)

    def conv(weight: np.ndarray, groups: int):
        return relax.op.nn.conv2d(src, relax.const(weight), a.strides, a.padding, a.dilation, groups,
                                  a.data_layout, a.kernel_layout, a.out_layout or None, a.out_dtype or None)

    if groups == 1 and value.shape[1] == kept:
        return conv(np.pad(value, ((0, 0), (0, full - kept), (0, 0), (0, 0))), 1), None
    if groups == kept and value.shape[:2] == (kept, 1):
        return conv(np.pad(value, ((0, full - kept), (0, 0), (0, 0), (0, 0))), full), 1
    return None


def sink_padding_slices(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with its padding slices moved down (module docstring); dead code removed."""
    return relax.transform.DeadCodeElimination()(rewrite_functions(mod, _SinkSlices))
