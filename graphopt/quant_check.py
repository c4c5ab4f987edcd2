"""The quantization parameters of a model's quantized operators, checked before any work (a step of
:func:`graphopt.validate.check_model`).

A bad scale or zero point is legal to store but wrong to compute with: a zero scale divides by zero in
QuantizeLinear, a negative or NaN one turns every value into garbage, and a per-axis scale whose length does
not match its axis makes onnxruntime fail in the middle of a run with a multi-line error, or makes TVM index past
it.  Each is one line here (a :class:`~graphopt.errors.UserError` naming the node, the parameter and the fix), by
the operator specs (https://onnx.ai/onnx/operators/: ``QuantizeLinear``, ``DequantizeLinear``,
``MatMulInteger``, ``ConvInteger``, ``QLinearConv``, ``QLinearMatMul``):

* a scale that is a weight: every element a positive finite number;
* a zero point: of its quantized tensor's type (QuantizeLinear: the type it produces), u8 or s8 where the
  operator takes only those, as many elements as its scale;
* a per-axis scale or zero point: one dimension, an axis that exists for the quantized tensor's rank (the
  ``axis`` attribute of QuantizeLinear/DequantizeLinear; rows, columns or output channels for the others), as
  many elements as that axis's extent; per tensor where the operator takes only that (QLinearConv's x and y);
* quantized types nothing here computes: int4/uint4 and the float8/float4 types (onnxruntime computes them,
  TVM's quantize and dequantize take 8- and 16-bit integers only), and blocked quantization (``block_size``),
  which TVM's importer refuses;
* per-axis forms that are legal ONNX but that onnxruntime, the reference every build is checked against, does not
  compute (its kernels stop at the first run): MatMulInteger's and QLinearMatMul's per-row ``a``, QLinearMatMul's
  per-row ``y``, ConvInteger's per-channel weight zero point.

Mixed u8/s8 operands (MatMulInteger with s8 A and u8 B) are legal and computed.  DynamicQuantizeLinear has no
parameters to check (it computes its scale and zero point).  Types and shapes come from the model's declarations
and ONNX shape inference; a parameter that is computed rather than stored is checked for its type only.
Top-level graph only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from graphopt.errors import UserError
from graphopt.onnx_io import DEFAULT_DOMAINS, without_weight_data

OUTPUT = -1  # Operand.data: the node's output 0 is the quantized tensor
EIGHT_BIT = ("uint8", "int8")
SIXTEEN_BIT = ("uint16", "int16")
_FIX = "requantize the model (e.g. with onnxruntime.quantization)"


@dataclass(frozen=True)
class Operand:
    """One quantized tensor of an operator and its parameters, by input index (None: the operator has none)."""

    name: str  # the spec's name of the tensor: "x", "w", "a", "b", "y", "A", "B"
    data: int  # its input index, or OUTPUT
    scale: int | None
    zero: int | None
    # where a per-axis parameter runs: "attr" (the node's ``axis``), "rows" (rank - 2), "columns" (rank - 1),
    # "channels" (axis 0 of the weight); None: per tensor only
    axis: str | None
    types: tuple[str, ...] = EIGHT_BIT
    reference_per_tensor: bool = False  # onnxruntime computes only a per-tensor parameter
    along: int | None = None  # the input a per-axis parameter runs along, when not ``data`` (QuantizeLinear: x)

    def param(self, kind: str) -> str:
        return f"{self.name.lower()}_{kind}"


_QDQ_TYPES = EIGHT_BIT + SIXTEEN_BIT
OPERANDS: dict[str, tuple[Operand, ...]] = {
    "QuantizeLinear": (Operand("y", OUTPUT, 1, 2, "attr", _QDQ_TYPES, along=0),),
    "DequantizeLinear": (Operand("x", 0, 1, 2, "attr", _QDQ_TYPES + ("int32",)),),
    "MatMulInteger": (Operand("a", 0, None, 2, "rows", reference_per_tensor=True),
                      Operand("b", 1, None, 3, "columns")),
    "ConvInteger": (Operand("x", 0, None, 2, None), Operand("w", 1, None, 3, "channels", reference_per_tensor=True)),
    "QLinearConv": (Operand("x", 0, 1, 2, None), Operand("w", 3, 4, 5, "channels"), Operand("y", OUTPUT, 6, 7, None)),
    "QLinearMatMul": (Operand("a", 0, 1, 2, "rows", reference_per_tensor=True), Operand("b", 3, 4, 5, "columns"),
                      Operand("y", OUTPUT, 6, 7, "rows", reference_per_tensor=True)),
}
_PER = {"attr": "axis", "rows": "row", "columns": "column", "channels": "output channel"}
# Reported by name: types a quantized tensor may have in ONNX that nothing here computes.
_NOT_COMPUTED = ("int4", "uint4", "int2", "uint2", "float8", "float4")


def type_name(elem_type: int) -> str:
    """numpy's name for an ONNX element type (``uint8``, ``float32``), else ONNX's in lower case (``int4``)."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:  # noqa: BLE001 - types numpy cannot name, UNDEFINED
        try:
            return onnx.TensorProto.DataType.Name(elem_type).lower()
        except ValueError:
            return f"type {elem_type}"


class _Model:
    """What the checks read of a model: each tensor's type and shape, and the values of stored tensors."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 1)
        self.stored: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        for n in g.node:
            if n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS and n.output:
                value = next((a.t for a in n.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR),
                             None)
                if value is not None:
                    self.stored[n.output[0]] = value
        self.types: dict[str, tuple[str, tuple[int | None, ...] | None]] = {}
        try:
            inferred = shape_inference.infer_shapes(without_weight_data(model)).graph
        except Exception:  # noqa: BLE001 - a malformed model: onnx.checker names its fault later
            inferred = g
        for vi in list(inferred.input) + list(inferred.value_info) + list(inferred.output):
            if vi.type.HasField("tensor_type"):
                tt = vi.type.tensor_type
                shape = (tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
                         if tt.HasField("shape") else None)
                self.types[vi.name] = (type_name(tt.elem_type), shape)
        for name, t in self.stored.items():
            self.types[name] = (type_name(t.data_type), tuple(int(d) for d in t.dims))

    def dtype(self, name: str) -> str | None:
        return self.types[name][0] if name in self.types else None

    def shape(self, name: str) -> tuple[int | None, ...] | None:
        return self.types[name][1] if name in self.types else None

    def value(self, name: str) -> np.ndarray | None:
        """The value of a stored tensor (an initializer or a Constant's), None for a computed one."""
        t = self.stored.get(name)
        return None if t is None else numpy_helper.to_array(t)


def check_quantization(model: onnx.ModelProto) -> None:
    """UserError (module docstring) for the first quantized operator of ``model`` whose parameters are wrong."""
    nodes = [(k, n) for k, n in enumerate(model.graph.node) if n.op_type in OPERANDS and n.domain in DEFAULT_DOMAINS]
    if not nodes:
        return
    m = _Model(model)
    for k, n in nodes:
        label = f"{n.op_type} node {n.name!r}" if n.name else f"{n.op_type} node #{k}"
        for op in OPERANDS[n.op_type]:
            _check_operand(m, n, op, label)
        if n.op_type == "QLinearConv":
            _check_bias(m, n, label)


def _input(n: onnx.NodeProto, k: int | None) -> str:
    return n.input[k] if k is not None and k < len(n.input) else ""


def _attr(n: onnx.NodeProto, key: str, default: int) -> int:
    return next((int(helper.get_attribute_value(a)) for a in n.attribute if a.name == key), default)


def _check_operand(m: _Model, n: onnx.NodeProto, op: Operand, label: str) -> None:
    data = n.output[0] if op.data == OUTPUT else _input(n, op.data)
    scale, zero = _input(n, op.scale), _input(n, op.zero)
    _check_type(m, n, op, label, data, zero)
    if n.op_type in ("QuantizeLinear", "DequantizeLinear") and _attr(n, "block_size", 0) != 0:
        raise UserError(f"{label} uses blocked quantization (block_size {_attr(n, 'block_size', 0)}), which TVM's "
                        f"ONNX importer does not convert: {_FIX} per tensor or per channel")
    if scale:
        _check_scale_values(m, scale, label, op.param("scale"))
    if scale and zero and m.shape(scale) is not None and m.shape(zero) is not None \
            and math.prod(m.shape(scale)) != math.prod(m.shape(zero)):  # type: ignore[arg-type]
        raise UserError(f"{label}: {op.param('zero_point')} {zero!r} has {math.prod(m.shape(zero))} elements but "
                        f"{op.param('scale')} {scale!r} has {math.prod(m.shape(scale))}; give both the same "
                        f"shape (the spec requires it): {_FIX}")
    param, kind = (scale, "scale") if scale else (zero, "zero_point")
    if param:
        along = data if op.along is None else _input(n, op.along)
        _check_axis(m, n, op, label, along, param, op.param(kind))


def _check_type(m: _Model, n: onnx.NodeProto, op: Operand, label: str, data: str, zero: str) -> str | None:
    """The quantized type of ``op`` (its zero point's, its tensor's, or QuantizeLinear's ``output_dtype``),
    refused when the operator does not take it or nothing here computes it."""
    zero_type = m.dtype(zero) if zero else None
    if op.data == OUTPUT:  # the zero point sets the output's type
        declared = _attr(n, "output_dtype", 0) if n.op_type == "QuantizeLinear" else 0
        out_type = type_name(declared) if declared else None
        if zero_type and out_type and zero_type != out_type:
            raise UserError(f"{label}: y_zero_point {zero!r} is {zero_type} but output_dtype is {out_type}; make "
                            "them agree (the spec requires it) and re-export")
        quantized = zero_type or out_type or ("uint8" if n.op_type == "QuantizeLinear" else m.dtype(data))
    else:
        quantized = m.dtype(data)
        if quantized and zero_type and zero_type != quantized:
            raise UserError(f"{label}: {op.param('zero_point')} {zero!r} is {zero_type} but {op.name} {data!r} is "
                            f"{quantized}; a zero point has its tensor's type: store it as {quantized} "
                            f"(numpy_helper.from_array(zp.astype('{quantized}')))")
        quantized = quantized or zero_type
    if quantized is None or quantized in op.types:
        return quantized
    if quantized.startswith(_NOT_COMPUTED):
        raise UserError(f"{label}: {op.name} is quantized to {quantized}, which this build does not compute (TVM's "
                        f"quantize and dequantize take 8- and 16-bit integers only): {_FIX} to int8/uint8")
    raise UserError(f"{label}: {op.name} {data!r} is {quantized}, but {n.op_type} takes "
                    f"{' or '.join(op.types)} there: {_FIX} to int8/uint8")


def _check_scale_values(m: _Model, scale: str, label: str, param: str) -> None:
    value = m.value(scale)
    if value is None or value.dtype.kind != "f":
        return
    flat = value.astype(np.float64).reshape(-1)
    bad = ~np.isfinite(flat) | (flat <= 0)
    if bad.any():
        k = int(np.argmax(bad))
        where = f" at index {k}" if flat.size > 1 else ""
        what = "NaN" if np.isnan(flat[k]) else "infinite" if np.isinf(flat[k]) else "zero" if flat[k] == 0 \
            else f"negative ({flat[k]:g})"
        raise UserError(f"{label}: {param} {scale!r} is {what}{where}; a scale must be a positive finite number "
                        f"(a zero one divides by zero, a negative or NaN one computes garbage): {_FIX}")


def _check_axis(m: _Model, n: onnx.NodeProto, op: Operand, label: str, data: str, param: str, what: str) -> None:
    """A parameter of more than one element: per axis, on an axis that exists for ``data`` (the tensor it runs
    along), as long as that axis."""
    shape = m.shape(param)
    if shape is None or None in shape or math.prod(shape) <= 1:  # type: ignore[arg-type]
        return
    size = math.prod(shape)  # type: ignore[arg-type]
    tensor = f"{'x' if op.along is not None else op.name} {data!r}"  # QuantizeLinear's runs along its input x
    if op.axis is None:
        raise UserError(f"{label}: {what} {param!r} has {size} elements, but {n.op_type} takes one for "
                        f"{op.name} (per tensor): {_FIX} with a per-tensor {what}")
    if op.reference_per_tensor:
        raise UserError(f"{label}: {what} {param!r} has {size} elements (per {_PER[op.axis]}); that is legal ONNX, "
                        f"but onnxruntime, the reference every build is checked against, computes only a per-tensor "
                        f"{what} for {n.op_type}: {_FIX} with a per-tensor {what}")
    if len(shape) != 1 and not (op.axis == "columns" and n.op_type == "MatMulInteger"):  # [D1, D2, 1, N] is legal
        raise UserError(f"{label}: {what} {param!r} has shape {list(shape)}; a per-axis {what} is one-dimensional: "
                        f"{_FIX}")
    data_shape = m.shape(data)
    rank = None if data_shape is None else len(data_shape)
    if op.axis == "attr":
        if m.opset < 13:
            raise UserError(f"{label}: {what} {param!r} has {size} elements, but {n.op_type} takes per-axis "
                            f"parameters from opset 13 on (the model is opset {m.opset}): re-export at opset 13 or "
                            "newer, or use a per-tensor one")
        axis = _attr(n, "axis", 1)
        if rank is not None and not -rank <= axis < rank:
            raise UserError(f"{label}: axis {axis} does not exist for {tensor} of rank {rank}; a per-axis {what} "
                            f"needs an axis in [{-rank}, {rank - 1}]: fix the node's axis attribute")
        axis = axis % rank if rank else axis
    elif rank is not None and rank < 2 and op.axis in ("rows", "columns"):
        raise UserError(f"{label}: {what} {param!r} has {size} elements, per {_PER[op.axis]}, but {tensor} is "
                        f"one-dimensional: {_FIX} with a per-tensor {what}")
    else:
        axis = {"rows": (rank or 2) - 2, "columns": (rank or 1) - 1, "channels": 0}[op.axis]
    if data_shape is not None and data_shape[axis] is not None and shape[-1] != data_shape[axis]:
        extent = data_shape[axis]
        raise UserError(f"{label}: {what} {param!r} has {shape[-1]} elements but {tensor} has {extent} along axis "
                        f"{axis} (shape {list(data_shape)}), which its elements run along; give it {extent} "
                        f"elements: {_FIX}")


def _check_bias(m: _Model, n: onnx.NodeProto, label: str) -> None:
    """QLinearConv's optional bias B: int32, one element per output channel."""
    bias, w = _input(n, 8), _input(n, 3)
    if not bias:
        return
    if m.dtype(bias) not in (None, "int32"):
        raise UserError(f"{label}: bias B {bias!r} is {m.dtype(bias)}; QLinearConv takes an int32 bias quantized with "
                        f"scale x_scale * w_scale and zero point 0: {_FIX}")
    shape, w_shape = m.shape(bias), m.shape(w)
    if shape is not None and w_shape and w_shape[0] is not None and tuple(shape) != (w_shape[0],):
        raise UserError(f"{label}: bias B {bias!r} has shape {list(shape)}, but the weight has {w_shape[0]} output "
                        f"channels; give B shape [{w_shape[0]}]: {_FIX}")
