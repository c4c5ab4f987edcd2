"""Weights packed once, at build time, into the layout the kernel reads (TVM's layout-rewrite mechanism).

Why: inside a model a matmul's weight comes from DRAM, and the CPU template reads ``B[k, j-tile]``: one or
two cache lines per row of ``k``, rows a whole row stride (3-12 KiB) apart.  Packed as panels
``Bp[j // nb, k, j % nb]`` the same reads are one contiguous stream per panel.  Measured here with cold
caches (2 threads, Zen 5, the tuned configs of BERT-base): 128x768x768 0.461 -> 0.363 ms, 128x3072x768
1.83 -> 1.50 ms.  The copy is free at run time because the weights are constants: it runs once, at build.

How, with TVM's own machinery (the path MetaSchedule's ``RewriteLayout`` takes):

* the partition marks the parameters the Relax graph feeds with constants (``layout_free_buffers``, set by
  ``relax.transform.AttachAttrLayoutFreeBuffers``, read by :func:`kerneltune.task.layout_free_params`); the
  CPU template offers ``pack = prepack`` only for
  those, and writes the copy as a root block annotated :data:`PREPROC`;
* tuning times the kernel without the copy: :func:`strip` removes it (``RemoveWeightLayoutRewriteBlock``,
  the parameter takes the packed layout) and returns how to pack each such input, which
  :func:`pack_inputs` applies to the numpy inputs, so the output check still compares with the
  reference computed on unpacked inputs;
* the compiled model splits the copy into its own function (``relax.transform.SplitLayoutRewritePreproc``,
  :func:`split_weight_packing`) and the build's constant folding runs it on the weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import tvm
from tvm import s_tir, tirx

from kerneltune.machine_gate import measuring
from kerneltune.task import Task, build_func, root_blocks

PREPROC = "meta_schedule.layout_rewrite_preproc"


@dataclass(frozen=True)
class Packing:
    """How the kernel expects input ``param`` (its index among the function's parameters): element
    ``src[i...]`` goes to ``dst[index(i...)]`` of a ``shape`` array.  ``index_map`` is the TVM IndexMap as
    JSON, so a Packing travels to worker processes as plain data."""

    param: int
    shape: tuple[int, ...]
    index_map: str

    def apply(self, src: np.ndarray) -> np.ndarray:
        im = tvm.ir.load_json(self.index_map)
        if src.ndim != len(im.initial_indices):  # already packed, or another tensor: scattering it leaves garbage
            raise ValueError(f"packing input {self.param}: expects a rank-{len(im.initial_indices)} tensor, got "
                             f"shape {src.shape}")
        grid = np.indices(src.shape)
        env = {v.name: grid[i] for i, v in enumerate(im.initial_indices)}
        dst_idx = tuple(np.broadcast_to(_np_eval(e, env), src.shape) for e in im.final_indices)
        dst = np.empty(self.shape, src.dtype)
        dst[dst_idx] = src
        return dst


def _preproc_blocks(func: tirx.PrimFunc) -> list:
    """The packing copies (root-level blocks, where the template's ``cache_read`` puts them)."""
    return [b for b in root_blocks(func) if PREPROC in b.annotations]


def strip(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, list[Packing]]:
    """The kernel without its weight-packing copies (it then takes packed weights), and the packings."""
    blocks = _preproc_blocks(func)
    if not blocks:
        return func, []
    names = [p.name for p in func.params]
    packings = []
    for blk in blocks:
        store = blk.body
        load = store.value
        im = tirx.IndexMap(list(load.indices), list(store.indices), None)
        shape = tuple(int(s) for s in store.buffer.shape)
        packings.append(Packing(names.index(load.source.name), shape, tvm.ir.save_json(im)))
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(tvm.IRModule({"main": func}))
    return mod["main"], packings


def pack_inputs(inputs: Sequence[np.ndarray], packings: Sequence[Packing]) -> list[np.ndarray]:
    """``inputs`` (in parameter order) with every packed parameter rewritten into its packed layout."""
    out = list(inputs)
    for p in packings:
        out[p.param] = p.apply(out[p.param])
    return out


def kernel_timer(func: tirx.PrimFunc, task: Task, inputs: Sequence[np.ndarray], target: tvm.target.Target,
                 number: int, repeat: int, cold: bool) -> Callable[[], list[float]]:
    """``func`` (a scheduled kernel of ``task``) built for this machine and timed as the model runs it: its
    weight-packing copies stripped, ``inputs`` packed beforehand (``cold``: caches flushed before every run,
    as the tuner times).  Each call of the result times ``repeat`` runs of ``number`` calls (seconds): the
    in-process calibrations (the rows tile, the practical peak) time their candidates with it."""
    stripped, packings = strip(func)
    lib = build_func(stripped, target)
    dev = tvm.cpu()
    args = ([tvm.runtime.tensor(x, dev) for x in pack_inputs(inputs, packings)]
            + [tvm.runtime.empty(o.shape, o.dtype, dev) for o in task.outputs])
    flush = {"f_preproc": "cache_flush_cpu_non_first_arg"} if cold else {}
    evaluator = lib.time_evaluator("main", dev, number=number, repeat=repeat, **flush)

    def timed() -> list[float]:
        with measuring():  # a calibration inside a build: not beside another build (kerneltune.machine_gate)
            return [float(t) for t in evaluator(*args).results]
    return timed


def split_weight_packing(mod: tvm.IRModule) -> tvm.IRModule:
    """Move every kernel's packing copy into its own function, called on the constant weight, for the
    caller's constant folding to run at build time (``pipeline.passes.fold`` evaluates such copies in numpy;
    ``FoldConstant`` would build each with LLVM)."""
    from tvm import relax

    return tvm.transform.Sequential([_give_root_block, relax.transform.SplitLayoutRewritePreproc()])(mod)


@tirx.transform.prim_func_pass(opt_level=0, name="GiveRootBlock")
def _give_root_block(func: tirx.PrimFunc, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tirx.PrimFunc:
    """A kernel that is one opaque block (TOPI's ir_builder ``scatter_elements``) wrapped in a root block:
    SplitLayoutRewritePreproc reads the root block's children and fails on a root with none ("There should
    be a compute block if there is only one subtree under the root") - every ScatterElements model did."""
    if not isinstance(func.body, s_tir.SBlockRealize) or root_blocks(func):
        return func
    root = s_tir.SBlock([], [], [], "root", func.body)
    return func.with_body(s_tir.SBlockRealize([], True, root))


def _np_eval(expr, env: dict[str, np.ndarray]):
    """Evaluate an index expression (vars, integers, + - *, floordiv, floormod) on numpy index grids."""
    if isinstance(expr, tirx.Var):
        return env[expr.name]
    if isinstance(expr, (tirx.IntImm, int)):
        return int(expr.value if hasattr(expr, "value") else expr)
    if isinstance(expr, tirx.Cast):
        return _np_eval(expr.value, env)
    ops = {tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply, tirx.FloorDiv: np.floor_divide,
           tirx.FloorMod: np.mod}
    for cls, fn in ops.items():
        if isinstance(expr, cls):
            return fn(_np_eval(expr.a, env), _np_eval(expr.b, env))
    raise ValueError(f"cannot evaluate index expression {expr} ({type(expr).__name__})")
