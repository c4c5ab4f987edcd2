"""Matrix products: ``matmul`` (activation of any rank >= 2 times a 2-D weight, e.g. BERT's [B,S,H] x [H,H]
projections, which is what lets Q/K/V merge by concatenating weights) and ``bmatmul`` (batched, equal batch
dims, rank >= 3, attention scores), plus the identity-matrix constant ``Imatmul``."""
from __future__ import annotations

import numpy as np

from graphopt.ops.base import OpSpec, check
from graphopt.ops.onnx_util import dtype_of, node, static_shape


def _matmul_shape(params, shapes):
    a, b = shapes
    check(len(a) >= 2 and len(b) == 2, "matmul needs rank>=2 x rank-2")
    check(a[-1] == b[0], f"matmul inner dims differ: {a} x {b}")
    return [tuple(a[:-1]) + (b[1],)]


def _bmatmul_shape(params, shapes):
    a, b = shapes
    check(len(a) >= 3 and len(a) == len(b), "bmatmul needs equal ranks >= 3")
    check(a[:-2] == b[:-2], f"bmatmul batch dims differ: {a} x {b}")
    check(a[-1] == b[-2], f"bmatmul inner dims differ: {a} x {b}")
    return [tuple(a[:-1]) + (b[-1],)]


def _mm_ref(params, ins, ar):
    return [np.matmul(ins[0], ins[1])]


def _mm_emit(params, inputs, outputs, graph):
    return [node(graph, "MatMul", inputs, outputs)]


def _mm_parse(kind):
    def parse(n, graph):
        if len(n.inputs) != 2 or len(n.outputs) != 1:
            return None
        a, b = static_shape(graph, n.inputs[0]), static_shape(graph, n.inputs[1])
        if a is None or b is None:
            return None
        shape = _matmul_shape if kind == "matmul" else _bmatmul_shape
        try:
            shape({}, [a, b])
        except ValueError:
            return None
        return {}
    return parse


def _imatmul_shape(params, shapes):
    (w,) = shapes
    check(len(w) == 2 and w[0] == w[1], "Imatmul needs a square matrix reference")
    return [tuple(w)]


def _imatmul_ref(params, ins, ar):
    n = ins[0].shape[0]
    out = ar.full((n, n), 0)
    for i in range(n):
        out[i, i] = ar.full((), 1)[()]
    return [out]


def _imatmul_emit(params, inputs, outputs, graph):
    n = static_shape(graph, inputs[0])[0]
    graph.initializers[outputs[0]] = np.eye(n, dtype=dtype_of(graph, inputs[0]))
    return []


MATMUL = OpSpec(name="matmul", n_inputs=2, n_outputs=1, shape=_matmul_shape, ref=_mm_ref, z3_params=(), emit=_mm_emit,
                onnx_types=("MatMul",), parse=_mm_parse("matmul"), doc="x[...,M,K] @ w[K,N]", fusion="anchor")
BMATMUL = OpSpec(name="bmatmul", n_inputs=2, n_outputs=1, shape=_bmatmul_shape, ref=_mm_ref, z3_params=(),
                 emit=_mm_emit, onnx_types=("MatMul",), parse=_mm_parse("bmatmul"),
                 doc="x[...,M,K] @ y[...,K,N], equal batch dims", fusion="anchor")
IMATMUL = OpSpec("Imatmul", 1, 1, _imatmul_shape, _imatmul_ref, (), _imatmul_emit, shape_inputs=(0,),
                 doc="identity matrix shaped like the square reference; emitted as a weight")
SPECS = [MATMUL, BMATMUL, IMATMUL]
