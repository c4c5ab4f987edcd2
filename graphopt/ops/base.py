"""Shared machinery of the operator specs: the :class:`OpSpec` record and the three arithmetics.

Every operator is written once, as a numpy function generic over the element type, and run under three
*arithmetics* (:class:`Arith`):

* ``INT``: int64 arithmetic on random integers, used for fingerprints.  int64 wraps modulo 2**64, which is a
  ring homomorphism, so every algebraic identity still holds exactly and no float error can hide or fake
  an equality.  relu is replaced by the non-linear ``x*(x+1)+1`` so it cannot create spurious identities,
  and average pooling is a plain sum (no division in a ring).
* ``FLOAT``: float64, the real semantics (relu = max(x, 0), avg pool = mean); confirms candidates and is
  compared with onnxruntime in the tests.
* symbolic (:func:`symbolic_arith`): numpy object arrays of Z3 ``Real`` terms, relu an uninterpreted
  Real -> Real function; used by ``graphopt rules check-properties`` to prove operator properties on small
  concrete shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Arith:
    """How the element-type-dependent parts of the references behave (see module docstring)."""

    kind: str  # "int" | "float" | "sym"
    relu: Callable[[np.ndarray], np.ndarray]
    dtype: Any

    def scale(self, arr: np.ndarray, num: int, den: int) -> np.ndarray:
        """``arr * num / den``; the integer arithmetic drops the division (avg pool becomes a sum)."""
        if self.kind == "int":
            return arr * num
        if self.kind == "float":
            return arr * (num / den)
        import z3
        c = z3.RealVal(Fraction(num, den))
        return _map(lambda v: c * v, arr)

    def full(self, shape: Shape, value: int) -> np.ndarray:
        if self.kind == "sym":
            import z3
            out = np.empty(shape, dtype=object)
            out.fill(z3.RealVal(value))
            return out
        return np.full(shape, value, dtype=self.dtype)

    def maximum(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.kind == "sym":
            import z3
            a, b = np.broadcast_arrays(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
            out = np.empty(a.shape, dtype=object)
            for idx in np.ndindex(*a.shape):
                out[idx] = z3.If(a[idx] >= b[idx], a[idx], b[idx])
            return out
        return np.maximum(a, b)


def _map(fn: Callable[[Any], Any], arr: np.ndarray) -> np.ndarray:
    """Apply a Python function to every element of an object array (Z3 terms), keeping the shape."""
    arr = np.asarray(arr, dtype=object)
    out = np.empty(arr.shape, dtype=object)
    for idx in np.ndindex(*arr.shape):
        out[idx] = fn(arr[idx])
    return out


def _int_relu(x: np.ndarray) -> np.ndarray:
    return x * (x + 1) + 1


INT = Arith("int", _int_relu, np.int64)
FLOAT = Arith("float", lambda x: np.maximum(x, 0.0), np.float64)

_SYM_CACHE: dict[int, Arith] = {}


def symbolic_arith() -> Arith:
    """Arithmetic over Z3 reals with an uninterpreted relu (one declaration per process)."""
    if 0 not in _SYM_CACHE:
        import z3
        relu = z3.Function("relu", z3.RealSort(), z3.RealSort())
        _SYM_CACHE[0] = Arith("sym", lambda x: _map(lambda v: relu(v), x), object)
    return _SYM_CACHE[0]


@dataclass(frozen=True)
class OpSpec:
    """Everything the optimizer knows about one operator.

    ``shape(params, in_shapes) -> out_shapes`` raises ValueError for invalid shapes.
    ``ref(params, inputs, arith) -> outputs`` is the numpy reference under any :class:`Arith`.
    ``z3_params`` names the parameters that become the integer arguments of the op's uninterpreted Z3
    function ``<name>(ints..., tensors...)`` (one function per output), encoded by :func:`encode_param`.
    ``emit(params, inputs, outputs, graph) -> list[Node]`` is the ONNX mapping (export);
    ``onnx_types`` + ``parse(node, graph)`` the import side (parse returns params or None).
    ``shape_inputs`` are inputs whose *shape* only is used (references for constants and enlarge).
    ``fusion`` says how the backends fuse the op (what the cost models price as free, see
    :mod:`graphopt.cost.analysis`): ``"anchor"`` - a kernel that takes element-wise epilogues (matmul,
    conv); ``"elementwise"`` - runs inside its producer's kernel when it reads that kernel's only use.
    """

    name: str
    n_inputs: int
    n_outputs: int
    shape: Callable[[dict, Sequence[Shape]], list[Shape]]
    ref: Callable[[dict, Sequence[np.ndarray], Arith], list[np.ndarray]]
    z3_params: tuple[str, ...]
    emit: Callable[..., list]
    onnx_types: tuple[str, ...] = ()
    parse: Callable[..., dict | None] | None = None
    commutative: bool = False
    shape_inputs: tuple[int, ...] = ()
    doc: str = ""
    variadic: bool = False  # concat: any number (>= 2) of inputs when imported from ONNX
    fusion: str = ""  # "anchor" | "elementwise" | "" (see docstring)
    extra: dict = field(default_factory=dict)


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


PAD_CODES = ("SAME", "VALID")
ACT_CODES = ("none", "relu")


def encode_param(key: str, value: Any) -> int:
    """Injective integer code of one parameter value, as used in the Z3 terms."""
    if key in ("stride", "kernel"):
        return int(value[0]) * 64 + int(value[1])
    if key == "pad":
        return PAD_CODES.index(value)
    if key == "act":
        return ACT_CODES.index(value)
    if key in ("perm", "shape"):
        code = len(value)
        for v in value:
            code = code * 4096 + int(v)
        return code
    return int(value)
