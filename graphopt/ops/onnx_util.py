"""Small helpers shared by the ONNX mappings of the operator specs."""
from __future__ import annotations

import numpy as np

from graphopt.ir import Graph, Node, TensorInfo


def node(graph: Graph, op_type: str, inputs: list[str], outputs: list[str], **attrs) -> Node:
    return Node(op_type, list(inputs), list(outputs), attrs, name=graph.fresh_name(f"go_{op_type}"))


def const(graph: Graph, base: str, value: np.ndarray) -> str:
    """Add a weight (e.g. a Reshape shape or Split sizes) under a fresh name and return the name."""
    name = graph.fresh_name(base)
    graph.initializers[name] = value
    return name


def intermediate(graph: Graph, base: str, like: str, shape: tuple[int, ...] | None) -> str:
    """A fresh tensor name for a value inside a multi-node mapping, typed like tensor ``like``."""
    name = graph.fresh_name(base)
    info = graph.tensor(like)
    graph.value_info[name] = TensorInfo(name, info.dtype if info else "float32", shape)
    return name


def dtype_of(graph: Graph, name: str) -> str:
    info = graph.tensor(name)
    return info.dtype if info is not None else "float32"


def static_shape(graph: Graph, name: str) -> tuple[int, ...] | None:
    s = graph.shape(name)
    return tuple(s) if s is not None and all(isinstance(d, int) for d in s) else None
