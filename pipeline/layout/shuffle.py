"""Channel shuffles carried in the blocked layout: one gather kernel instead of three passes.

ShuffleNet (Zhang et al., CVPR 2018, section 3.1; v2: Ma et al., ECCV 2018) permutes channels between
grouped convolutions with ``reshape (N, g, C/g, H, W)``, a swap of the two channel axes and ``reshape
(N, C, H, W)``.  Relax's ConvertLayout has no layout inference for a 5-D reshape, so in a model whose convs
are blocked (:mod:`pipeline.layout.nchwc`) each shuffle became three kernels: the producer's ``NCHW{a}c``
transformed back to NCHW, the reshape/transpose/reshape, and the transform to the consumer's ``NCHW{b}c``:
three passes over the activations, the middle one with five-dimensional index arithmetic.

A shuffle is a fixed permutation of the channels: output channel ``j = i * g + k`` is input channel
``k * (C/g) + i``.  :class:`FoldShuffles` runs after ConvertLayout and replaces the chain (with either
transform absent where that side is NCHW) by one ``channel_shuffle`` kernel that reads the producer's layout
and writes the consumer's: channel ``c`` of a blocked tensor is element ``[n, c // a, h, w, c % a]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from pipeline.passes import provenance
from pipeline.passes.relax_rewrite import is_op, static_shape

RESHAPE, PERMUTE, TRANSFORM = "relax.reshape", "relax.permute_dims", "relax.layout_transform"


@dataclass(frozen=True)
class Shuffle:
    """A channel shuffle of ``channels = groups * width`` channels: ``(groups, width)`` transposed."""

    groups: int
    width: int

    def source(self, j):
        """The input channel output channel ``j`` reads (an int or a TIR expression)."""
        return j % self.groups * self.width + j // self.groups


def shuffle_of(last: relax.Call, bound) -> tuple[Shuffle, relax.Expr] | None:
    """``(shuffle, NCHW input)`` when ``last`` is the closing reshape of a channel shuffle over a static 4-D
    tensor, else None.  ``bound(var)``: the value a dataflow variable is bound to (None if it is not)."""
    if not is_op(last, RESHAPE):
        return None
    perm = bound(last.args[0])
    if not is_op(perm, PERMUTE) or perm.attrs.axes is None or [int(a) for a in perm.attrs.axes] != [0, 2, 1, 3, 4]:
        return None
    first = bound(perm.args[0])
    if not is_op(first, RESHAPE):
        return None
    x = first.args[0]
    shape, split, out = static_shape(x), static_shape(first), static_shape(last)
    # the closing reshape may also flatten (torch's dynamo export merges a following flatten into it):
    # reshapes are row-major, so that is the 4-D shuffle reshaped once more
    if shape is None or split is None or out is None or len(shape) != 4 or len(split) != 5 \
            or math.prod(out) != math.prod(shape):
        return None
    n, c, h, w = shape
    if split[0] != n or split[3:] != (h, w) or split[1] * split[2] != c:
        return None
    return Shuffle(split[1], split[2]), x


def transform_block(call: relax.Expr, to_blocked: bool) -> int | None:
    """The block ``b`` when ``call`` is a ``layout_transform`` NCHW -> NCHW{b}c (``to_blocked``) or NCHW{b}c ->
    NCHW, checked on the index map itself at a few points; else None."""
    if not is_op(call, TRANSFORM) or call.attrs.pad_value is not None:
        return None
    src, dst = static_shape(call.args[0]), static_shape(call)
    if src is None or dst is None:
        return None
    blocked, plain = (dst, src) if to_blocked else (src, dst)
    if len(plain) != 4 or len(blocked) != 5 or blocked[4] * blocked[1] != plain[1] \
            or [blocked[0], *blocked[2:4]] != [plain[0], *plain[2:]]:
        return None
    b = blocked[4]
    analyzer = tvm.sym.Analyzer()
    for c in {0, b - 1, plain[1] - 1, plain[1] // 2}:
        point = (plain[0] - 1, c, plain[2] - 1, plain[3] // 2)
        at = [point[0], c // b, point[2], point[3], c % b]
        given, want = (point, at) if to_blocked else (at, point)
        got = call.attrs.index_map.map_indices([tirx.IntImm("int64", v) for v in given])
        if [int(analyzer.simplify(e)) for e in got] != list(want):
            return None
    return b


def gather(x: te.Tensor, shuffle: Shuffle, a: int, b: int, channels: int) -> te.Tensor:
    """``x`` (NCHW{a}c, or NCHW when ``a`` is 0) shuffled, in NCHW{b}c (NCHW when ``b`` is 0)."""
    def read(n, c, h, w):
        return x[n, c // a, h, w, c % a] if a else x[n, c, h, w]

    n, h, w = x.shape[0], x.shape[2], x.shape[3]
    if b:
        return te.compute((n, channels // b, h, w, b),
                          lambda i, cb, y, z, cl: read(i, shuffle.source(cb * b + cl), y, z), name="channel_shuffle")
    return te.compute((n, channels, h, w), lambda i, c, y, z: read(i, shuffle.source(c), y, z),
                      name="channel_shuffle")


@mutator
class FoldShuffles(PyExprMutator):
    """Every channel shuffle of a module after ConvertLayout, with the transforms on either side of it, as
    one ``channel_shuffle`` kernel (see the module docstring).  ``folded``: how many."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod, self.folded = mod, 0
        self.values: dict[relax.Var, relax.Expr] = {}
        self.users: dict[relax.Var, int] = {}
        self.absorbed: set[relax.Expr] = set()  # closing reshapes folded with the transform after them

    def transform(self) -> tvm.IRModule:
        for gv, func in self.mod.functions_items():
            if isinstance(func, relax.Function):
                self._index(func)
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def _index(self, func: relax.Function) -> None:
        """Each variable's bound value and how many bindings use it (the original, unvisited ones)."""
        def count(e):
            if isinstance(e, relax.Var):
                self.users[e] = self.users.get(e, 0) + 1

        for block in func.body.blocks:
            for binding in block.bindings:
                self.values[binding.var] = binding.value
                relax.analysis.post_order_visit(binding.value, count)
        relax.analysis.post_order_visit(func.body.body, count)
        for value in self.values.values():
            if transform_block(value, to_blocked=True) and self.users.get(value.args[0]) == 1:
                closing = self._bound(value.args[0])
                if shuffle_of(closing, self._bound) is not None:
                    self.absorbed.add(closing)

    def _bound(self, e):
        return self.values.get(e) if isinstance(e, relax.Var) else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        b = transform_block(call, to_blocked=True)
        if b and self._bound(call.args[0]) in self.absorbed:
            return self._fold(call, shuffle_of(self._bound(call.args[0]), self._bound), b)
        found = shuffle_of(call, self._bound) if call not in self.absorbed else None
        if found is not None:
            return self._fold(call, found, 0)
        return super().visit_call_(call)

    def _fold(self, call: relax.Call, found: tuple[Shuffle, relax.Expr], b: int) -> relax.Expr:
        shuffle, x = found
        channels = static_shape(x)[1]
        source, a = x, 0
        produced = self._bound(x)
        a_in = transform_block(produced, to_blocked=False) if produced is not None else None
        if a_in:
            source, a = produced.args[0], a_in
        self.folded += 1
        out = self.builder_.call_te(lambda t: gather(t, shuffle, a, b, channels), self.visit_expr(source),
                                    primfunc_name_hint="channel_shuffle")
        shape = static_shape(call)
        if not b and shape != static_shape(x):
            out = relax.op.reshape(out, shape)
        return provenance.tag_normalized(self.builder_, out, call.span)
