"""Constant folding of a Relax module in numpy, before Relax's own ``FoldConstant``.

Relax's ``FoldConstant`` evaluates a call on constants by legalizing the operator to a PrimFunc, building it
with LLVM and running it: 40-70 ms a call on a 2-core Intel Xeon (50 constant multiplies: 3.6 s), and its
build cache is keyed by the PrimFunc object, so every call builds again.  A model is lowered many times
(the graph stage prices one-operator models and whole candidates, the layout stage prices convs, the
compile builds the model), and Inception-v3's lowering spent 8 of its 10 s there: 94 bias reshapes at
import, 94 weight layout transforms after ConvertLayout.

The operators folded here are the ones weights and their parameters go through: shape changes
(reshape, permute_dims, expand_dims, squeeze, flatten, broadcast_to), ``layout_transform`` by an index map
that splits and reorders axes (the blocked conv weights), casts, concat and IEEE arithmetic (+ - * /, sqrt,
negation, maximum, minimum: each correctly rounded in float32 in numpy as in LLVM's code, so the folded
constant is the one ``FoldConstant`` computes), and the kernels' weight-packing copies
(:mod:`kerneltune.prepack`: a ``call_tir`` of a PrimFunc that only copies its input by such an index map;
ResNet-50's 21 of them cost ``FoldConstant`` 2.4 s of a 8.4 s whole-model compile, one LLVM build each).
Anything else (a padded layout transform, a Gather) is left to ``FoldConstant``, which runs after this and
finds only those.  Like ``FoldConstant``, a folded constant
replaces its uses in place (an operator that looks for a constant weight argument still sees one).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import relax, s_tir, tirx
from tvm.ir.prim import expr as prim
from tvm.relax.expr_functor import PyExprMutator, mutator

from pipeline.passes.relax_rewrite import rewrite_functions, static_shape

_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
    "relax.divide": np.divide, "relax.maximum": np.maximum, "relax.minimum": np.minimum,
}
_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relax.negative": np.negative, "relax.sqrt": np.sqrt,
    "relax.rsqrt": lambda x: np.ones((), x.dtype) / np.sqrt(x),  # TOPI's rsqrt is 1 / sqrt(x)
}
# pure shape changes: the row-major order is kept, the output's static shape says the rest
_RESHAPES = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten")


def _split_axes(index_map, shape: tuple[int, ...]) -> tuple[list[int], list[int]] | None:
    """The index map as a reshape that splits source axes (``i`` -> ``i // b, i % b``) and a transpose:
    (split shape, permutation), or None when it is anything else (a padded block, a fused axis)."""
    src = list(index_map.initial_indices)
    if len(src) != len(shape):
        return None
    pieces: list[list[tuple[str, int, int]]] = [[] for _ in src]  # per source axis: (kind, block, out dim)
    for d, e in enumerate(index_map.final_indices):
        if isinstance(e, prim.Var) and any(e.same_as(v) for v in src):
            kind, var, block = "whole", e, 0
        elif (isinstance(e, (prim.FloorDiv, prim.FloorMod)) and isinstance(e.a, prim.Var)
              and isinstance(e.b, prim.IntImm)):
            kind, var, block = ("outer" if isinstance(e, prim.FloorDiv) else "inner"), e.a, int(e.b.value)
        else:
            return None
        i = next((k for k, v in enumerate(src) if var.same_as(v)), None)
        if i is None:
            return None
        pieces[i].append((kind, block, d))
    split: list[int] = []
    order: list[int] = []  # output dim of each axis of the split shape
    for i, ps in enumerate(pieces):
        kinds = sorted(p[0] for p in ps)
        if kinds == ["whole"]:
            split.append(shape[i])
            order.append(ps[0][2])
        elif kinds == ["inner", "outer"] and ps[0][1] == ps[1][1] and shape[i] % ps[0][1] == 0:
            outer = next(p for p in ps if p[0] == "outer")
            inner = next(p for p in ps if p[0] == "inner")
            split += [shape[i] // outer[1], outer[1]]
            order += [outer[2], inner[2]]
        else:
            return None
    if sorted(order) != list(range(len(order))):
        return None
    return split, [order.index(d) for d in range(len(order))]


def _permuted(x: np.ndarray, index_map) -> np.ndarray | None:
    """``x`` rearranged by ``index_map`` when that splits and reorders its axes (see :func:`_split_axes`)."""
    plan = _split_axes(index_map, x.shape)
    return None if plan is None else np.transpose(x.reshape(plan[0]), plan[1])


def copy_map(func: tirx.PrimFunc):
    """The index map of a PrimFunc that only copies its first buffer into its second, ``dst[f(v)] = src[v]``
    over all of ``src`` (the weight-packing copies ``SplitLayoutRewritePreproc`` splits out), or None."""
    if len(func.params) != 2 or not isinstance(func.body, s_tir.SBlockRealize):
        return None
    src, dst = func.params  # TVM 0.27: a PrimFunc's parameters are its buffers
    stmt, loops = func.body.block.body, []
    while isinstance(stmt, tirx.For):
        if (stmt.kind != tirx.ForKind.SERIAL or not isinstance(stmt.min, tirx.IntImm) or stmt.min.value != 0
                or stmt.step is not None and not (isinstance(stmt.step, tirx.IntImm) and stmt.step.value == 1)):
            return None
        loops.append(stmt)
        stmt = stmt.body
    if not isinstance(stmt, s_tir.SBlockRealize):
        return None
    block, store = stmt.block, stmt.block.body
    if (not isinstance(store, tirx.BufferStore) or not store.buffer.same_as(dst)
            or not isinstance(store.value, tvm.ir.TensorLoad) or not store.value.source.same_as(src)
            or block.init is not None or block.alloc_buffers or block.match_buffers
            or not (isinstance(stmt.predicate, tirx.IntImm) and stmt.predicate.value == 1)):
        return None
    shape = [int(d) for d in src.shape] if all(isinstance(d, tirx.IntImm) for d in src.shape) else None
    variables = [iv.var for iv in block.iter_vars]
    whole = shape is not None and len(loops) == len(variables) == len(shape) and all(
        v.same_as(loop.loop_var) and isinstance(loop.extent, tirx.IntImm) and int(loop.extent) == n
        for v, loop, n in zip(stmt.iter_values, loops, shape))
    if not whole or not all(isinstance(i, tirx.Var) and i.same_as(v)
                            for i, v in zip(store.value.indices, variables)) or len(store.value.indices) != len(shape):
        return None
    return tirx.IndexMap(variables, list(store.indices), None)


def evaluate(call: relax.Call, args: list[np.ndarray], typed: relax.Expr | None = None,
             index_map=None) -> np.ndarray | None:
    """The value of ``call`` on constant ``args`` (see the module docstring), or None when it is not one of
    the operators folded here or the result would not have the call's static shape and dtype (those of
    ``typed``, the call before its arguments were replaced, when given: a new call has no type yet).
    ``index_map``: for a ``call_tir``, its kernel's :func:`copy_map`."""
    name = call.op.name
    typed = call if typed is None else typed
    out_shape, dtype = static_shape(typed), str(getattr(typed.ty, "dtype", ""))
    if out_shape is None or not dtype:
        return None
    x = args[0]
    if name in _BINARY:
        if len(args) != 2 or not (x.dtype == args[1].dtype == np.dtype(dtype)):
            return None
        if name == "relax.divide" and x.dtype.kind != "f":
            return None  # Relax's integer division is not numpy's true division
        with np.errstate(all="ignore"):
            value = _BINARY[name](x, args[1])
    elif name in _UNARY:
        if x.dtype.kind != "f" or x.dtype != np.dtype(dtype):
            return None
        with np.errstate(all="ignore"):
            value = _UNARY[name](x)
    elif name in _RESHAPES:
        value = x.reshape(out_shape) if x.size == int(np.prod(out_shape)) else None
    elif name == "relax.broadcast_to":
        value = np.broadcast_to(x, out_shape)
    elif name == "relax.permute_dims":
        axes = call.attrs.axes
        value = np.transpose(x, None if axes is None else [int(a) for a in axes])
    elif name == "relax.astype":
        value = x.astype(dtype)
    elif name == "relax.concat":
        value = np.concatenate(args, axis=int(call.attrs.axis)) if all(a.ndim for a in args) else None
    elif name == "relax.layout_transform":
        if call.attrs.pad_value is not None:
            return None
        value = _permuted(x, call.attrs.index_map)
    elif name == "relax.call_tir":
        value = None if index_map is None or len(args) != 1 else _permuted(x, index_map)
    else:
        return None
    if value is None or tuple(value.shape) != out_shape or value.dtype != np.dtype(dtype):
        return None
    return value  # possibly a view of an argument: the caller copies it into the constant


def _array(const: relax.Expr) -> np.ndarray:
    """A constant's value as numpy, without a copy where DLPack allows (VGG-19's 400 MB of classifier
    weights were copied out once per fold)."""
    try:
        return np.from_dlpack(const.value)
    except (TypeError, ValueError, RuntimeError, BufferError):
        return const.value.numpy()


# Rows of a transposed matrix's source copied at a time (see _to_tensor).
TRANSPOSE_BLOCK = 256


def _to_tensor(value: np.ndarray) -> tvm.runtime.Tensor:
    """``value`` (possibly a strided view) copied once, into a new TVM tensor.  A transposed matrix is copied
    in blocks of its source's rows: copied whole, or row by row of the result, it reads memory across the
    grain (VGG-19's 4096 x 25088 classifier weight: 0.84-0.96 s that way, 0.38 s in blocks)."""
    out = tvm.runtime.empty(value.shape, str(value.dtype), tvm.cpu())
    view = np.from_dlpack(out)
    if value.ndim == 2 and value.flags.f_contiguous and not value.flags.c_contiguous:
        src = value.T  # C-contiguous: a block of its rows is a block of the result's columns
        for i in range(0, src.shape[0], TRANSPOSE_BLOCK):
            view[:, i:i + TRANSPOSE_BLOCK] = src[i:i + TRANSPOSE_BLOCK].T
    else:
        np.copyto(view, value)
    return out


@mutator
class _Folder(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.left = 0  # calls on constants not folded here (for FoldConstant)

    def _constant(self, expr: relax.Expr) -> relax.Expr:
        """``expr``, or the constant it is bound to (so uses see the constant, as after FoldConstant)."""
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if isinstance(bound, tvm.ir.expr.GenericConst):
                return bound
        return expr

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        typed = call
        args = [self._constant(a) for a in call.args]
        if any(not a.same_as(b) for a, b in zip(args, call.args)):
            call = relax.Call(call.op, args, call.attrs, call.ty_args, call.span)
        # the tensors among the arguments (not shapes, dtypes, strings or scalars given as arguments)
        tensors = [a for a in args if isinstance(a, (relax.Var, relax.Tuple, tvm.ir.expr.GenericConst))]
        if call.op.name in ("relax.concat", "relax.call_tir") and isinstance(args[-1], relax.Tuple):
            tensors = [self._constant(f) for f in args[-1].fields]  # the concatenated / the kernel's inputs
        if not tensors or not all(isinstance(a, tvm.ir.expr.GenericConst) for a in tensors):
            return call
        index_map = None
        if call.op.name == "relax.call_tir":
            kernel = self.builder_.get()[args[0]] if isinstance(args[0], relax.GlobalVar) else None
            index_map = copy_map(kernel) if isinstance(kernel, tirx.PrimFunc) else None
            if index_map is None:
                self.left += 1
                return call
        value = evaluate(call, [_array(a) for a in tensors], typed, index_map)
        if value is None:
            self.left += 1
            return call
        return relax.const(_to_tensor(value))


def fold_numpy(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """``mod`` with the calls on constants that numpy can evaluate (see the module docstring) folded and the
    bindings left dead removed; and how many calls on constants are left (not folded here)."""
    folder = _Folder(mod)
    folded = rewrite_functions(mod, lambda _mod: folder)  # the folder kept: it counts what it left
    return relax.transform.DeadCodeElimination()(folded), folder.left


def fold_constants(mod: tvm.IRModule) -> tvm.IRModule:
    """Every call on constants folded: numpy's first, then Relax's ``FoldConstant`` for the rest, if any (it
    costs 0.4-0.6 s on Inception-v3 even with nothing left to fold)."""
    mod, left = fold_numpy(mod)
    if not left:
        return mod
    return tvm.transform.Sequential([relax.transform.FoldConstant(), relax.transform.DeadCodeElimination()])(mod)


@tvm.transform.module_pass(opt_level=0, name="FoldConstants")
def FoldConstants(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - named as TVM names its passes
    """:func:`fold_constants` as a pass, for a pass sequence."""
    return fold_constants(mod)
