"""ConstantOfShape with an empty shape: a scalar constant, written as a weight.

TorchScript exports of Hugging Face models build scalars this way (``ConstantOfShape(shape=[])`` with a
one-element ``value``, e.g. the fill value of an attention mask).  The output's shape is fixed by the
shape input's *length* (zero), not by its values, so the output is always the scalar ``value[0]`` whatever
computed the shape: the node folds into a weight.  TVM's converter fails on exactly this case (it broadcasts
the 1-element value to a rank-0 shape); a non-empty shape is left to the backend.
"""
from __future__ import annotations

import numpy as np

from graphopt.ir import Node
from graphopt.legalize.registry import register
from graphopt.legalize.builder import Builder


@register("ConstantOfShape")
def lower_scalar_constant_of_shape(node: Node, b: Builder) -> dict[str, str] | None:
    if b.graph.shape(node.inputs[0]) != (0,):
        return None
    value = node.attr("value")
    scalar = np.asarray(value).reshape(()) if value is not None else np.zeros((), np.float32)
    out = node.outputs[0]
    if out in b.graph.output_names:  # a graph output keeps a producing node
        return {out: b.const(scalar, hint="scalar")}
    b.graph.initializers[out] = scalar
    return {}
