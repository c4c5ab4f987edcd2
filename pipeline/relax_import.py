"""ONNX -> TVM Relax, with static shapes and the weights bound as constants.

Weights become constants (``keep_params_in_input=False``) so FoldConstant can pre-compute weight-only
expressions and the fused kernels see fixed shapes; every input dimension must be known, because the
schedules and the tuning records are per shape.  The graph IR import runs alongside: it validates the file,
dtypes and shapes with one-line errors, and is what :mod:`graphopt.feeds` needs to draw valid inputs.

Operators TVM's importer lacks (LSTM, GRU, RNN, ReverseSequence) or mishandles (a scalar ConstantOfShape)
are first rewritten into primitive ops (:func:`pipeline.frontend.legalize_for_tvm`); only what is still
unsupported after that is an error, one line naming the operators.
"""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass

import onnx
import tvm

from graphopt.errors import UserError
from graphopt.ir import Graph
from graphopt.onnx_io import InputShapes, apply_input_shapes, export_onnx, import_onnx, load_model
from pipeline.frontend import legalize_for_tvm

# What the frontend raises for a model it cannot convert: TVM 0.27 has no tvm.error.TVMError; C++ failures
# arrive through tvm_ffi as RuntimeError subclasses (tvm.error.InternalError, OpError, DiagnosticError) or
# as the Python type their error kind names (ValueError, TypeError, AttributeError, KeyError, IndexError,
# AssertionError); the converters themselves raise the same Python types.
FRONTEND_ERRORS = (RuntimeError, ValueError, TypeError, AttributeError, KeyError, IndexError, AssertionError)


@dataclass
class ImportedModel:
    """The model in both forms the pipeline needs: ONNX proto + graph IR (reference runs) and Relax.

    ``onnx_model`` is the model as given (what onnxruntime runs); ``graph`` is legalized for TVM, with the
    same inputs and outputs.
    """

    onnx_model: onnx.ModelProto
    graph: Graph
    mod: tvm.IRModule
    converted: onnx.ModelProto | None = None  # what TVM's importer converted into ``mod`` (static, legalized)

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
        # The importer prints "Error converting operator ..." with the whole Relax input before raising: the
        # one-line error below says it, so its print is dropped.
        with contextlib.redirect_stdout(io.StringIO()):
            return from_onnx(model, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
    except tvm.error.OpNotImplemented as exc:
        msg = str(exc).strip().splitlines()[0]
        raise UserError(f"{msg}; TVM's ONNX importer cannot compile this model - replace those operators "
                        "in the exporting framework (or export with another opset)") from None
    except FRONTEND_ERRORS as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"TVM's ONNX importer rejected the model ({type(exc).__name__}: {first}); check the "
                        "operators and dtypes it uses, or pass --input-shape for dynamic inputs") from None


def import_model(source: str | os.PathLike | onnx.ModelProto,
                 input_shapes: InputShapes | None = None) -> ImportedModel:
    """Load, validate and convert an ONNX model (path or proto) with static input shapes."""
    model = source if isinstance(source, onnx.ModelProto) else load_model(source)
    graph = import_onnx(model, input_shapes, require_static=True)
    legal = legalize_for_tvm(graph)
    if input_shapes:
        # from_onnx reads shapes from shape_dict, but keep the proto consistent for onnxruntime as well.
        model = onnx.ModelProto.FromString(model.SerializeToString())
        apply_input_shapes(model, input_shapes)
    # onnxruntime keeps running the model as given (its own LSTM kernel is the reference and the baseline);
    # TVM converts the legalized graph.
    frontend_model = export_onnx(legal.graph) if legal.changed else model
    return ImportedModel(model, legal.graph, to_relax(frontend_model, legal.graph), frontend_model)
