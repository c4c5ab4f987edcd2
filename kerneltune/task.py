"""Tuning tasks: one anchor operator (matmul, batch matmul or conv2d) plus its fused epilogue, as a PrimFunc.

A :class:`Task` is what every other part of kerneltune talks about: the searchers see its ``key`` and FLOPs,
the templates (``kerneltune.templates``) schedule its ``func`` around the anchor block described by ``axes``,
and the measurer (``kerneltune.measure``) builds it, feeds it ``make_inputs`` and compares with ``reference``.

Two ways to get one:

* ``make_task(kind, shape, ...)`` for a standalone operator, written the way Relax's LegalizeOps writes it
  (same block names ``matmul`` / ``conv2d_nchw``, int64 loops), so a standalone task is scheduled exactly
  like the pipeline's fused ones.
* ``classify_primfunc(name, func)`` for a PrimFunc that came out of LegalizeOps + FuseOps + FuseTIR, e.g.
  ``fused_matmul_add_gelu``, ``fused_conv2d_add_relu``, a rank-4 attention matmul.  It finds the single
  multiply-accumulate reduction block (the *anchor*), classifies its iterators by which operand they index,
  and returns ``None`` when the function has no such anchor (softmax, layernorm, transposes...) or has other
  reductions the templates cannot place.  Whether a template can schedule the task is the templates' call:
  :func:`kerneltune.templates.task_for` is what the pipeline uses.

The kinds themselves (names, standalone SHAPE signatures) are the table in :mod:`kerneltune.opkinds`.

The reference output is computed by the *unscheduled* PrimFunc compiled with plain LLVM (naive loops):
slow but independent of any template, and valid for every epilogue without re-implementing it in numpy.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import reduce
from typing import Any, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, te, tirx
from tvm.tirx.analysis import undefined_vars

from graphopt.errors import UserError
from kerneltune import stack_locals
from kerneltune import vector_intrinsics  # noqa: F401 - marks ops TVM's vectorizer would scalarize
from kerneltune.opkinds import op_kind, parse_shape


# An NHWC conv whose output pixels are one row axis, computed without an im2col copy (_classify_implicit_conv)
IMPLICIT_CONV = "conv2d_nhwc"


@dataclass(frozen=True)
class Axis:
    """One iterator of the anchor block.

    ``role`` is a stable, readable name used for knob names: ``b0, b1, ...`` (batch), ``m0..``/``i`` (rows of
    A), ``n0..``/``j`` (columns of B), ``k`` (matmul reduction); ``n, f, y, x, rc, ry, rx`` for conv2d.
    ``var`` is the block iterator's own name, ``extent`` its trip count.
    """

    role: str
    var: str
    extent: int
    reduce: bool


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Task:
    """A tunable kernel: PrimFunc + where its anchor is + how to check it.

    ``axes`` lists the anchor block's iterators in block order (spatial first, as LegalizeOps emits them);
    templates split every axis with extent > 1.  ``vector_axis`` is the role of the spatial axis that is
    contiguous in the output (the last spatial one) -- the one CPU templates vectorize.
    ``block_names`` are the root's child blocks in order (producers such as pads, anchor, epilogue).
    ``dims`` carries the operator's logical sizes (``M, K, N, B, transpose_a, transpose_b`` or
    ``N, C, H, W, F, KH, KW, OH, OW, groups``) for reports and heuristics.  ``weights`` names the inputs
    that are constants in the model (their layout may be rewritten at build time, see
    :mod:`kerneltune.prepack`).
    """

    name: str
    kind: str
    func: tirx.PrimFunc
    flops: int
    key: str
    anchor: str
    axes: tuple[Axis, ...]
    dims: dict[str, Any]
    dtype: str
    epilogue: tuple[str, ...]
    block_names: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weights: tuple[str, ...] = ()  # input parameters the model feeds with constants (may be packed at build)
    # roles whose extents follow a served size: the task is a kernel's instance at a representative size
    # (pipeline.symbolic), and the kernel built from its config runs at every size in the range
    served: frozenset[str] = frozenset()
    _ref_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def vector_axis(self) -> str:
        return [a.role for a in self.axes if not a.reduce][-1]

    def axis(self, role: str) -> Axis:
        return next(a for a in self.axes if a.role == role)

    def make_inputs(self, seed: int = 0) -> list[np.ndarray]:
        """Seeded random inputs in [-1, 1) (ints in [0, 8)), one per input parameter, in parameter order."""
        rng = np.random.default_rng(seed)
        out = []
        for spec in self.inputs:
            if spec.dtype.startswith(("int", "uint")):
                out.append(rng.integers(0, 8, size=spec.shape).astype(spec.dtype))
            else:
                out.append(rng.uniform(-1, 1, size=spec.shape).astype(spec.dtype))
        return out

    def reference(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Outputs of the unscheduled PrimFunc on ``inputs`` (built once with LLVM, cached on the task)."""
        if "lib" not in self._ref_cache:
            self._ref_cache["lib"] = build_func(self.func, tvm.target.Target({"kind": "llvm"}))
        return run_func(self._ref_cache["lib"], self, inputs, tvm.cpu())

    def __reduce__(self):
        # Sent to build/run worker processes: the PrimFunc travels as TVM JSON, the rest as plain data.
        fields = {k: v for k, v in self.__dict__.items() if k not in ("func", "_ref_cache")}
        return (_task_from_json, (fields, tvm.ir.save_json(self.func)))


def _task_from_json(fields: dict, func_json: str) -> Task:
    return Task(func=tvm.ir.load_json(func_json), **fields)


# ----------------------------------------------------------------------------------------------- build/run

def build_func(func: tirx.PrimFunc, target: tvm.target.Target) -> tvm.runtime.Module:
    """Compile a (scheduled or not) PrimFunc into a module with entry ``main``."""
    func = func.with_attr("global_symbol", "main")
    return tvm.tirx.build(tvm.IRModule({"main": func}), target=target, pipeline=stack_locals.PIPELINE)


def run_func(lib, task: Task, inputs: Sequence[np.ndarray], dev) -> list[np.ndarray]:
    """Run ``lib["main"]`` once on ``dev`` and return the outputs as numpy arrays."""
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    outs = [tvm.runtime.empty(o.shape, o.dtype, dev) for o in task.outputs]
    lib["main"](*args, *outs)
    return [o.numpy() for o in outs]


# ----------------------------------------------------------------------------------------------- analysis

def _int(x) -> int:
    return int(x.value) if hasattr(x, "value") else int(x)


def symbolic_axes(task: Task) -> set[str]:
    """Roles of the anchor's iterators whose extent in ``task.func`` is symbolic: the task was made from the
    kernel's instance at a representative length and is applied to the kernel itself (:mod:`pipeline.symbolic`),
    whose extents follow the length."""
    block = next(b for b in root_blocks(task.func) if b.name_hint == task.anchor)
    return {a.role for a, iv in zip(task.axes, block.iter_vars) if not isinstance(iv.dom.extent, tirx.IntImm)}


def root_blocks(func: tirx.PrimFunc) -> list:
    """The root block's children (LegalizeOps/FuseTIR output is flat), in program order."""
    sch = s_tir.Schedule(func)
    root = sch.get_sblock(func.body.block.name_hint)
    return [sch.get(b) for b in sch.get_child_blocks(root)]


def _strip_cast(e):
    while isinstance(e, tirx.Cast):
        e = e.value
    return e


def mac_operands(block):
    """(X, Y) loads if ``block`` computes ``C[idx] = C[idx] + X * Y`` (casts allowed), else None."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or block.init is None:
        return None
    v = store.value
    if not isinstance(v, tirx.Add):
        return None
    for acc, prod in ((v.a, v.b), (v.b, v.a)):
        acc, prod = _strip_cast(acc), _strip_cast(prod)
        if isinstance(acc, tvm.ir.TensorLoad) and acc.source.same_as(store.buffer) and isinstance(prod, tirx.Mul):
            x, y = _strip_cast(prod.a), _strip_cast(prod.b)
            if isinstance(x, tvm.ir.TensorLoad) and isinstance(y, tvm.ir.TensorLoad):
                return x, y
    return None


def _vars_in(expr) -> set[str]:
    return {v.name for v in undefined_vars(expr)}


def _pure_vars(load: tvm.ir.TensorLoad) -> list[str] | None:
    """Index variable names if every index is a bare variable (or the constant 0 of a broadcast), else None."""
    out = []
    for idx in load.indices:
        if isinstance(idx, tirx.Var):
            out.append(idx.name)
        elif isinstance(idx, tirx.IntImm) and idx.value == 0:
            out.append(None)
        else:
            return None
    return [v for v in out if v is not None]


def _io_specs(func: tirx.PrimFunc, blocks) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    written = {r.source.name for b in blocks for r in b.writes}
    ins, outs = [], []
    for p in func.params:
        buf = p  # TVM 0.27: PrimFunc params are the buffers themselves
        spec = TensorSpec(buf.name, tuple(_int(s) for s in buf.shape), str(buf.dtype))
        (outs if buf.name in written else ins).append(spec)
    return tuple(ins), tuple(outs)


_DIGITS = re.compile(r"_?\d+$")


def _epilogue_names(blocks, anchor: tirx.SBlock) -> tuple[str, ...]:
    after = blocks[[b.same_as(anchor) for b in blocks].index(True) + 1:]
    return tuple(_DIGITS.sub("", b.name_hint) for b in after)


def layout_free_params(func: tirx.PrimFunc) -> tuple[int, ...]:
    """Indices of the parameters the model always feeds with constants (weights), from the PrimFunc's
    ``layout_free_buffers`` attribute (set by Relax's AttachAttrLayoutFreeBuffers; see kerneltune.prepack)."""
    attrs = func.attrs
    if attrs is None or "layout_free_buffers" not in attrs:
        return ()
    return tuple(int(i) for i in attrs["layout_free_buffers"])


def classify_primfunc(name: str, func: tirx.PrimFunc) -> Task | None:
    """Classify a (fused) PrimFunc; a Task when it has one matmul/conv anchor.

    Rules: exactly one reduction block, it is a multiply-accumulate with constant extents, and its operands
    fit a matmul (every index a bare iterator) or an NCHW conv2d (weight ``W[f, rc, ry, rx]``, 4-d output).
    Anything else (dynamic shapes, softmax's max/sum, pooling) gives ``None``: TVM's default schedule stays.
    """
    try:
        blocks = root_blocks(func)
    except Exception:  # noqa: BLE001 - not a TIR body we can walk
        return None
    reductions = [b for b in blocks if any(iv.iter_type == tirx.IterVar.CommReduce for iv in b.iter_vars)]
    if len(reductions) != 1:
        return None
    anchor = reductions[0]
    ops = mac_operands(anchor)
    if ops is None or not all(isinstance(iv.dom.extent, tirx.IntImm) for iv in anchor.iter_vars):
        return None
    ivs = [(iv.var.name, _int(iv.dom.extent), iv.iter_type == tirx.IterVar.CommReduce) for iv in anchor.iter_vars]
    dtype = str(anchor.body.buffer.dtype)
    out_vars = [v for v, _, r in ivs if not r]
    red_vars = [v for v, _, r in ivs if r]
    ext = {v: e for v, e, _ in ivs}
    x, y = ops
    xv, yv = _pure_vars(x), _pure_vars(y)
    if xv is not None and yv is not None and len(red_vars) == 1:
        info = _classify_matmul(xv, yv, out_vars, red_vars[0], ext)
    else:
        info = (_classify_conv(x, y, out_vars, red_vars, ext, len(anchor.body.indices))
                or _classify_implicit_conv(x, y, out_vars, red_vars, ext))
    if info is None:
        return None
    kind, roles, dims = info
    axes = tuple(Axis(roles[v], v, e, r) for v, e, r in ivs)
    flops = 2 * reduce(lambda a, b: a * b, (e for _, e, _ in ivs), 1)
    epi = _epilogue_names(blocks, anchor)
    ins, outs = _io_specs(func, blocks)
    shape_part = "x".join(f"{k}{int(v)}" for k, v in dims.items())
    shash = tvm_ffi.structural_hash(func) & 0xFFFFFFFF
    key = f"{kind}_{shape_part}_{dtype}_{'+'.join(epi) or 'none'}_{shash:08x}"
    names = tuple(b.name_hint for b in blocks)
    weights = tuple(func.params[i].name for i in layout_free_params(func))
    return Task(name=name, kind=kind, func=func, flops=flops, key=key, anchor=anchor.name_hint, axes=axes, dims=dims,
                dtype=dtype, epilogue=epi, block_names=names, inputs=ins, outputs=outs, weights=weights)


def _classify_matmul(xv, yv, out_vars, k, ext):
    """Matmul family: iterators in both operands are batch, in A only rows (M), in B only columns (N)."""
    if k not in xv or k not in yv:
        return None
    both = [v for v in out_vars if v in xv and v in yv]
    only_x = [v for v in out_vars if v in xv and v not in yv]
    only_y = [v for v in out_vars if v in yv and v not in xv]
    if len(both) + len(only_x) + len(only_y) != len(out_vars):
        return None
    # B is the operand holding the output's last (column) iterator; swap if X holds it.
    col = out_vars[-1]
    a_vars, b_vars, m_vars, n_vars = xv, yv, only_x, only_y
    if col in xv and col not in yv:
        a_vars, b_vars, m_vars, n_vars = yv, xv, only_y, only_x
    if not n_vars:
        return None
    roles = {k: "k"}
    for i, v in enumerate(both):
        roles[v] = f"b{i}"
    for prefix, vs, single in (("m", m_vars, "i"), ("n", n_vars, "j")):
        for i, v in enumerate(vs):
            roles[v] = single if len(vs) == 1 else f"{prefix}{i}"
    prod = lambda vs: reduce(lambda a, b: a * b, (ext[v] for v in vs), 1)  # noqa: E731
    batch = prod(both)
    kind = "batch_matmul" if batch > 1 else "matmul"
    ta = bool(m_vars) and a_vars.index(k) < a_vars.index(m_vars[-1])
    tb = b_vars.index(n_vars[-1]) < b_vars.index(k)
    dims = {"B": batch, "M": prod(m_vars), "K": ext[k], "N": prod(n_vars), "ta": int(ta), "tb": int(tb)}
    if kind == "matmul":
        del dims["B"]
    return kind, roles, dims


def _classify_conv(x, y, out_vars, red_vars, ext, out_rank):
    """NCHW conv2d: the weight load is ``W[f, rc, ry, rx]`` with bare iterators, the output is 4-d."""
    if out_rank != 4 or len(out_vars) != 4 or len(red_vars) != 3:
        return None
    for data, weight in ((x, y), (y, x)):
        wv = _pure_vars(weight)
        if wv is None or len(weight.indices) != 4 or wv[0] != out_vars[1] or wv[1:] != red_vars:
            continue
        nn, ff, yy, xx = out_vars
        rc, ry, rx = red_vars
        if not (_vars_in(data.indices[2]) >= {yy, ry} and _vars_in(data.indices[3]) >= {xx, rx}):
            continue
        roles = dict(zip(out_vars + red_vars, ("n", "f", "y", "x", "rc", "ry", "rx")))
        cin = _int(data.source.shape[1])
        groups = cin // ext[rc] if ext[rc] else 1
        dims = {"N": ext[nn], "C": cin, "F": ext[ff], "OH": ext[yy], "OW": ext[xx],
                "KH": ext[ry], "KW": ext[rx], "G": groups}
        return "conv2d", roles, dims
    return None


def _classify_implicit_conv(x, y, out_vars, red_vars, ext):
    """An NHWC conv with its output pixels as one row axis (``pipeline.passes.int8``'s implicit-GEMM conv):
    ``out[p, f] += X[.., c] * W[ry, rx, c, f]``, the data's last index the bare input channel.  Its dims are the
    matmul's (``M`` rows, ``K`` input channels per tap, ``N`` filters) plus the taps ``KH, KW``."""
    if len(out_vars) != 2 or len(red_vars) != 3:
        return None
    rows, ff = out_vars
    ry, rx, rc = red_vars
    for data, weight in ((x, y), (y, x)):
        if _pure_vars(weight) != [ry, rx, rc, ff] or len(weight.indices) != 4:
            continue
        last = data.indices[-1]
        if not (isinstance(last, tirx.Var) and last.name == rc):
            continue
        if not set().union(*(_vars_in(i) for i in data.indices[:-1])) >= {rows, ry, rx}:
            continue
        roles = {rows: "i", ff: "j", ry: "ry", rx: "rx", rc: "k"}
        dims = {"M": ext[rows], "K": ext[rc], "N": ext[ff], "KH": ext[ry], "KW": ext[rx]}
        return IMPLICIT_CONV, roles, dims
    return None


# ----------------------------------------------------------------------------------------------- builders

def _matmul_te(shape, ta, tb, dtype, batched):
    """LegalizeOps-shaped matmul: block ``matmul``, iterators i0.. and k, int64 extents."""
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    if batched:
        bsz, m, k, n = shape
        a_shape = (bsz, k, m) if ta else (bsz, m, k)
        b_shape = (bsz, n, k) if tb else (bsz, k, n)
        out_shape = (bsz, m, n)
    else:
        m, k, n = shape
        a_shape, b_shape, out_shape = (k, m) if ta else (m, k), (n, k) if tb else (k, n), (m, n)
    a = te.placeholder([i64(s) for s in a_shape], dtype, name="A")
    b = te.placeholder([i64(s) for s in b_shape], dtype, name="B")
    r = te.reduce_axis((i64(0), i64(k)), name="k")

    def body(*idx):
        *bi, i, j = idx
        av = a[(*bi, r, i)] if ta else a[(*bi, i, r)]
        bv = b[(*bi, j, r)] if tb else b[(*bi, r, j)]
        return te.sum(av * bv, axis=r)

    c = te.compute([i64(s) for s in out_shape], body, name="matmul")
    return te.create_prim_func([a, b, c])


def _conv_relax(shape, stride, pad, groups, dtype):
    """conv2d through Relax's own LegalizeOps, so the pad block and int64 indexing match the pipeline's."""
    from tvm import relax

    n, c, h, w, f, kh, kw = shape
    bb = relax.BlockBuilder()
    data = relax.Var("data", relax.TensorType([n, c, h, w], dtype))
    weight = relax.Var("weight", relax.TensorType([f, c // groups, kh, kw], dtype))
    with bb.function("main", [data, weight]):
        out = bb.emit(relax.op.nn.conv2d(data, weight, strides=stride, padding=pad, groups=groups))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    funcs = [f_ for _, f_ in mod.functions.items() if isinstance(f_, tirx.PrimFunc)]
    assert len(funcs) == 1
    return funcs[0]


def _build_matmul(kind: str, dims: tuple[int, ...], transpose_a: bool = False, transpose_b: bool = False,
                  dtype: str = "float32") -> tuple[tirx.PrimFunc, str]:
    func = _matmul_te(dims, transpose_a, transpose_b, dtype, kind == "batch_matmul")
    name = f"{kind}_{'_'.join(map(str, dims))}" + ("_ta" if transpose_a else "") + ("_tb" if transpose_b else "")
    return func, name


def _build_conv2d(kind: str, dims: tuple[int, ...], stride: int = 1, pad: int = 0, groups: int = 1,
                  dtype: str = "float32") -> tuple[tirx.PrimFunc, str]:
    n, c, h, w, f, kh, kw = dims
    if groups <= 0 or c % groups or f % groups:
        raise UserError(f"groups={groups} must divide input channels {c} and output channels {f}")
    if stride <= 0 or pad < 0 or h + 2 * pad < kh or w + 2 * pad < kw:
        raise UserError(f"conv2d stride {stride} / pad {pad} / kernel {kh}x{kw} do not fit input {h}x{w}")
    return _conv_relax(dims, stride, pad, groups, dtype), f"conv2d_{'_'.join(map(str, dims))}_s{stride}p{pad}g{groups}"


# Standalone builders per op kind (the kinds' table: kerneltune.opkinds); each takes the kind's options.
_BUILDERS = {"matmul": _build_matmul, "batch_matmul": _build_matmul, "conv2d": _build_conv2d}


def make_task(kind: str, shape: str | Sequence[int], transpose_a: bool = False, transpose_b: bool = False,
              stride: int = 1, pad: int = 0, groups: int = 1, dtype: str = "float32") -> Task:
    """A standalone operator task.  SHAPE: ``M,K,N`` (A MxK, B KxN), ``B,M,K,N``, ``N,C,H,W,F,KH,KW`` (NCHW)."""
    dims = parse_shape(kind, shape)
    given = {"transpose_a": transpose_a, "transpose_b": transpose_b, "stride": stride, "pad": pad, "groups": groups}
    func, name = _BUILDERS[kind](kind, dims, **{k: given[k] for k in op_kind(kind).options}, dtype=dtype)
    task = classify_primfunc(name, func)
    assert task is not None and task.kind == (kind if kind != "batch_matmul" or dims[0] > 1 else "matmul"), name
    return task
