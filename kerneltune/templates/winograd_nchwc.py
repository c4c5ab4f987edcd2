"""Winograd convolution in the blocked NCHW[x]c layout: one kernel from blocked input to blocked output.

Why a kernel and not a graph rewrite: written in plain operators (:mod:`graphopt.winograd`'s rewrite), the
tile GEMMs ran as a generic batched matmul (145 GFLOP/s against the direct conv's 247 on an Intel Xeon) and
each rewritten layer paid a layout transpose on both sides.  Here the input transform reads the
``NCHW{a}c`` activations the direct conv reads, the output transform writes ``NCHW{d}c`` with the conv's
epilogue (bias, ReLU, residual) fused, and the GEMMs are this package's own vector register tiles
(:mod:`kerneltune.templates.cpu_winograd`).  The filter transform ``G g G^T`` is done once, at build time,
on the constant weight (:func:`transform_weight`), straight into the layout the GEMM reads.

F(m x m, 3 x 3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", CVPR 2016) with
``alpha = m + 2``; the matrices are :func:`graphopt.winograd.transform_matrices`, proven exact with Z3 there.
The stages, all in one PrimFunc (blocks in this order):

* ``wino_pad``: the input zero-padded to whole tiles, ``[N, C/a, TH*m + 2, TW*m + 2, a]`` (a copy of the
  rows a chunk reads: the tiles then read it without bounds checks);
* ``wino_bt`` / ``wino_v``: ``V = B^T d B`` per tile and channel, ``V[alpha, alpha, N, TH, TW, C]``;
* ``wino_gemm`` (the anchor, tagged :data:`ANCHOR_ATTR`): ``M[e, nu, N, TH, TW, F/d, d] = sum_c V[e, nu, ...,
  c] * U[e, nu, F/d, c, d]``, alpha^2 independent GEMMs whose rows are the tiles (two axes, so a chunk of
  tile rows maps back to output rows affinely and the template can keep a chunk's stages in cache);
* ``wino_at`` / ``wino_out``: ``Y = A^T M A`` per tile, written at the conv's exact ``OH x OW`` (the last
  tiles' extra rows and columns are never written).

The transforms are written as explicit sums of the matrices' nonzero entries (no multiply by 0 or 1),
selected by the row index: once the schedule unrolls the rows, every select folds to one sum.  Only the
anchor is a reduction.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import reduce

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, te, tirx

from graphopt import winograd as algorithm

from ..task import Axis, Task, _epilogue_names, _int, _io_specs, root_blocks
from .conv_nchwc import ConvSpec, _ceil, compute_width, fused_kernel
from .conv_nchwc import make_relax as direct_relax

ANCHOR_ATTR = "kerneltune.winograd_nchwc"
KIND = "winograd_nchwc"
TILES = tuple(algorithm.POINTS)  # F(2x2), F(4x4), F(6x6)


@dataclass(frozen=True)
class WinogradSpec:
    """A blocked 3x3 convolution computed by F(m x m, 3 x 3)."""

    conv: ConvSpec
    m: int

    @property
    def alpha(self) -> int:
        return self.m + 2

    @property
    def tiles_h(self) -> int:
        return _ceil(self.conv.out_h, self.m)

    @property
    def tiles_w(self) -> int:
        """Tile columns, as many as the GEMMs' register tiles need: a prime count (VGG-19's 112x112 in F(6x6):
        19) would leave one tile a register tile, so it is computed as the next count with a divisor of 4-12
        (:func:`~kerneltune.templates.conv_nchwc.compute_width`; 20), the extra tiles reading zeros and
        never stored (F(6x6) at 128 -> 128 x 112x112: 10.5 ms with 19 tiles, to F(4x4)'s 6.5)."""
        return compute_width(_ceil(self.conv.out_w, self.m))

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The transformed weight ``U[alpha, alpha, F/d, C, d]``."""
        c = self.conv
        return (self.alpha, self.alpha, c.f // c.oc_block, c.c, c.oc_block)

    def check(self) -> None:
        reason = unsupported(self.conv)
        if reason:
            raise ValueError(reason)
        if self.m not in TILES:
            raise ValueError(f"F({self.m}x{self.m},3x3) is not offered (tile sizes {TILES})")

    def to_json(self) -> str:
        return json.dumps({"conv": asdict(self.conv), "m": self.m}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "WinogradSpec":
        d = json.loads(text)
        return WinogradSpec(ConvSpec.from_json(json.dumps(d["conv"])), int(d["m"]))


def unsupported(conv: ConvSpec) -> str | None:
    """Why ``conv`` cannot be computed by this kernel, or None: 3x3, stride 1, dilation 1, one group, whole
    input and output blocks (stride-2 and 1x1 layers are never candidates: F(m, 3) has nothing to save
    there)."""
    if (conv.kh, conv.kw) != (3, 3):
        return f"a {conv.kh}x{conv.kw} kernel (Winograd F(m x m, 3 x 3) takes 3x3)"
    if conv.stride != (1, 1) or conv.dilation != (1, 1):
        return "stride or dilation other than 1"
    if conv.groups != 1:
        return "a grouped convolution"
    if conv.c % conv.ic_block or conv.f % conv.oc_block:
        return "channels that are not whole blocks"
    if conv.dtype != "float32":
        return f"dtype {conv.dtype}"
    return None


def _row_sums(mat: np.ndarray, row, term, dtype: str):
    """``sum_k mat[row, k] * term(k)`` for a symbolic ``row``: one explicit sum per row (zero entries
    skipped, +-1 without a multiply), chosen by a select that folds once ``row`` is an unrolled constant."""
    def one(r: int):
        out = None
        for k, coef in enumerate(mat[r]):
            if coef == 0:
                continue
            t = term(k)
            t = t if coef == 1 else -t if coef == -1 else t * tirx.const(float(coef), dtype)
            out = t if out is None else out + t
        return out if out is not None else tirx.const(0.0, dtype)

    expr = one(mat.shape[0] - 1)
    for r in range(mat.shape[0] - 2, -1, -1):
        expr = tirx.Select(row == r, one(r), expr)
    return expr


def compute(data: te.Tensor, u: te.Tensor, spec: WinogradSpec) -> te.Tensor:
    """Data ``NCHW{a}c``, transformed weight ``U`` (:func:`transform_weight`) -> output ``NCHW{d}c``."""
    spec.check()
    conv, m, al = spec.conv, spec.m, spec.alpha
    a, d, dt = conv.ic_block, conv.oc_block, conv.dtype
    at, _, bt = algorithm.float_matrices(m)  # (A^T, G, B^T) in float64
    th, tw = spec.tiles_h, spec.tiles_w
    top, left = conv.pad[0], conv.pad[1]

    def pad_body(n, cb, y, x, ci):
        yy, xx = y - top, x - left
        inside = tirx.all(yy >= 0, yy < conv.h, xx >= 0, xx < conv.w)
        return tirx.if_then_else(inside, data[n, cb, tirx.min(tirx.max(yy, 0), conv.h - 1),
                                              tirx.min(tirx.max(xx, 0), conv.w - 1), ci], tirx.const(0.0, dt))

    padded = te.compute((conv.n, conv.c // a, th * m + 2, tw * m + 2, a), pad_body, name="wino_pad")
    tiles = (conv.n, th, tw)

    def bt_body(e, s, n, ty, tx, cb, ci):  # B^T d: rows of the tile combined
        return _row_sums(bt, e, lambda r: padded[n, cb, ty * m + r, tx * m + s, ci], dt)

    tmp = te.compute((al, al, *tiles, conv.c // a, a), bt_body, name="wino_bt")
    v = te.compute((al, al, *tiles, conv.c), lambda e, nu, n, ty, tx, c: _row_sums(
        bt, nu, lambda s: tmp[e, s, n, ty, tx, c // a, c % a], dt), name="wino_v")
    rc = te.reduce_axis((0, conv.c), name="rc")
    gemm = te.compute((al, al, *tiles, conv.f // d, d), lambda e, nu, n, ty, tx, fb, fi: te.sum(
        v[e, nu, n, ty, tx, rc] * u[e, nu, fb, rc, fi], axis=rc), name="wino_gemm",
        attrs={ANCHOR_ATTR: spec.to_json()})
    za = te.compute((m, al, *tiles, conv.f // d, d), lambda i, nu, n, ty, tx, fb, fi: _row_sums(
        at, i, lambda e: gemm[e, nu, n, ty, tx, fb, fi], dt), name="wino_at")

    def out_body(n, fb, y, x, fi):
        return _row_sums(at, x % m, lambda nu: za[y % m, nu, n, y // m, x // m, fb, fi], dt)

    return te.compute(conv.out_shape, out_body, name="wino_out")


def transform_weight(weight: np.ndarray, spec: WinogradSpec) -> np.ndarray:
    """``U[e, nu, F/d, C, d] = (G w G^T)[e, nu]`` of an OIHW weight (:func:`graphopt.winograd.filter_transform`,
    float64 then float32): the build-time constant the kernel reads, one contiguous ``d``-vector per channel,
    as the GEMM's register tile loads it."""
    conv, al = spec.conv, spec.alpha
    u = algorithm.filter_transform(weight, spec.m)  # [alpha*alpha, C, F]
    u = u.reshape(al, al, conv.c, conv.f // conv.oc_block, conv.oc_block).transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(u)


# ------------------------------------------------------------------------------------------------ relax

# The Relax module attribute carrying which convolutions take this kernel: {weight_digest: m}.  The graph
# stage marks convolutions by weight name (graphopt.winograd.mark); Relax constants have no names, so the
# import turns the names into digests of the weights' bytes (pipeline.relax_import), and the layout stage
# lowers a marked blocked conv here (pipeline.layout.nchwc).
MARKS_ATTR = "optimize_model.winograd"


def weight_digest(weight: np.ndarray) -> str:
    """What identifies a conv's weight across the ONNX import: its shape, dtype and bytes."""
    arr = np.ascontiguousarray(weight)
    h = hashlib.sha1(f"{arr.dtype}{arr.shape}".encode())
    h.update(arr.tobytes())
    return h.hexdigest()


def with_marks(mod: tvm.IRModule, marks: dict[str, int]) -> tvm.IRModule:
    """``mod`` carrying ``marks`` (weight digest -> m) for the layout stage."""
    return mod.with_attr(MARKS_ATTR, {k: int(v) for k, v in marks.items()}) if marks else mod


def marks_of(mod: tvm.IRModule) -> dict[str, int]:
    attrs = mod.attrs
    if attrs is None or MARKS_ATTR not in attrs:
        return {}
    return {str(k): int(v) for k, v in attrs[MARKS_ATTR].items()}


def marked_tile(call, marks: dict[str, int]) -> int | None:
    """The tile size a blocked Relax conv is marked for, if its weight is a constant the marks name and
    the kernel computes it (:func:`unsupported`); else None (it stays the direct conv)."""
    from .conv_nchwc import spec_of_call

    weight = call.args[1]
    if not marks or not isinstance(weight, tvm.ir.Constant):
        return None
    m = marks.get(weight_digest(weight.value.numpy()))
    if m is None or m not in TILES or unsupported(spec_of_call(call)) is not None:
        return None
    return m


def legalize(bb, call, m: int) -> relax.Expr:
    """A blocked Relax ``nn.conv2d`` whose weight is a constant, as this kernel: the weight transformed in
    numpy (:func:`transform_weight`) and passed as a new constant."""
    from .conv_nchwc import spec_of_call

    spec = WinogradSpec(spec_of_call(call), m)
    spec.check()
    weight = call.args[1]
    if not isinstance(weight, tvm.ir.Constant):
        raise ValueError("Winograd needs a constant weight")
    u = relax.const(transform_weight(weight.value.numpy(), spec))
    return bb.call_te(lambda x, w: compute(x, w, spec), call.args[0], u, primfunc_name_hint="winograd_nchwc")


def make_relax(spec: WinogradSpec, epilogue: str = "none"):
    """``main(data, U, [extra]) -> conv + epilogue``, the standalone module of
    :func:`kerneltune.templates.conv_nchwc.make_relax` (same epilogues) with the conv computed by this
    kernel."""
    def emit(bb, data, u):
        return bb.emit(bb.call_te(lambda x, w: compute(x, w, spec), data, u, primfunc_name_hint="winograd_nchwc"))

    return direct_relax(spec.conv, epilogue, kernel=(spec.weight_shape, emit))


def make_task(spec: WinogradSpec, epilogue: str = "none", name: str | None = None) -> Task:
    """A standalone Winograd task shaped like the pipeline's fused kernels; U is a parameter marked
    layout-free (a constant in a model)."""
    spec.check()
    fname, func = fused_kernel(make_relax(spec, epilogue))
    task = classify(name or fname, func)
    if task is None:
        raise ValueError(f"{fname} has no Winograd anchor")
    return task


# ------------------------------------------------------------------------------------------------- tasks

def anchor_spec(block) -> WinogradSpec | None:
    ann = block.annotations
    return WinogradSpec.from_json(str(ann[ANCHOR_ATTR])) if ANCHOR_ATTR in ann else None


ROLES = ("e", "nu", "n", "ty", "tx", "fb", "fi", "rc")


def classify(name: str, func: tirx.PrimFunc) -> Task | None:
    """A Task for a fused PrimFunc whose anchor is this kernel's GEMM (found by :data:`ANCHOR_ATTR`)."""
    try:
        blocks = root_blocks(func)
    except Exception:  # noqa: BLE001 - not a TIR body we can walk
        return None
    anchors = [(b, s) for b, s in ((b, anchor_spec(b)) for b in blocks) if s is not None]
    if len(anchors) != 1:
        return None
    anchor, spec = anchors[0]
    ivs = [(iv.var.name, _int(iv.dom.extent)) for iv in anchor.iter_vars]
    if len(ivs) != len(ROLES):
        return None
    axes = tuple(Axis(r, v, e, r == "rc") for r, (v, e) in zip(ROLES, ivs))
    conv = spec.conv
    executed = 2 * reduce(lambda x, y: x * y, (e for _, e in ivs), 1)
    epi = _epilogue_names(blocks, next(b for b in blocks if b.name_hint == "wino_out"))
    ins, outs = _io_specs(func, blocks)
    dims = {"N": conv.n, "C": conv.c, "H": conv.h, "W": conv.w, "F": conv.f, "KH": 3, "KW": 3,
            "OH": conv.out_h, "OW": conv.out_w, "a": conv.ic_block, "d": conv.oc_block, "m": spec.m,
            "TH": spec.tiles_h, "TW": spec.tiles_w, "useful_flops": conv.flops}
    shash = tvm_ffi.structural_hash(func) & 0xFFFFFFFF
    shape_part = "x".join(f"{k}{v}" for k, v in dims.items() if k != "useful_flops")
    key = f"{KIND}_{shape_part}_{conv.dtype}_{'+'.join(epi) or 'none'}_{shash:08x}"
    u_name = next((p.name for p in func.params if tuple(int(s) for s in p.shape) == spec.weight_shape), None)
    return Task(name=name, kind=KIND, func=func, flops=executed, key=key, anchor=anchor.name_hint, axes=axes,
                dims=dims, dtype=conv.dtype, epilogue=epi, block_names=tuple(b.name_hint for b in blocks),
                inputs=ins, outputs=outs, weights=(u_name,) if u_name else ())
