"""A tuning task in words a person can check against the model: the operator, its logical shapes (the conv as
``N,C,H,W * O,I,KH,KW``, the matmul as ``MxK * KxN``), its parameters and, for a blocked convolution, the layouts
it reads and writes.  ``tune-kernels MODEL --list`` prints it next to each task; the task's ``key`` (what
tuning records are stored under) is for machines.
"""
from __future__ import annotations

from tvm.sym.pattern import detect_linear_equation

from .templates import conv_nchwc, winograd_nchwc
from .task import IMPLICIT_CONV, Task, root_blocks


def _x(shape) -> str:
    return "x".join(str(int(d)) for d in shape)


def _pair(v: tuple[int, int]) -> str:
    return str(v[0]) if v[0] == v[1] else f"{v[0]}x{v[1]}"


def conv_spec(task: Task) -> conv_nchwc.ConvSpec:
    """The :class:`~kerneltune.templates.conv_nchwc.ConvSpec` a ``conv2d_nchwc`` task's anchor carries (its padding is
    not among ``task.dims``, which make up the records' key)."""
    return next(s for s in map(conv_nchwc.anchor_spec, root_blocks(task.func)) if s is not None)


def _conv_line(shapes: tuple, geometry: tuple, groups: int, depthwise: bool, layouts: str) -> str:
    """``shapes``: (data, weight, output); ``geometry``: (stride, pad, dilation)."""
    (data, weight, out), (stride, pad, dilation) = shapes, geometry
    params = [f"stride {_pair(stride)}", f"pad {pad[0] if len(set(pad)) == 1 else ','.join(map(str, pad))}"]
    if tuple(dilation) != (1, 1):
        params.append(f"dilation {_pair(dilation)}")
    if depthwise:
        params.append("depthwise")
    elif groups > 1:
        params.append(f"groups {groups}")
    return f"conv {_x(data)} * {_x(weight)} (N,C,H,W * O,I,KH,KW) {' '.join(params)} -> {_x(out)}, {layouts}"


def describe_conv_nchwc(spec: conv_nchwc.ConvSpec) -> str:
    """``conv 1x64x56x56 * 64x64x3x3 (N,C,H,W * O,I,KH,KW) stride 1 pad 1 -> 1x64x56x56, NCHW16c -> NCHW16c``:
    the logical convolution, then the blocked layouts of its data and output (``a``/``d`` channels a block;
    the weight stays logical OIHW in the graph and is packed at build time)."""
    return _conv_line(((spec.n, spec.c, spec.h, spec.w), spec.weight_shape, (spec.n, spec.f, spec.out_h, spec.out_w)),
                      (spec.stride, spec.pad, spec.dilation), spec.groups, spec.depthwise,
                      f"NCHW{spec.ic_block}c -> NCHW{spec.oc_block}c")


def nchw_conv_geometry(task: Task) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(stride, pad top/left/bottom/right, dilation) of an NCHW ``conv2d`` task, read off its PrimFunc as
    LegalizeOps writes it (they are not among ``task.dims``, which make up the records' key): the anchor reads
    the data at ``y*stride + ry*dilation``, and a pad block, when there is one, reads the input at
    ``i - pad_top``.  None when the kernel does not have that form."""
    try:
        blocks = root_blocks(task.func)
        anchor = next(b for b in blocks if b.name_hint == task.anchor)
        var = {a.role: iv.var for a, iv in zip(task.axes, anchor.iter_vars)}
        data = next(r for r in anchor.reads if len(r.region) == 4 and not r.region[2].min.same_as(var["ry"]))
        stride, dilation = [], []
        for axis, (o, k) in ((2, ("y", "ry")), (3, ("x", "rx"))):
            coef = [int(c) for c in detect_linear_equation(data.region[axis].min, [var[o], var[k]])]
            if len(coef) != 3 or coef[2] != 0 or coef[0] <= 0:
                return None
            stride.append(coef[0])
            dilation.append(coef[1] or 1)  # a 1-wide kernel's ry may be folded away
        pad = [0, 0, 0, 0]
        producer = next((b for b in blocks if any(w.source.same_as(data.source) for w in b.writes)), None)
        if producer is not None:
            src = producer.reads[0]
            for axis, (lo, hi) in ((2, (0, 2)), (3, (1, 3))):
                coef = [int(c) for c in detect_linear_equation(src.region[axis].min, [producer.iter_vars[axis].var])]
                if len(coef) != 2 or coef[0] != 1:
                    return None
                pad[lo] = -coef[1]
                pad[hi] = int(data.source.shape[axis]) - int(src.source.shape[axis]) - pad[lo]
    except (StopIteration, KeyError, IndexError, TypeError, ValueError):
        return None
    return tuple(stride), tuple(pad), tuple(dilation)


def describe(task: Task) -> str:
    """One line for ``task`` (see the module docstring)."""
    d = task.dims
    if task.kind == conv_nchwc.KIND:
        return describe_conv_nchwc(conv_spec(task))
    if task.kind == winograd_nchwc.KIND:
        spec = next(s for s in map(winograd_nchwc.anchor_spec, root_blocks(task.func)) if s is not None)
        return f"{describe_conv_nchwc(spec.conv)}, Winograd F({spec.m}x{spec.m},3x3)"
    if task.kind == "conv2d":
        data = next((t.shape for t in task.inputs if len(t.shape) == 4 and t.shape[1] == d["C"]), None)
        weight = (d["F"], d["C"] // d["G"], d["KH"], d["KW"])
        out = (d["N"], d["F"], d["OH"], d["OW"])
        geometry = nchw_conv_geometry(task)
        if data is not None and geometry is not None:
            return _conv_line((data, weight, out), geometry, d["G"], 1 < d["G"] == d["C"] == d["F"], "NCHW -> NCHW")
        return f"conv {_x(data) if data else '?'} * {_x(weight)} (N,C,H,W * O,I,KH,KW) -> {_x(out)}, NCHW -> NCHW"
    if task.kind == IMPLICIT_CONV:
        return (f"conv {d['M']} pixels x {d['KH']}x{d['KW']}x{d['K']} * {d['KH']}x{d['KW']}x{d['K']}x{d['N']} "
                f"(rows x KH,KW,C * KH,KW,C,O) -> {d['M']}x{d['N']}, NHWC -> NHWC, implicit GEMM")
    if task.kind in ("matmul", "batch_matmul"):
        stored = [s for s, t in (("A as KxM", d.get("ta")), ("B as NxK", d.get("tb"))) if t]
        batch = f"{d['B']} x " if "B" in d else ""
        return (f"{task.kind} {batch}{d['M']}x{d['K']} * {d['K']}x{d['N']} (MxK * KxN) -> {batch}{d['M']}x{d['N']}"
                + (f", stored {' and '.join(stored)}" if stored else ""))
    return task.kind
