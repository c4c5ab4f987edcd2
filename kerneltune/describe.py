"""A tuning task in words a person can check against the model: the operator, its logical shapes (the conv as
``N,C,H,W * O,I,KH,KW``, the matmul as ``MxK * KxN``), its parameters and, for a blocked convolution, the layouts
it reads and writes.  ``tune-kernels MODEL --list`` prints it next to each task; the task's ``key`` (what
tuning records are stored under) is for machines.
"""
from __future__ import annotations

from . import conv_nchwc
from .task import Task, root_blocks


def _x(shape) -> str:
    return "x".join(str(int(d)) for d in shape)


def _pair(v: tuple[int, int]) -> str:
    return str(v[0]) if v[0] == v[1] else f"{v[0]}x{v[1]}"


def conv_spec(task: Task) -> conv_nchwc.ConvSpec:
    """The :class:`~kerneltune.conv_nchwc.ConvSpec` a ``conv2d_nchwc`` task's anchor carries (its padding is
    not among ``task.dims``, which make up the records' key)."""
    return next(s for s in map(conv_nchwc.anchor_spec, root_blocks(task.func)) if s is not None)


def describe_conv_nchwc(spec: conv_nchwc.ConvSpec) -> str:
    """``conv 1x64x56x56 * 64x64x3x3 (N,C,H,W * O,I,KH,KW) stride 1 pad 1 -> 1x64x56x56, NCHW16c -> NCHW16c``:
    the logical convolution, then the blocked layouts of its data and output (``a``/``d`` channels a block;
    the weight stays logical OIHW in the graph and is packed at build time)."""
    pad = spec.pad
    params = [f"stride {_pair(spec.stride)}", f"pad {pad[0] if len(set(pad)) == 1 else ','.join(map(str, pad))}"]
    if spec.dilation != (1, 1):
        params.append(f"dilation {_pair(spec.dilation)}")
    if spec.depthwise:
        params.append("depthwise")
    elif spec.groups > 1:
        params.append(f"groups {spec.groups}")
    return (f"conv {_x((spec.n, spec.c, spec.h, spec.w))} * {_x(spec.weight_shape)} (N,C,H,W * O,I,KH,KW) "
            f"{' '.join(params)} -> {_x((spec.n, spec.f, spec.out_h, spec.out_w))}, "
            f"NCHW{spec.ic_block}c -> NCHW{spec.oc_block}c")


def describe(task: Task) -> str:
    """One line for ``task`` (see the module docstring)."""
    d = task.dims
    if task.kind == conv_nchwc.KIND:
        return describe_conv_nchwc(conv_spec(task))
    if task.kind == "conv2d":
        data = next((t.shape for t in task.inputs if len(t.shape) == 4 and t.shape[1] == d["C"]), None)
        weight = (d["F"], d["C"] // d["G"], d["KH"], d["KW"])
        groups = "" if d["G"] == 1 else " depthwise" if d["G"] == d["C"] == d["F"] else f" groups {d['G']}"
        src = _x(data) if data is not None else f"{d['N']}x{d['C']}xHxW"
        return (f"conv {src} * {_x(weight)} (N,C,H,W * O,I,KH,KW){groups} -> {_x((d['N'], d['F'], d['OH'], d['OW']))}"
                ", NCHW -> NCHW")
    if task.kind in ("matmul", "batch_matmul"):
        stored = [s for s, t in (("A as KxM", d.get("ta")), ("B as NxK", d.get("tb"))) if t]
        batch = f"{d['B']} x " if "B" in d else ""
        return (f"{task.kind} {batch}{d['M']}x{d['K']} * {d['K']}x{d['N']} (MxK * KxN) -> {batch}{d['M']}x{d['N']}"
                + (f", stored {' and '.join(stored)}" if stored else ""))
    return task.kind
