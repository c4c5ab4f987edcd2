"""A small helper for writing ONNX graphs by hand with seeded random weights.

Every benchmark builder uses it so the models look alike where it matters (unique readable tensor names,
weights as initializers, one opset) and differ only in architecture.  Weights are drawn with the scale a
trained network has (He init for convolutions, N(0, 0.02) for transformers), so activations stay O(1)
through deep stacks: the optimizer's numerical checks compare outputs with absolute tolerances, and
exploding activations would make those comparisons meaningless.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class GraphBuilder:
    """Accumulates nodes, weights, inputs and outputs, then produces a checked ``onnx.ModelProto``."""

    def __init__(self, name: str, seed: int = 0, opset: int = 17):
        self.name = name
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()
        self._counts: dict[str, int] = {}

    # ---- names -----------------------------------------------------------------------------------------
    def _unique(self, base: str) -> str:
        name, k = base, 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    # ---- graph interface ------------------------------------------------------------------------------
    def input(self, name: str, shape: Sequence[int | str], dtype: int = TensorProto.FLOAT) -> str:
        name = self._unique(name)
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def output(self, tensor: str, shape: Sequence[int | str] | None = None, dtype: int = TensorProto.FLOAT) -> None:
        self.outputs.append(helper.make_tensor_value_info(tensor, dtype, None if shape is None else list(shape)))

    # ---- weights --------------------------------------------------------------------------------------
    def const(self, name: str, value: np.ndarray | float | int | Sequence[Any], dtype: Any = None) -> str:
        """A fixed initializer (shape vectors, scalars such as sqrt(d)); returns its tensor name."""
        arr = np.asarray(value, dtype=dtype)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        name = self._unique(name)
        self.initializers.append(numpy_helper.from_array(arr, name))
        return name

    def normal(self, name: str, shape: Sequence[int], std: float, mean: float = 0.0) -> str:
        """A random float32 weight N(mean, std^2)."""
        arr = (self.rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(std) + np.float32(mean))
        return self.const(name, arr)

    def he(self, name: str, shape: Sequence[int], fan_in: int, gain: float = 1.0) -> str:
        """He-normal weight for a layer followed by ReLU (keeps activation variance roughly constant)."""
        return self.normal(name, shape, gain * float(np.sqrt(2.0 / fan_in)))

    # ---- nodes ----------------------------------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str], name: str | None = None, out: str | None = None,
           **attrs: Any) -> str:
        """Append a node named like a torch export (``/path/Op``); returns its output tensor name.

        ``out`` names the output explicitly, for tensors that become graph outputs.
        """
        base = name or op_type
        k = self._counts.get(base, 0)
        self._counts[base] = k + 1
        node_name = self._unique(f"/{base}" if k == 0 else f"/{base}_{k}")
        output = self._unique(out or f"{node_name}_output_0")
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=node_name, **attrs))
        return output

    # ---- result ---------------------------------------------------------------------------------------
    def model(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="optimize-model.models", doc_string=doc)
        model.ir_version = 8
        # full_check runs strict shape inference: a wiring or shape mistake in a builder fails here.  The
        # inferred value_info is not kept, like a plain torch export (importers infer it themselves).
        onnx.checker.check_model(model, full_check=True)
        return model
