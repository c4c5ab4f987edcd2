"""ONNX -> TVM Relax, with static shapes and the weights bound as constants.

Weights become constants (``keep_params_in_input=False``) so FoldConstant can pre-compute weight-only
expressions and the fused kernels see fixed shapes; every input dimension must be known, because the
schedules and the tuning records are per shape.  The graph IR import runs alongside: it validates the file,
dtypes and shapes with one-line errors, and is what :mod:`graphopt.feeds` needs to draw valid inputs.

Operators TVM's importer lacks (LSTM, GRU, RNN, ReverseSequence) or mishandles (a scalar ConstantOfShape)
are first rewritten into primitive ops (:func:`pipeline.frontend.legalize_for_tvm`); only what is still
unsupported after that is an error, one line naming the operators.

Then constants are folded (weights the graph computes, such as an unrolled GRU's transposed gate weights,
become constants) and a few rewrites of the Relax module run (:func:`import_rewrites`): integer division by a tensor never divides by
zero in the compiled code (the CPU's divide instruction traps, and SIGFPE kills the whole process without a
message; onnxruntime raises), small constant powers become products (``power`` is a scalar libm call per
element), and constant weights whose columns (a head conv's output channels) do not split into whole vectors
get padded.
"""
from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from graphopt.errors import UserError
from graphopt.ir import Graph
from graphopt.onnx_io import InputShapes, apply_input_shapes, export_onnx, import_onnx, load_model, subgraphs
from kerneltune.templates import winograd_nchwc
from kerneltune.templates.cpu import vector_padding, weight_padding
from kerneltune.native_log import quiet_native_stderr
from kerneltune.machine_gate import serial
from pipeline.passes.fold import fold_constants
from pipeline.frontend import legalize_for_tvm
from pipeline.passes.int8 import Lowering, integer_compute
from pipeline.passes.provenance import tag_normalized, tagged_import
from pipeline.passes.sink_slices import MIN_KEPT, sink_padding_slices
from pipeline.symbolic import Served, bound, symbolic_model

log = logging.getLogger(__name__)

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


def to_relax(model: onnx.ModelProto, graph: Graph, symbolic: bool = False, fix: str | None = None,
             int8: Lowering = Lowering()) -> tvm.IRModule:
    """Convert with the input shapes the graph IR fixed (``symbolic``: with the shapes ``model`` declares, its
    named dimensions kept as TIR variables); unsupported operators become a UserError (``fix``: what it says
    the user can do about a rejected model, instead of the general advice).  ``int8``: what the target's int8
    kernels can use (:func:`pipeline.passes.int8.lowering_for`)."""
    from tvm.relax.frontend.onnx import from_onnx

    shapes = None if symbolic else {i.name: [int(d) for d in i.shape] for i in graph.inputs  # type: ignore[union-attr]
                                    if i.name not in graph.initializers}
    dtypes = {i.name: i.dtype for i in graph.inputs if i.name not in graph.initializers}
    unresolved = _unresolved_read(model.graph, set())
    if unresolved:
        node, name = unresolved
        raise UserError(f"{node.op_type} node {node.name!r} reads {name!r}, which no enclosing graph defines before "
                        "it, so TVM's ONNX importer cannot convert the model: check it with "
                        "onnx.checker.check_model(model, full_check=True) and re-export it")
    problem = ""
    with importer_output() as printed, _checked_already(), tagged_import(model):
        try:
            mod = from_onnx(model, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
        except tvm.error.OpNotImplemented as exc:
            problem = (f"{str(exc).strip().splitlines()[0]}; TVM's ONNX importer cannot compile this model - "
                       "replace those operators in the exporting framework (or export with another opset)")
        except FRONTEND_ERRORS as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            failed = re.search(r"^Error converting operator (\w+)", printed.getvalue(), re.MULTILINE)
            where = f" at its {failed.group(1)} node" if failed else ""
            problem = (f"TVM's ONNX importer rejected the model{where} ({type(exc).__name__}: {first}); "
                       + (fix or "check the operators and dtypes it uses, or pass --input-shape for dynamic inputs"))
        if problem:
            gc.collect()  # the failed conversion's BlockBuilder (its frames, in a cycle) is destroyed in here
    if problem:
        raise UserError(problem)  # raised out here, no exception context keeps the importer's frames alive
    # constants computed in the graph (an unrolled GRU's weights: a transpose of a Gather of an initializer)
    # become constants first, so that the rewrites see them (the weight padding)
    # before folding: the int8 weights are still int8 (pipeline.passes.int8)
    mod = integer_compute(mod, int8)
    with quiet_native_stderr():
        mod = fold_constants(mod)
    # the convolutions the graph stage chose the Winograd kernel for (graphopt.winograd.mark), by their
    # weights' bytes: Relax constants have no names (the layout stage lowers them, pipeline.layout.nchwc)
    marks = {winograd_nchwc.weight_digest(graph.initializers[w]): m for w, m in graph.winograd.items()
             if w in graph.initializers}
    return winograd_nchwc.with_marks(sink_padding_slices(import_rewrites(mod)), marks)


def _unresolved_read(g: onnx.GraphProto, visible: set[str]) -> tuple[onnx.NodeProto, str] | None:
    """The first node of ``g`` (or of a body, at any depth) that reads a tensor no enclosing scope defines
    before it, and that name; None when every read resolves (``visible``: what the enclosing scopes define).
    Why: TVM's importer looks a body's reads up in a dictionary and hands a converter None for a name it
    lacks, and some converters (Concat) dereference it: SIGSEGV, the process gone without a message.  A model
    onnx.checker's full check passed always resolves; a graph built from one node of a model (the graph
    stage prices an If alone) may not."""
    scope = visible | {i.name for i in g.input} | {t.name for t in g.initializer}
    for n in g.node:
        missing = next((t for t in n.input if t and t not in scope), None)
        if missing is not None:
            return n, missing
        for body in subgraphs(n):
            found = _unresolved_read(body, scope)
            if found:
                return found
        scope.update(o for o in n.output if o)
    return None


@contextlib.contextmanager
def _checked_already() -> Iterator[None]:
    """TVM's importer without its ``onnx.checker.check_model`` call, which only warns: the user's model had
    the checker's full check when the command started (:func:`graphopt.validate.check_model`), and what is
    imported here is that model or our export of its graph.  The checker serializes every weight (2 of the
    5.6 s VGG-19's import took), and the graph stage imports a model for every operator and candidate it
    prices."""
    check = onnx.checker.check_model
    onnx.checker.check_model = lambda *args, **kwargs: None
    try:
        yield
    finally:
        onnx.checker.check_model = check


@contextlib.contextmanager
def importer_output() -> Iterator[io.StringIO]:
    """What TVM's ONNX importer writes, out of the user's way: its Python warnings ("Renaming name input.1
    to input_1", the ONNX checker's complaints) logged at -v, its stdout (before a failure, "Error
    converting operator OP" and the whole Relax input) captured in the buffer it yields, and its native log
    lines ("BlockBuilder destroyed with remaining blocks!" after every If or failed conversion) silenced.
    Both redirections are the process's: the import holds TVM's Python-side lock (builds side by side:
    :func:`kerneltune.machine_gate.serial`)."""
    printed = io.StringIO()
    with serial(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with contextlib.redirect_stdout(printed), quiet_native_stderr():
                yield printed
        finally:
            for w in caught:
                log.info("TVM's ONNX importer: %s", " ".join(str(w.message).split())[:300])


def _nonzero_divisor(call: relax.Call, builder) -> relax.Expr | None:
    """An integer Div/Mod by a non-constant tensor divides by 1 where the divisor is 0 (the dividend, or 0
    for Mod, where onnxruntime raises): a zero divisor must not kill the process with SIGFPE, whether it
    comes from a random check input, the cost model's timing inputs or a deployed model's caller.  One
    compare and select per element, fused into the division's kernel."""
    divisor = call.args[1]
    dtype = str(getattr(divisor.ty, "dtype", ""))
    if not dtype.startswith(("int", "uint")) or isinstance(divisor, tvm.ir.Constant):
        return None  # floats do not trap; a constant divisor with a 0 is refused by the importer
    safe = relax.op.where(relax.op.equal(divisor, relax.const(0, dtype)), relax.const(1, dtype), divisor)
    return relax.Call(call.op, [call.args[0], safe], call.attrs)


def _small_power(call: relax.Call, builder) -> relax.Expr | None:
    """``x ** 2`` and ``x ** 3`` (a float tensor, a constant exponent) as products: TVM lowers ``power`` to a
    scalar ``powf`` call per element, which no vectorizer crosses.  GPT-2's tanh-GELU computes ``x ** 3`` on
    every MLP activation: its fused elementwise kernel took 4 ms per layer (128 x 3072 floats)."""
    x, exponent = call.args
    if not isinstance(exponent, tvm.ir.Constant) or not str(getattr(x.ty, "dtype", "")).startswith("float"):
        return None
    values = exponent.value.numpy().ravel()
    if values.size != 1 or float(values[0]) not in (2.0, 3.0):
        return None
    out = relax.op.multiply(x, x)
    return relax.op.multiply(out, x) if float(values[0]) == 3.0 else out


def _padded_weight(call: relax.Call, builder) -> relax.Expr | None:
    """A matmul by a constant weight whose columns do not split into whole vectors (GPT-2's 768 x 50257 LM
    head, an LSTM's 2600 gate columns) multiplies by the weight padded with zero columns, then drops them: the kernel's vector axis then splits
    into whole vectors (:func:`kerneltune.templates.cpu.weight_padding`); the slice is one copy of the output."""
    w = call.args[1]
    if not isinstance(w, tvm.ir.Constant) or len(w.value.shape) != 2 or not str(w.value.dtype).startswith("float"):
        return None
    n = int(w.value.shape[1])
    wide = weight_padding(n)
    if wide is None:
        return None
    padded = np.pad(w.value.numpy(), ((0, 0), (0, wide - n)))
    y = builder.emit(tag_normalized(builder, relax.op.matmul(call.args[0], relax.const(padded),
                                                             out_dtype=call.attrs.out_dtype), call.span))
    # the last axis by its index: TOPI's slice of a symbolic shape takes no negative axis (GPT-2 served)
    return relax.op.strided_slice(y, axes=[int(call.ty.ndim) - 1], begin=[0], end=[n])


def _padded_conv(call: relax.Call, builder, heads: set[int]) -> relax.Expr | None:
    """A conv whose output channels do not split into whole vectors computes zero-weight channels up to a
    vector multiple, then drops them with a slice that :mod:`pipeline.passes.sink_slices` moves down the graph.

    * A head conv (one whose output reaches no other conv: SqueezeNet's 1000-class classifier) is padded to
      :func:`kerneltune.templates.cpu.weight_padding`'s count.  1000 channels ran in 8-channel blocks, half
      an AVX-512 register: 512->1000 at 13x13, 1.23 ms in SqueezeNet 1.1 on an Intel Xeon (2 threads); as
      1024 channels, 0.79 ms alone (1008: 0.94).
    * Any other conv only when its channels have no divisor of half a vector or more
      (:func:`~kerneltune.templates.cpu.vector_padding`) and the padding is a padding slice
      (:data:`pipeline.passes.sink_slices.MIN_KEPT`): ShuffleNet-v2's 58 and 116 channels (blocks of 2 and 4, or
      register tiles of 2 and 4 filters in NCHW) become 64 and 128.  The slice then moves down through the
      bias and activation, through a depthwise conv (padded too) and into the next conv, which reads the
      zero channels with zero weights; where it stops (a concat), it fuses into that kernel.  58 -> 58 1x1 at
      28x28 alone, Intel Xeon, 2 threads: 47.6 us; 58 -> 64: 27.8 us."""
    w = call.args[1]
    a = call.attrs
    if (not isinstance(w, tvm.ir.Constant) or len(w.value.shape) != 4
            or int(a.groups) != 1 or a.data_layout != "NCHW" or a.kernel_layout != "OIHW"
            or a.out_layout not in ("", "NCHW") or not str(w.value.dtype).startswith("float")):
        return None
    o = int(w.value.shape[0])
    if w.__chandle__() in heads:
        wide = weight_padding(o)
    else:
        wide = vector_padding(o)
        if wide is not None and o < MIN_KEPT * wide:
            wide = None
    if wide is None:
        return None
    padded = np.pad(w.value.numpy(), ((0, wide - o), (0, 0), (0, 0), (0, 0)))
    y = builder.emit(relax.Call(call.op, [call.args[0], relax.const(padded)], call.attrs, call.ty_args, call.span))
    return relax.op.strided_slice(y, axes=[1], begin=[0], end=[o])


def head_conv_weights(func: relax.Function) -> set[int]:
    """Handles of the weight constants of the convs in ``func`` whose output flows into no other conv."""
    blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
    bindings = [b for block in blocks for b in block.bindings if isinstance(b, relax.VarBinding)]
    feeds_conv: set[relax.Var] = set()
    heads: set[int] = set()
    for b in reversed(bindings):
        conv = isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op) \
            and b.value.op.name == "relax.nn.conv2d"
        if conv and b.var not in feeds_conv and isinstance(b.value.args[1], tvm.ir.Constant):
            heads.add(b.value.args[1].__chandle__())
        if conv or b.var in feeds_conv:
            feeds_conv.update(relax.analysis.free_vars(b.value))
    return heads


# Relax op -> its rewrite (None: left as it is).  Divisions: ONNX Div (truncating) and Mod (fmod 0: floor,
# 1: truncating).
_REWRITES = {"relax.divide": _nonzero_divisor, "relax.floor_divide": _nonzero_divisor,
             "relax.mod": _nonzero_divisor, "relax.floor_mod": _nonzero_divisor,
             "relax.power": _small_power, "relax.matmul": _padded_weight}


@mutator
class _ImportRewrites(PyExprMutator):
    heads: set[int] = set()  # the function's head convs' weights (head_conv_weights), set per function

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        call = super().visit_call_(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else None
        if name == "relax.nn.conv2d":
            out = _padded_conv(call, self.builder_, self.heads)
        else:
            rewrite = _REWRITES.get(name)
            out = rewrite(call, self.builder_) if rewrite is not None else None
        return call if out is None else tag_normalized(self.builder_, out, call.span)  # the same ONNX node


def import_rewrites(mod: tvm.IRModule) -> tvm.IRModule:
    """Every Relax function of ``mod`` with the rewrites of :data:`_REWRITES` applied, in one traversal."""
    rewriter = _ImportRewrites(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.heads = head_conv_weights(func)
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    return rewriter.builder_.get()


def import_model(source: str | os.PathLike | onnx.ModelProto, input_shapes: InputShapes | None = None,
                 served: Served | None = None, int8: Lowering = Lowering()) -> ImportedModel:
    """Load, validate and convert an ONNX model (path or proto) with static input shapes; with ``served``, the
    dimensions it names stay symbolic in the Relax module (bounded by their ranges: :mod:`pipeline.symbolic`)
    and the graph IR is the model at the representative sizes (``input_shapes``).  ``int8``: as :func:`to_relax`'s."""
    model = source if isinstance(source, onnx.ModelProto) else load_model(source)
    graph = import_onnx(model, input_shapes, require_static=True)
    legal = legalize_for_tvm(graph)
    if served is not None:
        if legal.lowered:
            raise UserError(f"{', '.join(sorted(set(legal.lowered)))} cannot keep a symbolic size in TVM (they are "
                            f"unrolled at one size): build for one size, e.g. --dim "
                            f"{next(iter(served.ranges))}={next(iter(served.at.values()))}")
        symbolic = symbolic_model(model, input_shapes or {}, served)
        fixed = onnx.ModelProto.FromString(model.SerializeToString())
        apply_input_shapes(fixed, input_shapes or {})
        name, size = next(iter(served.at.items()))
        fix = (f"it cannot keep {', '.join(served.ranges)} symbolic in this model: build for one size, e.g. "
               f"--dim {name}={size}")
        relax_mod = to_relax(symbolic, graph, symbolic=True, fix=fix, int8=int8)
        return ImportedModel(fixed, graph, bound(relax_mod, served), symbolic)
    if input_shapes:
        # from_onnx reads shapes from shape_dict, but keep the proto consistent for onnxruntime as well.
        model = onnx.ModelProto.FromString(model.SerializeToString())
        apply_input_shapes(model, input_shapes)
    # onnxruntime keeps running the model as given (its own LSTM kernel is the reference and the baseline);
    # TVM converts the legalized graph.
    frontend_model = export_onnx(legal.graph) if legal.changed else model
    relax_mod = to_relax(frontend_model, legal.graph, int8=int8)
    return ImportedModel(model, legal.graph, relax_mod, frontend_model)
