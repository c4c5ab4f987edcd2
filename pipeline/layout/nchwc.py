"""Whole-graph NCHW[x]c layout for CNNs on CPUs: convolutions blocked, everything between them carried through
in the blocked layout, transforms only at the edges (NeoCPU, Liu et al., USENIX ATC'19, section 3.2).

Runs on the imported Relax module, before :func:`pipeline.partition.partition` fuses it:

1. ``DecomposeOpsForInference``: BatchNormalization becomes a per-channel multiply/add (layout-agnostic
   elementwise ops, fused into the conv's epilogue later).  It leaves ``(y, mean, var)[0]`` behind:
   ``CanonicalizeBindings`` makes that ``y`` itself, or :func:`analyze` would see a tensor of unknown origin
   after every BN that is not folded into a conv (DenseNet's BN after each concat) and could give it another
   block than ``y``, which ConvertLayout carries into it ("Invalid layout axis 16b": it cannot transform
   between two blocks).  ``FoldConstant`` turns the BN's and biases' reshaped parameters into constants
   (otherwise each counts as a tensor entering the class in NCHW);
2. :class:`_Lift`: ONNX ``Clip`` arrives as ``call_tir`` of TOPI's maximum/minimum, which no layout pass can
   see through, and Relax's ``clip`` (HardSwish, HardSigmoid) has no layout inference: both become Relax
   ``maximum``/``minimum``; :class:`_ConstantRanks`: constant operands of elementwise ops get the rank the
   blocked layout needs (:func:`constant_rank`: a (C,1,1) scale becomes (1,C,1,1));
   :class:`_ConvertLayoutWorkarounds`: channel ``split`` and ``squeeze`` with negative axes, whose layout
   inference is broken in TVM 0.27, rewritten into equivalents whose inference works;
3. every conv's input and output block: :func:`heuristic_plans` (``--layout nchwc``) or the measured search of
   :mod:`pipeline.layout.search` (``--layout auto``), over the layout classes :func:`analyze` finds;
   :class:`_MergeGroups`: grouped convs whose groups are narrower than a block get merged groups
   (:func:`kerneltune.templates.conv_nchwc.merge_groups`, exact);
4. Relax ``ConvertLayout`` with a per-call callback: each conv gets data ``NCHW{a}c``, kernel ``OIHW`` (the
   weight stays a logical constant; the kernel template packs it at build time) and output ``NCHW{d}c``.
   ConvertLayout's own layout inference carries the blocked layout through elementwise ops, residual adds,
   max/avg pooling, global pooling (``mean``) and concat; ops without layout inference get a transform back
   to NCHW in front of them;
5. ``FoldConstant`` (biases and BN constants are transformed once, at build time),
   ``EliminateCommonSubexpr`` (the importer's duplicated reads of one tensor each got their own transform);
   :class:`~pipeline.layout.shuffle.FoldShuffles`: a channel shuffle (a 5-D reshape ConvertLayout cannot
   carry) and the transforms around it become one gather from the producer's blocks to the consumer's;
6. :class:`_LowerBlockedConvs`: every blocked ``nn.conv2d`` becomes a call of our compute
   (:func:`kerneltune.templates.conv_nchwc.legalize`) -- Relax's LegalizeOps has no lowering for blocked convs.

The cost-based choice per conv (NeoCPU's global search: kernel time per candidate block plus the transforms
it implies) is :mod:`pipeline.layout.search` (``--layout auto``); :func:`heuristic_plans` is ``--layout nchwc``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from kerneltune.templates import conv_nchwc, winograd_nchwc
from kerneltune.native_log import quiet_native_stderr
from pipeline.layout.shuffle import FoldShuffles
from pipeline.passes import provenance
from pipeline.passes.fold import FoldConstants
from pipeline.passes.relax_rewrite import is_op, static_shape

CONV = "relax.nn.conv2d"


@dataclass
class LayoutReport:
    """What the pass did, for report.json and the tests."""

    mode: str = "nchw"  # nchw (pass not run) | nchwc (heuristic blocks) | auto (cost-based search)
    convs: int = 0  # conv2d calls in the model
    blocked: int = 0  # of which run in NCHWc
    merged_groups: int = 0  # grouped convs whose groups were merged to fill a block
    lifted: int = 0  # call_tir maximum/minimum and clip -> Relax maximum/minimum; padded pools -> one pool
    reshaped_constants: int = 0  # constant operands given the rank the blocked layout needs (constant_rank)
    transforms: int = 0  # layout_transform calls left on activations (constants are folded)
    shuffles: int = 0  # channel shuffles folded with their transforms into one kernel (pipeline.layout.shuffle)
    kept_nchw: list[str] = field(default_factory=list)  # why convs stayed NCHW
    marks: dict[str, int] = field(default_factory=dict)  # Winograd marks: weight digest -> m (winograd_nchwc)
    winograd: int = 0  # blocked convs lowered to the Winograd kernel
    search: dict | None = None  # the cost-based search's summary (mode auto)
    failed: str | None = None  # TVM could not realize the blocked layout: the model runs as imported

    def to_json(self) -> dict:
        reasons: dict[str, int] = {}
        for r in self.kept_nchw:
            reasons[r] = reasons.get(r, 0) + 1
        out = {"mode": self.mode, "convs": self.convs, "blocked": self.blocked, "transforms": self.transforms,
               "merged_groups": self.merged_groups, "kept_nchw": reasons}
        if self.shuffles:
            out["shuffles"] = self.shuffles
        if self.marks:
            out["winograd"] = self.winograd
        if self.search is not None:
            out["search"] = self.search
        if self.failed is not None:
            out["failed"] = self.failed
        return out


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


def _single_store(func: tirx.PrimFunc, out) -> tirx.BufferStore | None:
    """The store of a one-block TOPI elementwise PrimFunc (root block, a loop nest, one block writing ``out``
    as its whole body), else None."""
    block = getattr(func.body, "block", None)
    if block is None:
        return None
    stmt = block.body
    while isinstance(stmt, tirx.For):
        stmt = stmt.body
    store = getattr(getattr(stmt, "block", None), "body", None)
    return store if isinstance(store, tirx.BufferStore) and store.buffer.same_as(out) else None


def _scalar_minmax(func) -> str | None:
    """``"maximum"``/``"minimum"`` if ``func`` is TOPI's elementwise max/min of its first input with a
    rank-0 second input (how the ONNX importer emits Clip), else None."""
    if not isinstance(func, tirx.PrimFunc) or len(func.params) != 3:
        return None
    x, s, out = func.params
    if len(s.shape) != 0 or [int(v) for v in x.shape] != [int(v) for v in out.shape]:
        return None
    store = _single_store(func, out)
    if store is None:
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


# Pools keep a 4-d activation's layout; the reductions keep it when they reduce the spatial axes and keep dims.
_POOLS = ("relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d")
_REDUCTIONS = ("relax.mean", "relax.sum", "relax.max", "relax.min")
# Ops with a layout inference whose result still mixes channels or axes: never carried across (their inputs
# and outputs are the edges of a layout class).
_AXIS_SENSITIVE = ("relax.nn.softmax", "relax.nn.log_softmax", "relax.nn.layer_norm", "relax.nn.group_norm",
                   "relax.nn.instance_norm", "relax.nn.rms_norm", "relax.nn.batch_norm", "relax.flip",
                   "relax.repeat", "relax.tile", "relax.permute_dims", "relax.squeeze", "relax.expand_dims",
                   "relax.strided_slice", "relax.dynamic_strided_slice", "relax.split", "relax.stack",
                   "relax.gather_elements", "relax.scatter_elements", "relax.scatter_nd", "relax.image.resize2d")


def _has_layout_inference(op) -> bool:
    return isinstance(op, tvm.ir.Op) and op.get_attr("FRelaxInferLayout") is not None


def _elementwise_links(call: relax.Call, shape: tuple[int, ...] | None) -> list | None:
    """The 4-d activation arguments an elementwise op carries its layout through (same channels, the other
    axes equal or broadcast), or None when the op is not such an op (ConvertLayout would put it back in NCHW).
    Rank-0 arguments (Clip's bounds, scalars) do not matter."""
    if shape is None or len(shape) != 4 or not _has_layout_inference(call.op) or call.op.name in _AXIS_SENSITIVE:
        return None
    linked = []
    for arg in call.args:
        s = static_shape(arg)
        if s is None:
            return None
        if len(s) == 0:
            continue
        if len(s) != 4 or s[1] != shape[1] or any(d not in (1, o) for d, o in zip(s, shape)):
            return None
        if isinstance(arg, relax.Var):
            linked.append(arg)
    return linked


@dataclass
class ConvSite:
    """One conv2d call of the model: its logical convolution and the layout classes of its input and output."""

    weight: object  # the weight Constant: what plans are keyed by
    spec: conv_nchwc.ConvSpec | None  # logical conv (blocks of 1); None when it cannot be blocked
    inp: int  # class of the data tensor
    out: int  # class of the output tensor
    in_shape: tuple[int, ...] = ()  # data and output shapes (NCHW)
    out_shape: tuple[int, ...] = ()
    why: str = ""  # why it cannot be blocked


@dataclass
class TensorClass:
    """Activations that must share one layout: linked by elementwise ops (residual adds, activations, BN's
    multiply/add, SE's broadcast multiply), pools, spatial reductions and channel concats."""

    channels: int  # gcd of the members' channel counts: every block must divide it
    entries: list[tuple[int, ...]] = field(default_factory=list)  # members made in NCHW (model inputs, ...)
    exits: list[tuple[int, ...]] = field(default_factory=list)  # members read in NCHW (model outputs, ...)
    group_widths: set[int] = field(default_factory=set)  # channels per group of grouped convs touching it
    grouped: bool = False  # a grouped or depthwise conv reads or writes it


@dataclass
class LayoutGraph:
    classes: list[TensorClass]
    convs: list[ConvSite]


def _conv_spec(call: relax.Call) -> tuple[conv_nchwc.ConvSpec | None, str]:
    dims = _conv_dims(call)
    if dims is None:
        return None, "non-constant weight, or not a static NCHW/OIHW conv2d"
    ds, ws = static_shape(call.args[0]), static_shape(call.args[1])
    a = call.attrs
    if a.out_dtype and str(a.out_dtype) not in ("", "void", str(call.args[0].ty.dtype)):
        return None, f"conv2d out_dtype {a.out_dtype} differs from its input's"
    pad = [int(p) for p in a.padding]
    pad = pad * 2 if len(pad) == 2 else pad
    spec = conv_nchwc.ConvSpec(n=ds[0], c=ds[1], h=ds[2], w=ds[3], f=ws[0], kh=ws[2], kw=ws[3],
                               stride=tuple(int(s) for s in a.strides), pad=tuple(pad),
                               dilation=tuple(int(s) for s in a.dilation), groups=int(a.groups), ic_block=1,
                               oc_block=1, dtype=str(call.args[0].ty.dtype))
    try:
        spec.check()
    except ValueError as exc:
        return None, str(exc)
    return spec, ""


def analyze(mod: tvm.IRModule) -> LayoutGraph:
    """The layout classes of ``main``'s 4-d activations and the convs between them (program order, so the
    numbering is the same on every run).

    Union-find over the bindings: an elementwise op links its output with its 4-d inputs of the same
    channels, a pool or spatial reduction (keepdims) its input and output, a channel concat its inputs and
    output.  A member made by anything else (a model input, a reshape) is an *entry* and a member read by
    anything else (a classifier's flatten, the model's output) an *exit*: in a blocked layout each costs a
    layout transform.  A conv reads and writes its classes in whatever layout it is given.
    """
    uf = _UnionFind()
    channels: dict[int, int] = {}
    order: list[int] = []
    entries: list[tuple[int, tuple[int, ...]]] = []
    exits: list[tuple[int, tuple[int, ...]]] = []
    widths: list[tuple[int, int]] = []
    grouped: list[int] = []
    convs: list[tuple] = []  # (weight, spec, input key, output key, input shape, output shape, why)

    def track(var) -> int | None:
        s = static_shape(var)
        if s is None or len(s) != 4:
            return None
        k = _key(var)
        if k not in channels:
            uf.find(k)
            channels[k] = s[1]
            order.append(k)
        return k

    func = mod["main"]
    for p in func.params:
        k = track(p)
        if k is not None:
            entries.append((k, static_shape(p)))
    for block in func.body.blocks:
        for binding in block.bindings:
            call, var = binding.value, binding.var
            if not isinstance(call, relax.Call):
                continue
            shape = static_shape(var)
            out = track(var)
            args = list(call.args)
            if is_op(call, "relax.concat") and isinstance(args[0], relax.Tuple):
                args = list(args[0].fields)
            acts = [a for a in args if isinstance(a, relax.Var) and track(a) is not None]
            if is_op(call, CONV) and out is not None and acts and call.args[0].same_as(acts[0]):
                spec, why = _conv_spec(call)
                inp = track(call.args[0])
                convs.append((call.args[1], spec, inp, out, static_shape(call.args[0]), shape, why))
                if spec is not None and spec.groups > 1:
                    grouped += [inp, out]
                    if not spec.depthwise:
                        widths += [(inp, spec.cg), (out, spec.fg)]
                continue
            linked = None
            if out is not None:
                if is_op(call, "relax.concat") and int(call.attrs.axis) in (1, -3):
                    linked = acts
                elif isinstance(call.op, tvm.ir.Op) and call.op.name in _POOLS:
                    linked = acts[:1]
                elif isinstance(call.op, tvm.ir.Op) and call.op.name in _REDUCTIONS:
                    axes = sorted(int(x) % 4 for x in (call.attrs.axis or []))
                    linked = acts[:1] if axes == [2, 3] and bool(call.attrs.keepdims) else None
                else:
                    linked = _elementwise_links(call, shape)
            if linked is None:  # an op that keeps NCHW: its 4-d operands leave, its 4-d result enters
                exits += [(_key(a), static_shape(a)) for a in acts]
                if out is not None:
                    entries.append((out, shape))
                continue
            for a in linked:
                uf.union(_key(a), out)
            exits += [(_key(a), static_shape(a)) for a in acts if not any(a.same_as(x) for x in linked)]
    body = func.body.body
    for ret in (body.fields if isinstance(body, relax.Tuple) else [body]):
        if isinstance(ret, relax.Var) and track(ret) is not None:
            exits.append((_key(ret), static_shape(ret)))

    index: dict[int, int] = {}
    classes: list[TensorClass] = []
    for k in order:  # numbered by first appearance
        r = uf.find(k)
        if r not in index:
            index[r] = len(classes)
            classes.append(TensorClass(0))
        cls = classes[index[r]]
        cls.channels = math.gcd(cls.channels, channels[k])
    cid = lambda k: index[uf.find(k)]  # noqa: E731
    for k, s in entries:
        classes[cid(k)].entries.append(s)
    for k, s in exits:
        classes[cid(k)].exits.append(s)
    for k, w in widths:
        classes[cid(k)].group_widths.add(w)
    for k in grouped:
        classes[cid(k)].grouped = True
    sites = [ConvSite(w, spec, cid(i), cid(o), si, so, why) for w, spec, i, o, si, so, why in convs]
    return LayoutGraph(classes, sites)


def heuristic_plans(graph: LayoutGraph, lanes: int, narrow_groups: str = "nchw") -> _Plans:
    """Phase-1 blocks without measuring: each class in :func:`channel_block` of its channels (a depthwise
    conv's input and output classes share one block, as its kernel needs), each conv planned by :func:`plan`.
    A grouped conv's group width joins its classes' channel counts when its own block would fill more than
    half the vector: ShuffleNet v1's 60-channel tensors between groups of 20 take blocks of 10, not 15, so
    that those convs are blocked instead of kept NCHW with a transform on each side; ResNeXt's groups of 4
    and 8 channels (a block of 4 or 8 of 16 lanes) leave the 16-channel blocks of their tensors alone.
    """
    uf = _UnionFind()
    for s in graph.convs:
        if s.spec is not None and s.spec.depthwise:
            uf.union(s.inp, s.out)
    gcd: dict[int, int] = {}
    for i, cls in enumerate(graph.classes):
        r = uf.find(i)
        gcd[r] = math.gcd(gcd.get(r, 0), cls.channels)
    for s in graph.convs:  # groups wide enough to fill most of a block set their classes' blocks
        if s.spec is not None and 1 < s.spec.groups and not s.spec.depthwise:
            for i, width in ((s.inp, s.spec.c // s.spec.groups), (s.out, s.spec.f // s.spec.groups)):
                if 2 * channel_block(width, lanes) > lanes:
                    gcd[uf.find(i)] = math.gcd(gcd[uf.find(i)], width)
    block = lambda i: channel_block(gcd[uf.find(i)], lanes)  # noqa: E731
    plans = _Plans()
    for s in graph.convs:
        if s.spec is None:
            plans.set(s.weight, s.why)
        else:
            plans.set(s.weight, plan(s.spec.c, s.spec.f, s.spec.groups, block(s.inp), block(s.out), narrow_groups))
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


class _Rewriter(PyExprMutator):
    """What this module's mutators share: they rewrite every Relax function of ``mod`` (:meth:`transform`),
    counting what they did in ``report`` where they take one.  Not decorated itself: TVM's ``@mutator``
    wraps each subclass."""

    def __init__(self, mod: tvm.IRModule, report: LayoutReport | None = None):
        super().__init__(mod)
        self.mod, self.report = mod, report

    def transform(self) -> tvm.IRModule:
        for gv, func in self.mod.functions_items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()


@mutator
class _Lift(_Rewriter):
    """Clip as ``call_tir`` of TOPI's maximum/minimum, and Relax ``clip``, -> Relax maximum/minimum; an
    average pool over a ``call_tir`` zero pad -> one pool counting the padding (:meth:`_padded_pool`)."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - TVM's visitor name
        call = super().visit_call_(call)
        if is_op(call, "relax.call_tir") and isinstance(call.args[0], relax.GlobalVar):
            kind = _scalar_minmax(self.mod[call.args[0]])
            if kind is not None:
                x, s = call.args[1].fields
                self.report.lifted += 1
                return getattr(relax.op, kind)(x, s)
        if is_op(call, "relax.nn.avg_pool2d"):
            pooled = self._padded_pool(call)
            if pooled is not None:
                self.report.lifted += 1
                return pooled
        if is_op(call, "relax.clip"):  # HardSwish/HardSigmoid: clip has no layout inference in Relax
            x, lo, hi = call.args
            dtype = x.ty.dtype
            self.report.lifted += 1
            return relax.op.minimum(relax.op.maximum(x, relax.const(float(lo.value), dtype)),
                                    relax.const(float(hi.value), dtype))
        return call

    def _padded_pool(self, call: relax.Call) -> relax.Expr | None:
        """An NCHW average pool over an explicit zero pad (``call_tir`` of TOPI's pad: how the ONNX importer
        emits AveragePool with ``count_include_pad=1``) as one pool with that padding counted in the divisor;
        None for any other pool.  The pad was opaque to ConvertLayout, which ran each ShuffleNet v1 shortcut's
        pool in NCHW between two transforms."""
        attrs = call.attrs
        x = call.args[0]
        bound = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        # ceil_mode is left alone: a window past the padded edge would count the padding differently
        if (str(attrs.layout) != "NCHW" or any(int(p) for p in attrs.padding) or attrs.count_include_pad
                or attrs.ceil_mode or not is_op(bound, "relax.call_tir")
                or not isinstance(bound.args[0], relax.GlobalVar)):
            return None
        widths = _zero_pad(self.mod[bound.args[0]])
        if widths is None or widths[0] != (0, 0) or widths[1] != (0, 0):
            return None
        (top, bottom), (left, right) = widths[2], widths[3]
        (data,) = bound.args[1].fields
        return relax.op.nn.avg_pool2d(data, [int(v) for v in attrs.pool_size], [int(v) for v in attrs.strides],
                                      (top, left, bottom, right), [int(v) for v in attrs.dilation],
                                      False, True, "NCHW", "NCHW")


def _zero_pad(func) -> list[tuple[int, int]] | None:
    """Each axis's (before, after) padding if ``func`` is TOPI's constant-zero pad of its one input
    (``out[i] = if_then_else(in bounds, x[i - before], 0)``), else None."""
    if not isinstance(func, tirx.PrimFunc) or len(func.params) != 2:
        return None
    x, out = func.params
    store = _single_store(func, out)
    if store is None:
        return None
    v = store.value
    if not (isinstance(v, tvm.ir.Call) and getattr(v.op, "name", "") == "prim.if_then_else"
            and isinstance(v.args[1], tvm.ir.TensorLoad) and v.args[1].source.same_as(x)
            and isinstance(v.args[2], tirx.FloatImm) and v.args[2].value == 0.0):
        return None
    widths = []
    for index, var, n_in, n_out in zip(v.args[1].indices, store.indices, x.shape, out.shape):
        before = 0
        if isinstance(index, tirx.Sub) and isinstance(index.b, tirx.IntImm):
            index, before = index.a, int(index.b.value)
        if not index.same_as(var):
            return None
        widths.append((before, int(n_out) - int(n_in) - before))
    return widths if all(b >= 0 and a >= 0 for b, a in widths) else None


# Elementwise ops with numpy broadcasting whose constant operand :class:`_ConstantRanks` may reshape.
_BINARY = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
           "relax.power")


def constant_rank(const: tuple[int, ...], act: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape to give a constant of shape ``const`` combined elementwise with a 4-d NCHW activation of shape
    ``act``, or None to leave it.  The result broadcasts against ``act`` exactly as ``const`` did (only leading
    ones are added or dropped, and only where the op's result keeps ``act``'s shape); what changes is what
    ConvertLayout can do with it:

    * one element -> a scalar (rank 0): any layout takes it;
    * per channel, e.g. (C,1,1) -> (1,C,1,1): transformed into the blocked layout once, at build time, like a
      bias (a rank-3 operand makes ConvertLayout put the activation back into NCHW for the op);
    * constant over channels at rank 4, e.g. (1,1,1,W) -> (W,): a blocked layout cannot hold a tensor of one
      channel (ConvertLayout fails: "Cannot broadcast from 5 to 4"); at a lower rank the op runs in NCHW.
    """
    if len(act) != 4 or len(const) > 4:
        return None
    padded = (1,) * (4 - len(const)) + tuple(const)
    if padded[0] != 1 or any(c not in (1, a) for c, a in zip(padded, act)):
        return None  # a batch of constants, or the constant widens the result
    if math.prod(const) == 1:
        want: tuple[int, ...] = ()
    elif padded[1] == act[1]:
        want = padded
    else:
        k = 0
        while padded[k] == 1:
            k += 1
        want = padded[k:]
    return None if want == tuple(const) else want


@mutator
class _ConstantRanks(_Rewriter):
    """Constant operands of elementwise ops with a 4-d activation reshaped by :func:`constant_rank`."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or call.op.name not in _BINARY or len(call.args) != 2:
            return call
        args = list(call.args)
        for i in (0, 1):
            c, act = args[i], static_shape(args[1 - i])
            if not isinstance(c, tvm.ir.Constant) or isinstance(args[1 - i], tvm.ir.Constant) or act is None:
                continue
            want = constant_rank(tuple(int(d) for d in c.value.shape), act)
            if want is None:
                continue
            args[i] = relax.const(c.value.numpy().reshape(want))
            self.report.reshaped_constants += 1
            return getattr(relax.op, call.op.name.split(".")[-1])(*args)  # no attrs: _BINARY ops have none
        return call


def split_bounds(channels: int, indices_or_sections) -> list[tuple[int, int]] | None:
    """``[begin, end)`` of each part of a split of ``channels`` (Relax's ``split``: a section count or the
    indices to split at), or None when it is not a static split."""
    try:
        if isinstance(indices_or_sections, (int, tirx.IntImm)):
            n = int(indices_or_sections)
            if n <= 0:
                return None
            step = -(-channels // n)
            cuts = [min(i * step, channels) for i in range(1, n)]
        else:
            cuts = [min(max(int(i), 0), channels) for i in indices_or_sections]
    except (TypeError, ValueError):
        return None
    edges = [0, *cuts, channels]
    return [(edges[i], max(edges[i], edges[i + 1])) for i in range(len(edges) - 1)]


@mutator
class _ConvertLayoutWorkarounds(_Rewriter):
    """Rewrites, exact, of ops whose layout inference in TVM 0.27's ConvertLayout is broken:

    * ``nn.dropout`` -> ``(x, ones)``, what inference computes (ONNX Dropout without training mode): its
      inference dies on the ``(output, mask)`` tuple ("Expected nested to match tuple"), which made every
      model-zoo CNN with a Dropout (VGG, AlexNet, opset 9) run wholly in NCHW, 6.5-16x onnxruntime;

    * a channel ``split`` of a 4-d tensor -> one ``strided_slice`` per part: ``split``'s inference mishandles a
      blocked input (a 32-channel NCHW16c tensor split at 16 gave a part of 32 channels, and the conv reading
      it failed to type-check), ``strided_slice``'s does not (YOLO's C2f, ShuffleNet's channel split, GLU);
    * ``squeeze`` with negative axes -> the same axes counted from the front: its inference dies with
      ``std::bad_alloc`` on them, whatever the layouts (ViT from torch's dynamo exporter).
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if is_op(call, "relax.nn.dropout"):
            x = call.args[0]
            return relax.Tuple([x, relax.op.ones_like(x)])
        if is_op(call, "relax.squeeze") and call.attrs.axis is not None:
            rank = getattr(call.args[0].ty, "ndim", -1)
            axes = [int(a) for a in call.attrs.axis]
            if rank > 0 and any(a < 0 for a in axes):
                return relax.op.squeeze(call.args[0], [a % rank for a in axes])
            return call
        if not is_op(call, "relax.split"):
            return call
        shape = static_shape(call.args[0])
        if shape is None or len(shape) != 4 or int(call.attrs.axis) not in (1, -3):
            return call
        bounds = split_bounds(shape[1], call.attrs.indices_or_sections)
        if bounds is None:
            return call
        return relax.Tuple([self.builder_.emit(relax.op.strided_slice(call.args[0], [1], [b], [e]))
                            for b, e in bounds])


@mutator
class _MergeGroups(_Rewriter):
    """Grouped convs whose groups are narrower than their blocks get block-diagonally merged groups."""

    def __init__(self, mod: tvm.IRModule, plans: _Plans, report: LayoutReport):
        super().__init__(mod, report)
        self.plans = plans

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if not is_op(call, CONV):
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


def _layout_callback(plans: _Plans, report: LayoutReport):
    def cb(call: relax.Call) -> dict:
        if not is_op(call, CONV):
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
class _LowerBlockedConvs(_Rewriter):
    """Blocked convs lowered to our NCHWc compute (Relax's LegalizeOps does not lower them): the Winograd
    kernel where the graph stage marked the conv (``report.marks``), else the direct conv."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if is_op(call, CONV) and str(call.attrs.data_layout) != "NCHW":
            m = winograd_nchwc.marked_tile(call, self.report.marks) if self.report is not None else None
            if m is not None:
                self.report.winograd += 1
                lowered = winograd_nchwc.legalize(self.builder_, call, m)
            else:
                lowered = conv_nchwc.legalize(self.builder_, call)
            return provenance.tag_normalized(self.builder_, lowered, call.span)
        return call


def count_transforms(mod: tvm.IRModule) -> int:
    """``layout_transform`` calls left in ``main`` (after FoldConstant only activations are transformed)."""
    n = 0
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            n += is_op(b.value, "relax.layout_transform")
    return n


def prepare(mod: tvm.IRModule, report: LayoutReport) -> tvm.IRModule:
    """Steps 1-2 of the module docstring: BatchNormalization decomposed (and its tuple resolved, its constants
    folded), Clip lifted to maximum/minimum, constant operands of elementwise ops given the rank the blocked
    layout needs."""
    T = relax.transform
    mod = _ConvertLayoutWorkarounds(T.DecomposeOpsForInference()(mod)).transform()
    with quiet_native_stderr():  # FoldConstant legalizes constant Gathers: TOPI's fast take warns at each
        mod = tvm.transform.Sequential([T.CanonicalizeBindings(), FoldConstants])(mod)
    mod = _Lift(mod, report).transform()
    mod = _ConstantRanks(mod, report).transform()
    return T.DeadCodeElimination()(mod)


Planner = Callable[[LayoutGraph], _Plans]


def to_nchwc(mod: tvm.IRModule, lanes: int, narrow_groups: str = "nchw",
             planner: Planner | None = None) -> tuple[tvm.IRModule, LayoutReport]:
    """The module with its convs in NCHWc (see the module docstring) and what was done.  ``lanes``: fp32
    lanes of the target's vector registers (16 with AVX-512); ``planner``: each conv's blocks from the
    module's :class:`LayoutGraph` (default :func:`heuristic_plans` with ``narrow_groups``, see :func:`plan`)."""
    if narrow_groups not in NARROW_GROUPS:
        raise ValueError(f"narrow_groups={narrow_groups!r}: use one of {NARROW_GROUPS}")
    report = LayoutReport(mode="nchwc", marks=winograd_nchwc.marks_of(mod))
    mod = prepare(mod, report)
    graph = analyze(mod)
    plans = planner(graph) if planner is not None else heuristic_plans(graph, lanes, narrow_groups)
    return realize_locally(mod, graph, plans, report)


# What ConvertLayout raises when its layout inference cannot carry a blocked layout through an operator.
REALIZE_ERRORS = (tvm.error.InternalError, ValueError)
# Realizations tried while narrowing a plan that ConvertLayout rejects (each is one ConvertLayout run).
MAX_REALIZE_TRIES = 40
KEPT_BY_CONVERT = "kept NCHW: ConvertLayout could not carry its blocked layout through a neighbouring operator"


def realize_locally(mod: tvm.IRModule, graph: LayoutGraph, plans: _Plans,
                    report: LayoutReport) -> tuple[tvm.IRModule, LayoutReport]:
    """:func:`realize`, and where ConvertLayout rejects the plan, the same plan with as few convs as possible
    left in NCHW instead of the whole model: the blocked convs are bisected in program order for the first
    one whose blocked layout breaks it (ConvertLayout then converts only what that layout reaches), it is
    kept NCHW, and the rest is tried again.  One operator TVM cannot carry (a 5-D channel shuffle, an op
    whose inference is broken) costs the convs next to it, not the model's whole layout.  Raises the first
    error when even that fails, or after :data:`MAX_REALIZE_TRIES` realizations."""
    base = replace(report, kept_nchw=list(report.kept_nchw))  # the report as prepare left it

    def attempt(blocked: list[ConvSite]) -> tuple[tvm.IRModule, LayoutReport]:
        keep = {_key(s.weight) for s in blocked}
        narrowed = _Plans()
        for site in graph.convs:
            p = plans.get(site.weight)
            narrowed.set(site.weight, p if not isinstance(p, ConvPlan) or _key(site.weight) in keep
                         else KEPT_BY_CONVERT)
        return realize(mod, narrowed, replace(base, kept_nchw=list(base.kept_nchw)))

    try:
        return realize(mod, plans, report)
    except REALIZE_ERRORS as exc:
        first = exc
    blocked = [s for s in graph.convs if isinstance(plans.get(s.weight), ConvPlan)]
    tries = 0

    def works(sites: list[ConvSite]):
        nonlocal tries
        tries += 1
        if tries > MAX_REALIZE_TRIES:
            raise first
        try:
            return attempt(sites)
        except REALIZE_ERRORS:
            return None

    while blocked:
        lo, hi = 0, len(blocked)  # blocking blocked[:lo] works (nothing blocked always does), blocked[:hi] fails
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if works(blocked[:mid]) is not None:
                lo = mid
            else:
                hi = mid
        del blocked[hi - 1]  # the first conv whose blocked layout ConvertLayout cannot carry
        done = works(blocked)
        if done is not None:
            return done
    raise first


def realize(mod: tvm.IRModule, plans: _Plans, report: LayoutReport) -> tuple[tvm.IRModule, LayoutReport]:
    """Steps 3-6 on a :func:`prepare`-d module: merged groups, ConvertLayout with ``plans``, clean-up,
    blocked convs lowered to our compute."""
    T = relax.transform
    mod = _MergeGroups(mod, plans, report).transform()
    mod = provenance.carry_spans(mod, T.ConvertLayout({}, _layout_callback(plans, report))(mod))
    with quiet_native_stderr():  # as in prepare: TOPI's fast take warns at each constant Gather folded
        mod = tvm.transform.Sequential([FoldConstants, T.EliminateCommonSubexpr(), T.CanonicalizeBindings(),
                                        T.DeadCodeElimination()])(mod)
    folder = FoldShuffles(mod)
    mod = T.DeadCodeElimination()(folder.transform())
    report.shuffles = folder.folded
    report.transforms = count_transforms(mod)
    mod = _LowerBlockedConvs(mod, report).transform()
    mod = T.DeadCodeElimination()(mod)
    return mod, report
