"""Element-wise operators: ``relu``, ``ewadd``/``ewmul`` (equal shapes), ``smul`` (times a rank-0 scalar),
``bias_add`` (add a smaller tensor broadcast numpy-style, e.g. a [N] bias after a matmul or a [C,1,1] bias
after a conv), and the all-ones constant ``Iewmul``.

ONNX ``Add``/``Mul`` map to ewadd/ewmul when both shapes are equal, to bias_add/smul when the second (or the
first, see :func:`graphopt.ops.op_inputs`) operand broadcasts to the other's shape.
"""
from __future__ import annotations

import numpy as np

from graphopt.ops.base import OpSpec, check
from graphopt.ops.onnx_util import dtype_of, node, static_shape


def _same_shape(params, shapes):
    a, b = shapes
    check(tuple(a) == tuple(b), f"element-wise op needs equal shapes: {a} vs {b}")
    return [tuple(a)]


def _unary_shape(params, shapes):
    return [tuple(shapes[0])]


def _smul_shape(params, shapes):
    check(tuple(shapes[1]) == (), "smul needs a rank-0 scalar as second input")
    return [tuple(shapes[0])]


def broadcasts_to(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    if len(small) > len(big):
        return False
    return all(s == 1 or s == b for s, b in zip(reversed(small), reversed(big)))


def _bias_shape(params, shapes):
    x, b = shapes
    check(tuple(b) != tuple(x) and len(b) >= 1 and broadcasts_to(tuple(b), tuple(x)),
          f"bias_add needs a bias broadcastable to the input (and not of equal shape): {b} -> {x}")
    return [tuple(x)]


def _binary_parse(op_type_for_equal: bool, kind: str):
    def parse(n, graph):
        if len(n.inputs) != 2 or len(n.outputs) != 1:
            return None
        a, b = static_shape(graph, n.inputs[0]), static_shape(graph, n.inputs[1])
        if a is None or b is None:
            return None
        if kind == "equal":
            return {} if a == b else None
        if kind == "scalar":
            return {} if (b == () and a != ()) or (a == () and b != ()) else None
        # bias: the smaller operand broadcasts to the larger, which is the output
        if a == b:
            return None
        if broadcasts_to(b, a) and len(b) >= 1:
            return {}
        if broadcasts_to(a, b) and len(a) >= 1:
            return {}
        return None
    return parse


def _emit(op_type):
    def emit(params, inputs, outputs, graph):
        return [node(graph, op_type, inputs, outputs)]
    return emit


def _iewmul_emit(params, inputs, outputs, graph):
    graph.initializers[outputs[0]] = np.ones(static_shape(graph, inputs[0]), dtype=dtype_of(graph, inputs[0]))
    return []


RELU = OpSpec(name="relu", n_inputs=1, n_outputs=1, shape=_unary_shape, ref=lambda p, i, ar: [ar.relu(i[0])],
              z3_params=(), emit=_emit("Relu"), onnx_types=("Relu",),
              parse=lambda n, g: {} if len(n.inputs) == 1 else None, fusion="elementwise")
EWADD = OpSpec(name="ewadd", n_inputs=2, n_outputs=1, shape=_same_shape, ref=lambda p, i, ar: [i[0] + i[1]],
               z3_params=(), emit=_emit("Add"), onnx_types=("Add",), parse=_binary_parse(True, "equal"),
               commutative=True, fusion="elementwise")
EWMUL = OpSpec(name="ewmul", n_inputs=2, n_outputs=1, shape=_same_shape, ref=lambda p, i, ar: [i[0] * i[1]],
               z3_params=(), emit=_emit("Mul"), onnx_types=("Mul",), parse=_binary_parse(True, "equal"),
               commutative=True, fusion="elementwise")
SMUL = OpSpec(name="smul", n_inputs=2, n_outputs=1, shape=_smul_shape, ref=lambda p, i, ar: [i[0] * i[1]], z3_params=(),
              emit=_emit("Mul"), onnx_types=("Mul",), parse=_binary_parse(False, "scalar"), doc="x * s, s rank 0",
              fusion="elementwise")
BIAS_ADD = OpSpec(name="bias_add", n_inputs=2, n_outputs=1, shape=_bias_shape, ref=lambda p, i, ar: [i[0] + i[1]],
                  z3_params=(), emit=_emit("Add"), onnx_types=("Add",), parse=_binary_parse(False, "bias"),
                  doc="x + b, b broadcast to x's shape", fusion="elementwise")
IEWMUL = OpSpec("Iewmul", 1, 1, _unary_shape, lambda p, i, ar: [ar.full(i[0].shape, 1)], (), _iewmul_emit,
                shape_inputs=(0,), doc="ones shaped like the reference; emitted as a weight")
SPECS = [RELU, EWADD, EWMUL, SMUL, BIAS_ADD, IEWMUL]
