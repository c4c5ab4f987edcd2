"""Whole-graph NCHW[x]c layout for CNNs on CPUs: convolutions blocked, everything between them carried through
in the blocked layout, transforms only at the edges (NeoCPU, Liu et al., USENIX ATC'19, section 3.2).

Runs on the imported Relax module, before :func:`pipeline.partition.partition` fuses it:

1. ``DecomposeOpsForInference``: BatchNormalization becomes a per-channel multiply/add (layout-agnostic
   elementwise ops, fused into the conv's epilogue later);
2. :class:`_Lift`: ONNX ``Clip`` arrives as ``call_tir`` of TOPI's maximum/minimum, which no layout pass can
   see through, and Relax's ``clip`` (HardSwish, HardSigmoid) has no layout inference: both become Relax
   ``maximum``/``minimum``;
3. :func:`assign_blocks`: every conv's input and output block (phase 1: a heuristic, see there);
   :class:`_MergeGroups`: grouped convs whose groups are narrower than a block get merged groups
   (:func:`kerneltune.conv_nchwc.merge_groups`, exact);
4. Relax ``ConvertLayout`` with a per-call callback: each conv gets data ``NCHW{a}c``, kernel ``OIHW`` (the
   weight stays a logical constant; the kernel template packs it at build time) and output ``NCHW{d}c``.
   ConvertLayout's own layout inference carries the blocked layout through elementwise ops, residual adds,
   max/avg pooling, global pooling (``mean``) and concat; ops without layout inference get a transform back
   to NCHW in front of them;
5. ``FoldConstant`` (biases and BN constants are transformed once, at build time),
   ``EliminateCommonSubexpr`` (the importer's duplicated reads of one tensor each got their own transform);
6. :class:`_LowerBlockedConvs`: every blocked ``nn.conv2d`` becomes a call of our compute
   (:func:`kerneltune.conv_nchwc.legalize`) -- Relax's LegalizeOps has no lowering for blocked convs.

A cost-based choice per conv (NeoCPU's global search: kernel time per candidate block plus the transforms it
implies) replaces :func:`assign_blocks`'s heuristic in phase 2.
"""
from __future__ import annotations

import math
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
    lifted: int = 0  # call_tir maximum/minimum and clip turned into Relax maximum/minimum
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


def _key(obj) -> int:
    """Identity of a TVM object (Python wrappers of one object differ; their handle does not)."""
    return obj.__chandle__()


class _Plans:
    """Each conv's plan, keyed by its weight constant (every conv of an imported model has its own)."""

    def __init__(self):
        self._by_weight: dict[int, tuple[object, ConvPlan | str]] = {}

    def set(self, weight, p: ConvPlan | str) -> None:
        self._by_weight[_key(weight)] = (weight, p)  # keep the object alive: its handle is the key

    def get(self, weight) -> ConvPlan | str | None:
        hit = self._by_weight.get(_key(weight))
        return hit[1] if hit else None


class _UnionFind:
    def __init__(self):
        self.parent: dict[int, int] = {}

    def find(self, k: int) -> int:
        self.parent.setdefault(k, k)
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


# Ops whose output is stored in the layout of their (4-d) activation input when ConvertLayout converts them.
_POOLS = ("relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d", "relax.mean")


def _shape(expr) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in expr.ty.shape)
    except (TypeError, AttributeError, ValueError):
        return None


def assign_blocks(mod: tvm.IRModule, lanes: int, narrow_groups: str = "nchw") -> _Plans:
    """Every conv's (ic_block, oc_block, merge), or why it stays NCHW.

    Tensors that must share a layout form one class (union-find over ``main``'s bindings): the inputs and
    output of an elementwise op (same 4-d shape: activations, residual adds, BN's multiply/add), of a pool,
    of a channel concat, and a depthwise conv's input and output.  A class's block is
    :func:`channel_block` of the gcd of its channel counts, so a concat of 8 + 16 channels is stored in
    8-channel blocks on both sides (ConvertLayout cannot concatenate different blocks), and a conv reads
    its input in the block its producer writes: no transform between them.
    """
    uf = _UnionFind()
    channels: dict[int, int] = {}
    convs: list[tuple[relax.Call, int, int]] = []  # call, input class key, output class key

    def track(var, c: int) -> int:
        k = _key(var)
        uf.find(k)
        channels[k] = c
        return k

    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            call, var = binding.value, binding.var
            shape = _shape(var)
            if not isinstance(call, relax.Call) or shape is None or len(shape) < 2:
                continue
            out = track(var, shape[1])
            if _is_op(call, CONV):
                x = call.args[0]
                xs = _shape(x)
                if xs is None or not isinstance(x, relax.Var):
                    continue
                inp = track(x, xs[1])
                convs.append((call, inp, out))
                dims = _conv_dims(call)
                if dims is not None and dims[2] == dims[0] == dims[1]:  # depthwise: lanes map 1:1
                    uf.union(inp, out)
                continue
            acts = [a for a in call.args if isinstance(a, relax.Var) and _shape(a) is not None]
            if _is_op(call, "relax.concat") and int(call.attrs.axis) in (1, -3) and len(shape) == 4:
                linked = acts if isinstance(call.args[0], relax.Var) else []
                if not linked and isinstance(call.args[0], relax.Tuple):
                    linked = [a for a in call.args[0].fields if isinstance(a, relax.Var)]
            elif isinstance(call.op, tvm.ir.Op) and call.op.name in _POOLS:
                linked = acts[:1]
            elif len(shape) == 4:
                linked = [a for a in acts if _shape(a) == shape]
            else:
                linked = []
            for a in linked:
                uf.union(track(a, _shape(a)[1]), out)

    gcd: dict[int, int] = {}
    for k, c in channels.items():
        r = uf.find(k)
        gcd[r] = math.gcd(gcd.get(r, 0), c)
    block = lambda k: channel_block(gcd[uf.find(k)], lanes)  # noqa: E731
    plans = _Plans()
    for call, inp, out in convs:
        dims = _conv_dims(call)
        if dims is None:
            plans.set(call.args[1], "non-constant weight, or not a static NCHW/OIHW conv2d")
            continue
        plans.set(call.args[1], plan(*dims, block(inp), block(out), narrow_groups))
    return plans


NARROW_GROUPS = ("nchw", "merge")


def plan(c: int, f: int, groups: int, a: int, d: int, narrow_groups: str = "nchw") -> ConvPlan | str:
    """The plan of one conv whose input is stored in blocks of ``a`` and output in blocks of ``d``, or why it
    stays NCHW.

    Groups narrower than a block (ResNeXt-50's 4 and 8 channels a group in 16-channel blocks) cannot be
    vectorized over output lanes without a shuffle per FMA.  ``narrow_groups="merge"`` merges them into
    block-wide block-diagonal groups (exact, 2-4x the FLOPs); the default keeps them NCHW, where the conv
    template vectorizes over output width, at the price of two transforms: on ResNeXt-50's 128x56x56
    grouped 3x3 (1 thread, loaded machine) the NCHW template ran 2.3x faster than 4x-merged groups and 2.2x
    faster than 2x-merged ones on the 256x28x28 stage (and an exact NCHWc kernel with in-kernel lane
    shuffles was slower than both).
    """
    if groups == 1:
        return ConvPlan(a, d)
    if groups == c == f:
        return ConvPlan(a, d) if a == d else f"depthwise conv with blocks {a} != {d}"
    if (c // groups) % a == 0 and (f // groups) % d == 0:
        return ConvPlan(a, d)
    if narrow_groups == "nchw":
        return f"groups of {c // groups}->{f // groups} channels are narrower than the blocks {a}/{d}"
    k = conv_nchwc.merge_factor(c, f, groups, a, d)
    if k is None:
        return f"groups={groups} of {c}->{f} channels cannot be aligned with blocks {a}/{d}"
    return ConvPlan(a, d, k)


@mutator
class _Lift(PyExprMutator):
    """Clip as ``call_tir`` of TOPI's maximum/minimum, and Relax ``clip``, -> Relax maximum/minimum."""

    def __init__(self, mod: tvm.IRModule, report: LayoutReport):
        super().__init__(mod)
        self.mod, self.report = mod, report

    def transform(self) -> tvm.IRModule:
        return _rewrite_functions(self)

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        call = super().visit_call_(call)
        if _is_op(call, "relax.call_tir") and isinstance(call.args[0], relax.GlobalVar):
            kind = _scalar_minmax(self.mod[call.args[0]])
            if kind is not None:
                x, s = call.args[1].fields
                self.report.lifted += 1
                return getattr(relax.op, kind)(x, s)
        if _is_op(call, "relax.clip"):  # HardSwish/HardSigmoid: clip has no layout inference in Relax
            x, lo, hi = call.args
            dtype = x.ty.dtype
            self.report.lifted += 1
            return relax.op.minimum(relax.op.maximum(x, relax.const(float(lo.value), dtype)),
                                    relax.const(float(hi.value), dtype))
        return call


@mutator
class _MergeGroups(PyExprMutator):
    """Grouped convs whose groups are narrower than their blocks get block-diagonally merged groups."""

    def __init__(self, mod: tvm.IRModule, plans: _Plans, report: LayoutReport):
        super().__init__(mod)
        self.mod, self.plans, self.report = mod, plans, report

    def transform(self) -> tvm.IRModule:
        return _rewrite_functions(self)

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if not _is_op(call, CONV):
            return call
        p = self.plans.get(call.args[1])
        if not isinstance(p, ConvPlan) or p.merge == 1:
            return call
        groups = int(call.attrs.groups)
        weight = relax.const(conv_nchwc.merge_groups(call.args[1].value.numpy(), groups, p.merge))
        self.plans.set(weight, ConvPlan(p.ic_block, p.oc_block))
        self.report.merged_groups += 1
        a = call.attrs
        return relax.op.nn.conv2d(call.args[0], weight, strides=a.strides, padding=a.padding,
                                  dilation=a.dilation, groups=groups // p.merge,
                                  out_dtype=a.out_dtype if str(a.out_dtype) else None)


def _rewrite_functions(m: PyExprMutator) -> tvm.IRModule:
    for gv, func in m.mod.functions_items():
        if isinstance(func, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(func))
    return m.builder_.get()


def _layout_callback(plans: _Plans, report: LayoutReport):
    def cb(call: relax.Call) -> dict:
        if not _is_op(call, CONV):
            return {}
        p = plans.get(call.args[1]) or "not planned"
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
        return _rewrite_functions(self)

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


def to_nchwc(mod: tvm.IRModule, lanes: int, narrow_groups: str = "nchw") -> tuple[tvm.IRModule, LayoutReport]:
    """The module with its convs in NCHWc (see the module docstring) and what was done.  ``lanes``: fp32
    lanes of the target's vector registers (16 with AVX-512); ``narrow_groups``: see :func:`plan`."""
    if narrow_groups not in NARROW_GROUPS:
        raise ValueError(f"narrow_groups={narrow_groups!r}: use one of {NARROW_GROUPS}")
    report = LayoutReport()
    T = relax.transform
    mod = T.DecomposeOpsForInference()(mod)
    mod = _Lift(mod, report).transform()
    plans = assign_blocks(mod, lanes, narrow_groups)
    mod = _MergeGroups(mod, plans, report).transform()
    mod = T.ConvertLayout({}, _layout_callback(plans, report))(mod)
    mod = tvm.transform.Sequential([T.FoldConstant(), T.EliminateCommonSubexpr(), T.CanonicalizeBindings(),
                                    T.DeadCodeElimination()])(mod)
    report.transforms = count_transforms(mod)
    mod = _LowerBlockedConvs(mod).transform()
    mod = T.DeadCodeElimination()(mod)
    return mod, report
