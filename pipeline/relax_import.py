"""ONNX -> TVM Relax, with static shapes and the weights bound as constants.

Weights become constants (``keep_params_in_input=False``) so FoldConstant can pre-compute weight-only
expressions and the fused kernels see fixed shapes; every input dimension must be known, because the
schedules and the tuning records are per shape.  The graph IR import runs alongside: it validates the file,
dtypes and shapes with one-line errors, and is what :mod:`graphopt.feeds` needs to draw valid inputs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import onnx
import tvm

from graphopt.errors import UserError
from graphopt.ir import Graph
from graphopt.onnx_io import InputShapes, import_onnx, load_model


@dataclass
class ImportedModel:
    """The model in both forms the pipeline needs: ONNX proto + graph IR (reference runs) and Relax."""

    onnx_model: onnx.ModelProto
    graph: Graph
    mod: tvm.IRModule

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.graph.inputs if i.name not in self.graph.initializers]


def to_relax(model: onnx.ModelProto, graph: Graph) -> tvm.IRModule:
    """Convert with the input shapes the graph IR fixed; unsupported operators become a UserError."""
    from tvm.relax.frontend.onnx import from_onnx

    shapes = {i.name: [int(d) for d in i.shape] for i in graph.inputs  # type: ignore[union-attr]
              if i.name not in graph.initializers}
    dtypes = {i.name: i.dtype for i in graph.inputs if i.name not in graph.initializers}
    try:
        return from_onnx(model, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
    except tvm.error.OpNotImplemented as exc:
        msg = str(exc).strip().splitlines()[0]
        raise UserError(f"{msg}; TVM's ONNX importer cannot compile this model - replace those operators "
                        "in the exporting framework (or export with another opset)") from None
    except (tvm.error.TVMError, ValueError, KeyError, NotImplementedError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"TVM's ONNX importer rejected the model ({type(exc).__name__}: {first}); check the "
                        "operators and dtypes it uses, or pass --input-shape for dynamic inputs") from None


def import_model(source: str | os.PathLike | onnx.ModelProto,
                 input_shapes: InputShapes | None = None) -> ImportedModel:
    """Load, validate and convert an ONNX model (path or proto) with static input shapes."""
    model = source if isinstance(source, onnx.ModelProto) else load_model(source)
    graph = import_onnx(model, input_shapes, require_static=True)
    if input_shapes:
        # from_onnx reads shapes from shape_dict, but keep the proto consistent for onnxruntime as well.
        model = onnx.ModelProto.FromString(model.SerializeToString())
        for inp in model.graph.input:
            if inp.name in input_shapes:
                dims = inp.type.tensor_type.shape.dim
                del dims[:]
                for d in input_shapes[inp.name]:
                    dims.add().dim_value = d
    return ImportedModel(model, graph, to_relax(model, graph))
