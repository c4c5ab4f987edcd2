"""Softmax over a row no vector width divides: each pass split into whole vectors and a scalar tail.

A CPU runs a softmax's two row reductions (max, then the sum of exponentials) fast only as vector partial
results (:class:`pipeline.cpu_rules.RowReduction` splits them into 16-lane partial maxima and sums), and
that split needs whole vectors: over a row such as ViT's 197 tokens it falls past the row's end, TVM's
``rfactor`` cannot take the mask, and each reduction stayed one dependent scalar chain (the FP unit's
latency per element), the exponentials scalar too.  Padding the row with -inf inside the kernel instead
put an ``if_then_else`` in every vector loop, which TVM's vectorizer scalarizes (0.90 ms, no gain).

So the row is cut at its last whole vector (197 = 192 + 5): the max, the exponentials and the sum each run
as one vectorized pass over the body and a scalar pass over the tail, combined per row; the normalization
multiplies by the sum's reciprocal (one division per row; LLVM vectorizes that last loop).  Intel Xeon
(AVX-512), 2 threads, 12 x 197 x 197: 0.91 ms before, 0.36 ms.  The same arithmetic as TOPI's
``fast_softmax`` (which FastMathTransform would have chosen), in another order: within ~1e-7 of it.
Rows that a vector width already divides, and rows of at most one vector, are left alone; a symbolic row (a
build serving a range of lengths) is always split (:func:`split_softmax`).
"""
from __future__ import annotations

import tvm
from tvm import relax, te, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from pipeline.passes.relax_rewrite import is_op, rewrite_functions

# A multiple of every x86 vector width (8 fp32 lanes with AVX2, 16 with AVX-512), as the CPU template's
# VECTOR_PAD: the kernel is the same whatever the target.
ROW_MULTIPLE = 16


def split_row(row: int) -> bool:
    """Whether a softmax over ``row`` columns is split into vector body and tail."""
    return row > ROW_MULTIPLE and row % ROW_MULTIPLE != 0


def split_softmax(x: te.Tensor, nan_to_zero: bool = False) -> te.Tensor:
    """softmax(x) along the last axis, each pass split into whole vectors and a scalar tail; with
    ``nan_to_zero``, ``where(isnan(s), 0, s)`` of it (:func:`_nan_guards`), in the same write.

    A symbolic row (a build serving a range of lengths, :mod:`pipeline.symbolic`) is split at ``n // 16 * 16``,
    a multiple of the vector width TVM proves, so the body reduces in whole vectors at every length.  Its body
    or its tail can then be empty (fewer than 16 columns; a multiple of 16), and an empty reduction loop never
    runs its init: such a part's maximum and sum are taken as the lowest float and 0 by a select on its extent.
    Served BERT-base at 384 tokens (Intel Xeon, 2 threads): its 12 softmaxes 28.8 -> 18.7 ms of a 292 ms run."""
    row = x.shape[-1]
    rows = tuple(x.shape[:-1])
    symbolic = not isinstance(row, tvm.tirx.IntImm)
    if symbolic:
        body = tvm.tirx.floordiv(row, ROW_MULTIPLE) * ROW_MULTIPLE
    else:
        body = (int(row) // ROW_MULTIPLE) * ROW_MULTIPLE
    tail = row - body

    def part(extent, value, empty):  # a reduced part's value; ``empty`` where its loop did not run
        return tvm.tirx.Select(extent > 0, value, empty) if symbolic else value

    lowest, zero = tvm.tirx.min_value(x.dtype), tvm.tirx.const(0.0, x.dtype)  # te.max's and te.sum's identities
    # reductions from 0 (dlight normalizes zero-based loops only)
    k, t = te.reduce_axis((0, body), name="k"), te.reduce_axis((0, tail), name="t")
    top_body = te.compute(rows, lambda *r: te.max(x(*r, k), axis=k), name="lane_max_body")
    top_tail = te.compute(rows, lambda *r: te.max(x(*r, body + t), axis=t), name="lane_max_tail")
    top = te.compute(rows, lambda *r: tvm.tirx.max(part(body, top_body(*r), lowest), part(tail, top_tail(*r), lowest)),
                     name="lane_max")
    j, u = te.reduce_axis((0, body), name="j"), te.reduce_axis((0, tail), name="u")
    if symbolic:
        # one buffer of exponentials over the whole row, summed in its two parts: the normalization then reads
        # it straight, where a select between the body's and the tail's buffers (clamped indices) kept that
        # pass scalar.  MiniLM's 12 x n x n scores alone (2 threads): 25% faster at 8 tokens, 14% at 77, equal
        # at 128 and 384.  A static row keeps two buffers: its exponentials vectorize only over the body.
        ex = topi.fast_exp(te.compute(x.shape, lambda *i: x(*i) - top(*i[:-1]), name="lane_delta"))
        total_body = te.compute(rows, lambda *r: te.sum(ex(*r, j), axis=j), name="lane_sum_body")
        total_tail = te.compute(rows, lambda *r: te.sum(ex(*r, body + u), axis=u), name="lane_sum_tail")
        exp_at = ex
    else:
        exp_body = topi.fast_exp(te.compute((*rows, body), lambda *i: x(*i) - top(*i[:-1]), name="lane_delta_body"))
        exp_tail = topi.fast_exp(te.compute((*rows, tail), lambda *i: x(*i[:-1], body + i[-1]) - top(*i[:-1]),
                                            name="lane_delta_tail"))
        total_body = te.compute(rows, lambda *r: te.sum(exp_body(*r, j), axis=j), name="lane_sum_body")
        total_tail = te.compute(rows, lambda *r: te.sum(exp_tail(*r, u), axis=u), name="lane_sum_tail")

        def exp_at(*i):
            c = i[-1]
            return tvm.tirx.if_then_else(c < body, exp_body(*i[:-1], tvm.tirx.min(c, body - 1)),
                                         exp_tail(*i[:-1], tvm.tirx.max(c - body, 0)))
    inv = te.compute(rows, lambda *r: tvm.tirx.const(1.0, x.dtype) / (part(body, total_body(*r), zero)
                                                                      + part(tail, total_tail(*r), zero)),
                     name="lane_inv")

    def out(*i):
        value = exp_at(*i) * inv(*i[:-1])
        # where(isnan(v), 0, v) of a softmax's v (0 or more, or NaN): max(v, 0), which LLVM lowers to a compare
        # and select (or maxnum) that takes 0 for NaN, one vector op (a select on isnan of v repeated v's loads)
        return tvm.tirx.max(value, zero) if nan_to_zero else value

    return te.compute(x.shape, out, name="lane_softmax")


def _last_axis(call: relax.Call) -> bool:
    ndim = len(call.args[0].ty.shape)
    return int(call.attrs.axis) in (-1, ndim - 1)


def _splits(call: relax.Expr) -> bool:
    """Whether ``call`` is a softmax this pass rewrites."""
    if not is_op(call, "relax.nn.softmax"):
        return False
    ty = call.args[0].ty
    shape = getattr(ty, "shape", None)
    if str(getattr(ty, "dtype", "")) != "float32" or shape is None or not _last_axis(call):
        return False
    last = shape[-1]
    return not (isinstance(last, tvm.tirx.IntImm) and not split_row(int(last)))


def _zero(expr: relax.Expr) -> bool:
    if not isinstance(expr, tvm.ir.Constant):
        return False
    value = expr.value.numpy()
    return value.size == 1 and float(value.reshape(())) == 0.0


def _nan_guards(func: relax.Function) -> dict[relax.Var, tuple[relax.Var, relax.Var]]:
    """The guarded softmaxes of ``func``: ``where(isnan(s), 0, s)`` of a softmax ``s`` this pass rewrites, ``s``
    and its ``isnan`` used nowhere else (dataflow variables of one block): the where's variable -> (the
    ``isnan``'s variable, ``s``).

    torch's dynamo export writes every ``scaled_dot_product_attention`` so (a row masked whole is 0, not NaN).
    As kernels of their own the guard read and wrote the whole score tensor twice more: MiniLM served at 384
    tokens (Intel Xeon, 2 threads) spent 0.46-0.56 ms per layer in it beside the softmax's 1.70-1.95.  Folded,
    the softmax's last write applies it (softmax and guard 1.66-1.81 ms)."""
    guards: dict[relax.Var, tuple[relax.Var, relax.Var]] = {}
    body = func.body
    for block in getattr(body, "blocks", []):
        if not isinstance(block, relax.DataflowBlock):
            continue
        bound = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
        users = relax.analysis.udchain(block)
        for var, value in bound.items():
            if not is_op(value, "relax.where") or not _zero(value.args[1]):
                continue
            test, kept = value.args[0], value.args[2]
            if not (isinstance(test, relax.DataflowVar) and isinstance(kept, relax.DataflowVar)):
                continue
            if not (is_op(bound.get(test), "relax.isnan") and bound[test].args[0].same_as(kept)
                    and _splits(bound.get(kept))):
                continue
            if len(users.get(test, [])) == 1 and len(users.get(kept, [])) == 2:
                guards[var] = (test, kept)
    return guards


@mutator
class _LaneSoftmax(PyExprMutator):
    _guards: dict = {}
    _folded: frozenset = frozenset()

    def visit_function_(self, func: relax.Function) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        self._guards = _nan_guards(func)  # per function
        self._folded = frozenset(v for pair in self._guards.values() for v in pair)  # emitted with their guard
        self._softmax: dict[relax.Var, relax.Call] = {}
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # noqa: N802 - TVM's visitor name
        if binding.var in self._folded:  # a guarded softmax or its isnan: computed by the guard's binding
            self._softmax[binding.var] = binding.value
            return
        guard = self._guards.get(binding.var)
        if guard is None:
            return super().visit_var_binding_(binding)
        x = self.visit_expr(self._softmax[guard[1]].args[0])
        call = self.builder_.call_te(split_softmax, x, nan_to_zero=True, primfunc_name_hint="split_softmax")
        new = (self.builder_.emit(call) if isinstance(binding.var, relax.DataflowVar)
               else self.builder_.emit_output(call))
        self.set_var_remap(binding.var, new)

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        call = super().visit_call_(call)
        if not _splits(call):
            return call
        return self.builder_.call_te(split_softmax, call.args[0], primfunc_name_hint="split_softmax")


@tvm.transform.module_pass(opt_level=0, name="LaneSoftmax")
class LaneSoftmax:
    """Every float32 last-axis ``relax.nn.softmax`` over a row :func:`split_row` accepts becomes
    :func:`split_softmax` (before FastMathTransform and LegalizeOps)."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _LaneSoftmax)
