"""Operator specs: the one place where each operator the optimizer understands is defined.

Contract used by the rest of graphopt (the generator, the verifier, the search):

* ``REGISTRY: dict[str, OpSpec]`` - keyed by our op names, the names used in ``PNode.op``.
* ``from_onnx(node, graph) -> (op, params) | None`` - the view of one IR node, or None when the node is
  opaque to the optimizer (unknown op, unsupported attributes, non-static shapes).  ``params`` use the same
  keys/values the generator writes into ``PNode.params`` (tuples for stride/kernel/perm/sizes).
  The op's data inputs are ``op_inputs(node, graph)``: ``node.inputs`` except that ``bias_add`` and ``smul``
  put the broadcast operand second even when ONNX has it first (``Add(bias, x)``), and ``split``'s and
  ``reshape``'s constant size/shape input is dropped (it is a parameter).  ``concat`` may have more than two
  inputs, ``split`` more than two outputs.
* ``to_onnx(op, params, inputs, outputs, graph) -> list[Node]`` - nodes computing the op; may add small
  int64 weights to ``graph`` (Split sizes, Pad pads, Reshape shape).  Constants (``Iconv``, ``Imatmul``,
  ``Iewmul``, ``Cpool``) are written as a weight named ``outputs[0]`` and return no node.  Shape-dependent
  mappings (conv pads, constants, enlarge) read input shapes from ``graph``, so those must be known.
* ``infer_shape(op, params, input_shapes) -> list[shape]`` - raises ValueError for invalid shapes (this is
  how a rule application with mismatching shapes is rejected).
* ``understood(node, graph) -> bool`` - ``from_onnx(...) is not None``.
* ``bind_params(params, dims)`` - in rules, ``split`` sizes are symbolic (``"x1.0"`` = dim 0 of pattern input
  x1, TASO's split tree); this resolves them from the shapes of the matched pattern inputs.

Ops taking a *shape reference* (``OpSpec.shape_inputs``): ``enlarge(w, ref)`` and the constants
``Iconv(w)``, ``Imatmul(w)``, ``Iewmul(x)``, ``Cpool[kernel](x)`` read only the shape of those inputs.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from graphopt.ir import Graph, Node
from graphopt.ops import conv, elementwise, layout, linalg, pool
from graphopt.ops.base import FLOAT, INT, Arith, OpSpec, Shape, encode_param, symbolic_arith

__all__ = ["REGISTRY", "OpSpec", "Arith", "INT", "FLOAT", "symbolic_arith", "from_onnx", "to_onnx", "infer_shape",
           "understood", "op_inputs", "bind_params", "evaluate", "z3_args", "encode_param"]

REGISTRY: dict[str, OpSpec] = {s.name: s for m in (linalg, conv, pool, elementwise, layout) for s in m.SPECS}
_BY_ONNX: dict[str, list[OpSpec]] = {}
for _s in REGISTRY.values():
    for _t in _s.onnx_types:
        _BY_ONNX.setdefault(_t, []).append(_s)


def from_onnx(node: Node, graph: Graph) -> tuple[str, dict] | None:
    if node.domain not in ("", "ai.onnx"):
        return None
    for spec in _BY_ONNX.get(node.op_type, []):
        params = spec.parse(node, graph) if spec.parse else None
        if params is not None:
            return spec.name, params
    return None


def understood(node: Node, graph: Graph) -> bool:
    return from_onnx(node, graph) is not None


def op_inputs(node: Node, graph: Graph) -> list[str]:
    """The data inputs of an understood node in the op's order (see module docstring)."""
    view = from_onnx(node, graph)
    if view is None:
        raise ValueError(f"node {node.name or node.op_type} is opaque")
    op = view[0]
    if op in ("split", "reshape"):
        return [node.inputs[0]]
    if op in ("bias_add", "smul"):
        a, b = node.inputs
        sa, sb = graph.shape(a), graph.shape(b)
        small_first = (op == "smul" and tuple(sa) == ()) or (op == "bias_add" and tuple(sa) != tuple(
            np.broadcast_shapes(tuple(sa), tuple(sb))))
        return [b, a] if small_first else [a, b]
    return list(node.inputs)


def to_onnx(op: str, params: dict, inputs: list[str], outputs: list[str], graph: Graph) -> list[Node]:
    return REGISTRY[op].emit(dict(params), list(inputs), list(outputs), graph)


def infer_shape(op: str, params: dict, input_shapes: Sequence[Sequence[int]]) -> list[Shape]:
    spec = REGISTRY.get(op)
    if spec is None:
        raise ValueError(f"unknown op {op!r}")
    if len(input_shapes) != spec.n_inputs and not (spec.variadic and op == "concat" and len(input_shapes) >= 2):
        raise ValueError(f"{op} takes {spec.n_inputs} inputs, got {len(input_shapes)}")
    return spec.shape(dict(params), [tuple(s) for s in input_shapes])


def bind_params(params: dict, dims: dict[str, Sequence[int]]) -> dict:
    """Resolve symbolic split sizes ``"xK.D"`` using ``dims[xK]`` (shape of pattern input xK)."""
    sizes = params.get("sizes")
    if sizes is None or all(isinstance(s, int) for s in sizes):
        return dict(params)
    out = []
    for s in sizes:
        if isinstance(s, str):
            name, _, d = s.partition(".")
            out.append(int(dims[name][int(d)]))
        else:
            out.append(int(s))
    return {**params, "sizes": tuple(out)}


def evaluate(op: str, params: dict, inputs: Sequence[np.ndarray], arith: Arith = FLOAT) -> list[np.ndarray]:
    """Run the numpy reference of ``op`` (shape-checked) under the given arithmetic."""
    spec = REGISTRY[op]
    infer_shape(op, params, [np.shape(x) for x in inputs])
    return spec.ref(dict(params), list(inputs), arith)


def z3_args(op: str, params: dict) -> tuple[int, ...]:
    """The integer arguments of ``op``'s uninterpreted Z3 function for concrete ``params``."""
    return tuple(encode_param(k, params[k] if k in params else (1 if k == "groups" else "none"))
                 for k in REGISTRY[op].z3_params)
