"""Emit primitive ONNX nodes into a :class:`~graphopt.ir.Graph`, typed and valid for the model's opset.

A lowering writes dozens to thousands of nodes, so names come from one local counter (``Graph.fresh_name``
rescans the whole graph per call) and every output gets its static type in ``value_info`` right away: the
graph search matches and prices nodes by shape, and ONNX shape inference is not re-run after legalization.

Opset awareness matters because RNN models are old: LSTM is opset 7, and model-zoo graphs still ship at
opset 7-9.  Only ops whose form differs across opsets 7-22 need care here (Slice, Split, Clip take their
parameters as attributes before 10/13/11); everything else emitted (MatMul, Add, Mul, Sub, Gather, Concat,
Reshape, Transpose, Less, Cast, the activations) has had the same signature since opset 7.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from graphopt.ir import Graph, Node, TensorInfo


class Builder:
    """Appends nodes (kept in :attr:`nodes`, in order) and weights to ``graph`` under fresh names."""

    def __init__(self, graph: Graph, prefix: str = "legalized"):
        self.graph = graph
        self.prefix = self.clean_prefix(prefix)
        self.nodes: list[Node] = []
        self._used = graph._used_names()
        self._count = 0
        self._consts: dict[tuple, str] = {}
        self.opset = graph.onnx_opset

    # ---- names, weights ------------------------------------------------------------------------------
    @staticmethod
    def clean_prefix(name: str) -> str:
        """New tensors are named after the node they replace, e.g. ``lstm1/matmul_12``."""
        return name.replace("/", "_").strip("_") or "legalized"

    def fresh(self, hint: str) -> str:
        while True:
            self._count += 1
            name = f"{self.prefix}/{hint}_{self._count}"
            if name not in self._used:
                self._used.add(name)
                return name

    def const(self, value: Any, dtype: Any = None, hint: str = "c") -> str:
        """A weight holding ``value``; equal small constants (indices, shapes, 1.0) are shared."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes()) if arr.size <= 64 else None
        if key is not None and key in self._consts:
            return self._consts[key]
        name = self.fresh(hint)
        self.graph.initializers[name] = arr
        if key is not None:
            self._consts[key] = name
        return name

    # ---- generic node --------------------------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str], shape: Sequence[int], dtype: str, **attrs: Any) -> str:
        """One node with one output of the given static type; returns the output name."""
        return self.multi(op_type, inputs, [tuple(shape)], dtype, **attrs)[0]

    def multi(self, op_type: str, inputs: Sequence[str], shapes: Sequence[Sequence[int]], dtype: str,
              **attrs: Any) -> list[str]:
        hint = op_type.lower()
        outs = [self.fresh(hint) for _ in shapes]
        for name, shape in zip(outs, shapes):
            self.graph.value_info[name] = TensorInfo(name, dtype, tuple(int(d) for d in shape))
        self.nodes.append(Node(op_type, list(inputs), outs, dict(attrs), name=self.fresh(op_type)))
        return outs

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.graph.shape(name))  # type: ignore[arg-type]

    def dtype(self, name: str) -> str:
        info = self.graph.tensor(name)
        return info.dtype if info is not None else "float32"

    def value(self, name: str) -> np.ndarray | None:
        """The value of a weight (an initializer the caller cannot override), else None."""
        return self.graph.initializers[name] if name and self.graph.is_constant(name) else None

    # Every helper below folds when all its inputs are weights: lowering code stays one path whether the
    # RNN weights are initializers (the usual case: transposes and bias sums are done once, here) or inputs.

    # ---- ops whose signature changed across opsets ---------------------------------------------------
    def slice(self, x: str, axis: int, start: int, end: int) -> str:
        v = self.value(x)
        if v is not None:
            return self.const(np.take(v, range(start, end), axis=axis), hint="w")
        shape = list(self.shape(x))
        shape[axis] = end - start
        if self.opset < 10:
            return self.op("Slice", [x], shape, self.dtype(x), axes=[axis], starts=[start], ends=[end])
        ins = [x, self.const([start], np.int64), self.const([end], np.int64), self.const([axis], np.int64)]
        return self.op("Slice", ins, shape, self.dtype(x))

    def split(self, x: str, axis: int, sizes: Sequence[int]) -> list[str]:
        v = self.value(x)
        if v is not None:
            return [self.const(p, hint="w") for p in np.split(v, np.cumsum(sizes)[:-1], axis=axis)]
        shape = list(self.shape(x))
        shapes = [shape[:axis] + [s] + shape[axis + 1:] for s in sizes]
        if self.opset < 13:
            return self.multi("Split", [x], shapes, self.dtype(x), axis=axis, split=[int(s) for s in sizes])
        return self.multi("Split", [x, self.const(list(sizes), np.int64)], shapes, self.dtype(x), axis=axis)

    def slices(self, x: str, axis: int, sizes: Sequence[int]) -> list[str]:
        """Consecutive pieces of ``x`` as separate Slice nodes, not one Split.

        Why: TVM's Split is a kernel of its own that returns a tuple, which ends fusion there; a Slice is
        an injective op that fuses into the element-wise kernel reading the piece (an LSTM step with
        per-gate Slices runs in two element-wise kernels instead of five).
        """
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
        return [self.slice(x, axis, int(s), int(s) + int(n)) for s, n in zip(starts, sizes)]

    def clip(self, x: str, low: float, high: float) -> str:
        dt = self.dtype(x)
        if self.opset < 11:
            return self.op("Clip", [x], self.shape(x), dt, min=float(low), max=float(high))
        return self.op("Clip", [x, self.const(low, dt), self.const(high, dt)], self.shape(x), dt)

    # ---- the rest (same form in every opset) ---------------------------------------------------------
    def reshape(self, x: str, shape: Sequence[int]) -> str:
        if tuple(shape) == self.shape(x):
            return x
        v = self.value(x)
        if v is not None:
            return self.const(v.reshape(shape), hint="w")
        return self.op("Reshape", [x, self.const(list(shape), np.int64)], shape, self.dtype(x))

    def gather(self, x: str, index: int | str, axis: int = 0) -> str:
        """``x`` indexed along ``axis`` by a constant scalar (drops the axis) or an index tensor."""
        v = self.value(x)
        if v is not None and isinstance(index, int):
            return self.const(np.take(v, index, axis=axis), hint="w")
        shape = list(self.shape(x))
        if isinstance(index, int):
            idx, idx_shape = self.const(index, np.int64), []
        else:
            idx, idx_shape = index, list(self.shape(index))
        out = shape[:axis] + idx_shape + shape[axis + 1:]
        return self.op("Gather", [x, idx], out, self.dtype(x), axis=axis)

    def concat(self, xs: Sequence[str], axis: int) -> str:
        if len(xs) == 1:
            return xs[0]
        shape = list(self.shape(xs[0]))
        shape[axis] = sum(self.shape(x)[axis] for x in xs)
        return self.op("Concat", list(xs), shape, self.dtype(xs[0]), axis=axis)

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        v = self.value(x)
        if v is not None:
            return self.const(np.ascontiguousarray(np.transpose(v, perm)), hint="w")
        shape = self.shape(x)
        return self.op("Transpose", [x], [shape[p] for p in perm], self.dtype(x), perm=list(perm))

    _NUMPY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}

    def binary(self, op_type: str, a: str, b: str) -> str:
        va, vb = self.value(a), self.value(b)
        if va is not None and vb is not None and op_type in self._NUMPY:
            return self.const(self._NUMPY[op_type](va, vb).astype(va.dtype), hint="w")
        shape = np.broadcast_shapes(self.shape(a), self.shape(b))
        dtype = "bool" if op_type in ("Less", "Greater", "Equal") else self.dtype(a)
        return self.op(op_type, [a, b], shape, dtype)

    def add(self, a: str, b: str | None) -> str:
        """``a + b``, or ``a`` when ``b`` is None (an absent bias or zero state)."""
        return a if b is None else self.binary("Add", a, b)

    def mul(self, a: str, b: str) -> str:
        return self.binary("Mul", a, b)

    def unary(self, op_type: str, x: str, **attrs: Any) -> str:
        return self.op(op_type, [x], self.shape(x), self.dtype(x), **attrs)

    def matmul(self, a: str, b: str) -> str:
        sa, sb = self.shape(a), self.shape(b)
        return self.op("MatMul", [a, b], sa[:-1] + sb[-1:], self.dtype(a))

    def cast(self, x: str, dtype: str) -> str:
        from onnx import helper

        if self.dtype(x) == dtype:
            return x
        v = self.value(x)
        if v is not None:
            return self.const(v.astype(dtype), hint="w")
        to = int(helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        return self.op("Cast", [x], self.shape(x), dtype, to=to)

    def where(self, cond: str, a: str, b: str) -> str:
        shape = np.broadcast_shapes(self.shape(cond), self.shape(a), self.shape(b))
        return self.op("Where", [cond, a, b], shape, self.dtype(a))
