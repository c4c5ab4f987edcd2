"""Whole-graph NCHW[x]c layout for CNNs on CPUs: convolutions blocked, everything between them carried through
in the blocked layout, transforms only at the edges (NeoCPU, Liu et al., USENIX ATC'19, section 3.2).

Runs on the imported Relax module, before :func:`pipeline.partition.partition` fuses it:

1. ``DecomposeOpsForInference``: BatchNormalization becomes a per-channel multiply/add (layout-agnostic
   elementwise ops, fused into the conv's epilogue later);
2. :class:`_Prepare`: ONNX ``Clip`` arrives as ``call_tir`` of TOPI's maximum/minimum, which no layout pass
   can see through: they become Relax ``maximum``/``minimum``; grouped convs whose groups are narrower than
   a channel block get their groups merged (:func:`kerneltune.conv_nchwc.merge_groups`, exact);
3. Relax ``ConvertLayout`` with a per-call callback (:func:`plan`): each conv gets data ``NCHW{a}c``, kernel
   ``OIHW`` (the weight stays a logical constant; the kernel template packs it at build time) and output
   ``NCHW{d}c``.  ConvertLayout's own layout inference carries the blocked layout through elementwise ops,
   residual adds, max/avg pooling, global pooling (``mean``), concat; ops without layout inference get a
   transform back to NCHW in front of them;
4. ``FoldConstant`` (biases and BN constants are transformed once, at build time),
   ``EliminateCommonSubexpr`` (the importer's duplicated reads of one tensor each got their own transform);
5. :class:`_LowerBlockedConvs`: every blocked ``nn.conv2d`` becomes a call of our compute
   (:func:`kerneltune.conv_nchwc.legalize`) -- Relax's LegalizeOps has no lowering for blocked convs.

The blocks (phase 1 heuristic, :func:`channel_block`) are a function of a tensor's channel count, so a
tensor is in the same layout for its producer and every consumer: a chain of convs needs no transform
between them.  A cost-based choice per conv (NeoCPU's global search) replaces :func:`plan` later.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from kerneltune import conv_nchwc

CONV = "relax.nn.conv2d"


@dataclass
class LayoutReport:
    """What the pass did, for report.json and the tests."""

    convs: int = 0  # conv2d calls in the model
    blocked: int = 0  # of which run in NCHWc
    merged_groups: int = 0  # grouped convs whose groups were merged to fill a block
    lifted: int = 0  # call_tir maximum/minimum turned back into Relax ops
    transforms: int = 0  # layout_transform calls left on activations (constants are folded)
    kept_nchw: list[str] = field(default_factory=list)  # why convs stayed NCHW


def channel_block(channels: int, lanes: int) -> int:
    """Block for a tensor of ``channels`` channels: the vector width if it divides, else 8, else the
    largest divisor up to the vector width (3 for an RGB input: the stem conv then reads NHWC)."""
    for b in (lanes, 8):
        if b <= lanes and channels % b == 0:
            return b
    return max(d for d in range(1, lanes + 1) if channels % d == 0)


@dataclass(frozen=True)
class ConvPlan:
    ic_block: int
    oc_block: int
    merge: int = 1  # groups merged by this factor first


def plan(c: int, f: int, groups: int, lanes: int) -> ConvPlan | str:
    """The blocks of one conv, or the reason it stays NCHW."""
    a, d = channel_block(c, lanes), channel_block(f, lanes)
    if groups == 1:
        return ConvPlan(a, d)
    if groups == c == f:
        return ConvPlan(a, a)
    if (c // groups) % a == 0 and (f // groups) % d == 0:
        return ConvPlan(a, d)
    k = conv_nchwc.merge_factor(c, f, groups, a, d)
    if k is None:
        return f"groups={groups} of {c}->{f} channels cannot be aligned with blocks {a}/{d}"
    return ConvPlan(a, d, k)


def _conv_dims(call: relax.Call) -> tuple[int, int, int] | None:
    """(C, F, groups) of a static-shape NCHW/OIHW conv2d with a constant weight, else None."""
    attrs = call.attrs
    if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) != ("NCHW", "OIHW", "NCHW"):
        return None
    if not isinstance(call.args[1], tvm.ir.Constant):
        return None
    try:
        ds = [int(x) for x in call.args[0].ty.shape]
        ws = [int(x) for x in call.args[1].ty.shape]
    except (TypeError, AttributeError):
        return None
    if len(ds) != 4 or len(ws) != 4:
        return None
    return ds[1], ws[0], int(attrs.groups)


def _is_op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def _scalar_minmax(func) -> str | None:
    """``"maximum"``/``"minimum"`` if ``func`` is TOPI's elementwise max/min of its first input with a
    rank-0 second input (how the ONNX importer emits Clip), else None."""
    if not isinstance(func, tirx.PrimFunc) or len(func.params) != 3:
        return None
    x, s, out = func.params
    if len(s.shape) != 0 or [int(v) for v in x.shape] != [int(v) for v in out.shape]:
        return None
    body = func.body
    block = getattr(body, "block", None)
    if block is None:
        return None
    stmt = block.body
    while isinstance(stmt, tirx.For):
        stmt = stmt.body
    inner = getattr(stmt, "block", None)
    store = getattr(inner, "body", None)
    if not isinstance(store, tirx.BufferStore) or not store.buffer.same_as(out):
        return None
    v = store.value
    kind = "maximum" if isinstance(v, tirx.Max) else "minimum" if isinstance(v, tirx.Min) else None
    if kind is None:
        return None
    loads = [v.a, v.b]
    ok_x = any(isinstance(l, tvm.ir.TensorLoad) and l.source.same_as(x)
               and [str(i) for i in l.indices] == [str(i) for i in store.indices] for l in loads)
    ok_s = any(isinstance(l, tvm.ir.TensorLoad) and l.source.same_as(s) for l in loads)
    return kind if ok_x and ok_s else None


@mutator
class _Prepare(PyExprMutator):
    """Clip's call_tir -> Relax max/min; unaligned grouped convs -> merged groups (weights are constants)."""

    def __init__(self, mod: tvm.IRModule, lanes: int, report: LayoutReport):
        super().__init__(mod)
        self.mod, self.lanes, self.report = mod, lanes, report

    def transform(self) -> tvm.IRModule:
        for gv, func in self.mod.functions_items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        call = super().visit_call_(call)
        if _is_op(call, "relax.call_tir") and isinstance(call.args[0], relax.GlobalVar):
            kind = _scalar_minmax(self.mod[call.args[0]]) if call.args[0] in self.mod.get_global_vars() else None
            if kind is not None:
                x, s = call.args[1].fields
                self.report.lifted += 1
                return getattr(relax.op, kind)(x, s)
        if _is_op(call, CONV):
            dims = _conv_dims(call)
            if dims is not None:
                c, f, groups = dims
                p = plan(c, f, groups, self.lanes)
                if isinstance(p, ConvPlan) and p.merge > 1:
                    w = conv_nchwc.merge_groups(call.args[1].value.numpy(), groups, p.merge)
                    self.report.merged_groups += 1
                    a = call.attrs
                    return relax.op.nn.conv2d(call.args[0], relax.const(w), strides=a.strides, padding=a.padding,
                                              dilation=a.dilation, groups=groups // p.merge,
                                              out_dtype=a.out_dtype if str(a.out_dtype) else None)
        return call


def _layout_callback(lanes: int, report: LayoutReport):
    def cb(call: relax.Call) -> dict:
        if not _is_op(call, CONV):
            return {}
        dims = _conv_dims(call)
        p = plan(*dims, lanes) if dims is not None else "non-constant weight or non-NCHW/static layout"
        report.convs += 1
        if isinstance(p, str):
            report.kept_nchw.append(p)
            return {CONV: ["NCHW", "OIHW", "NCHW"]}
        report.blocked += 1
        return {CONV: [f"NCHW{p.ic_block}c", "OIHW", f"NCHW{p.oc_block}c"]}

    return cb


@mutator
class _LowerBlockedConvs(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod

    def transform(self) -> tvm.IRModule:
        for gv, func in self.mod.functions_items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if _is_op(call, CONV) and str(call.attrs.data_layout) != "NCHW":
            return conv_nchwc.legalize(self.builder_, call)
        return call


def count_transforms(mod: tvm.IRModule) -> int:
    """``layout_transform`` calls left in ``main`` (after FoldConstant only activations are transformed)."""
    n = 0
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            n += _is_op(b.value, "relax.layout_transform")
    return n


def to_nchwc(mod: tvm.IRModule, lanes: int) -> tuple[tvm.IRModule, LayoutReport]:
    """The module with its convs in NCHWc (see the module docstring) and what was done.  ``lanes``: fp32
    lanes of the target's vector registers (16 with AVX-512)."""
    report = LayoutReport()
    T = relax.transform
    mod = T.DecomposeOpsForInference()(mod)
    mod = _Prepare(mod, lanes, report).transform()
    mod = T.ConvertLayout({}, _layout_callback(lanes, report))(mod)
    mod = tvm.transform.Sequential([T.FoldConstant(), T.EliminateCommonSubexpr(), T.CanonicalizeBindings(),
                                    T.DeadCodeElimination()])(mod)
    report.transforms = count_transforms(mod)
    mod = _LowerBlockedConvs(mod).transform()
    mod = T.DeadCodeElimination()(mod)
    return mod, report
