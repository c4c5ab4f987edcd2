"""CPU template for u8 x s8 -> s32 products by a constant weight: a dot-product instruction as the inner loop.

Which tasks: a matmul (or batch-1 matmul: leading extent-1 axes) whose anchor accumulates
``int32(A[.., k]) * int32(B[k, j])``, or an implicit-GEMM NHWC conv (kind ``conv2d_nhwc``:
``out[p, j] += X[pixel(p) + tap(ry, rx), k] * W[ry, rx, k, j]``, the taps two more reduction loops around ``k``),
with A uint8 and B an int8 model weight, stored as int16 for the 16-bit multiply-adds (:mod:`pipeline.passes.int8`
puts every quantized product of a model in this form), on an x86 CPU: the instruction is the best the target has
(:func:`~kerneltune.templates.int8_intrin.instruction_for`: AVX-512 VNNI's ``vpdpbusd``, 16 lanes x 4
bytes; AVX-VNNI's, 8 x 4; exact 16-bit multiply-adds, 16 x 2 on AVX-512BW and 8 x 2 on AVX2).  Other int8
products take the generic template (:mod:`.cpu`): widened int32 multiply-adds, correct, about 3x slower.

Loop nest (rows = every spatial axis but the last, fused; ``j`` the columns; ``k`` the reduction)::

    parallel(rows_o, j_o)                 # output tiles over the cores
      j_1                                 # <- write-back (the dequantize / requantize epilogue) here
        [ry, rx]                          # a conv's taps (implicit GEMM: A read in place, no im2col copy)
        k_o                               # k-block: the B panel (kb x nv x lanes x depth bytes) in L1
          k_i                             #   groups of ``depth``
            rows_r (unrolled)             # register tile: mr rows x nv vectors of int32 accumulators
              j_v (unrolled)
                [lanes x depth]           # tensorized: one instruction (:mod:`.int8_intrin`)

B is pre-packed at build time as ``[N/lanes, (KH, KW,) K/depth, lanes, depth]`` (each instruction's bytes
contiguous), with the same layout-rewrite mechanism as the fp32 template's panels (:mod:`kerneltune.prepack`).
A is read in place: its ``depth`` bytes of ``k`` are contiguous in a row (a conv's: in a pixel's channels).
The conv's rows are one fused iterator in the compute itself: fusing ``y`` and ``x`` with a schedule primitive
leaves bindings that ``tensorize`` cannot blockize.

Knobs: ``tile_rows`` (outer, register rows), ``tile_j`` (outer, write-back tile, vectors in the register
tile; in units of ``lanes`` columns), ``tile_k`` (k-blocks, groups of ``depth`` per block).  Defaults from
the machine: the register tile fills :func:`~kerneltune.targets.host.vector_registers` minus the B vectors
and the broadcast, and the k-block keeps the B panel in a quarter of the L1 block
(:func:`~kerneltune.targets.caches.l1_block_bytes`).
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from ..prepack import PREPROC
from ..space import FactorKnob, SearchSpace
from ..task import IMPLICIT_CONV, Task, mac_operands, root_blocks, symbolic_axes
from ..targets.caches import l1_block_bytes
from ..targets.host import vector_registers
from .common import InvalidConfig, check_config, prepare
from .int8_intrin import Instruction, instruction_for, registered

KINDS = ("matmul", "batch_matmul", IMPLICIT_CONV)
# the least x86 target with a dot-product instruction (AVX2's 16-bit multiply-adds): a kind only this template
# schedules (IMPLICIT_CONV) is checked against it (kerneltune.templates.task_for)
LEAST_TARGET = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "x86-64-v3"})


def applies(task: Task, target: tvm.target.Target) -> bool:
    """Whether this template schedules ``task`` on ``target`` (module docstring)."""
    if task.kind not in KINDS or task.dtype != "int32" or task.dims.get("B", 1) != 1:
        return False
    if task.dims.get("ta") or task.dims.get("tb"):
        return False
    ins = instruction_for(target, task.dims["N"])
    if ins is None:
        return False
    operands = _operands(task)
    if operands is None:
        return False
    (a_name, a_dtype), (b_name, b_dtype) = operands
    k, n = task.dims["K"], task.dims["N"]
    return (a_dtype == "uint8" and b_dtype == ins.weight and b_name in task.weights
            and k % ins.depth == 0 and n % ins.lanes == 0)


def _operands(task: Task) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """(name, dtype) of the anchor's A and B loads (through their int32 casts)."""
    block = next((b for b in root_blocks(task.func) if b.name_hint == task.anchor), None)
    ops = mac_operands(block) if block is not None else None
    if ops is None:
        return None
    (a, b) = ops  # TOPI's matmul multiplies int32(A) * int32(B), in that order
    return (a.source.name, str(a.source.dtype)), (b.source.name, str(b.source.dtype))


def _extents(task: Task) -> tuple[int, int, int]:
    return task.dims["M"], task.dims["N"], task.dims["K"]


def _instruction(task: Task, target: tvm.target.Target) -> Instruction:
    ins = instruction_for(target, task.dims["N"])
    if ins is None:
        raise InvalidConfig(f"no int8 dot-product instruction on {target}")
    return ins


def space(task: Task, target: tvm.target.Target) -> SearchSpace:
    """Tiles in units of the target's instruction (its lanes along ``j``, its depth along ``k``)."""
    m, n, k = _extents(task)
    ins = _instruction(task, target)
    return SearchSpace([FactorKnob("tile_rows", m, 2), FactorKnob("tile_j", n // ins.lanes, 3),
                        FactorKnob("tile_k", k // ins.depth, 2)])


def default_config(task: Task, target: tvm.target.Target):
    """Register tile: ``mr`` rows x ``nv`` vectors of 16 int32 accumulators, the most that fit beside one
    register per B vector and one for A's broadcast (32 AVX-512 registers: 6 x 4 + 4 + 1), ``mr`` and
    ``nv`` dividing the rows and column groups (a 7 x 7 conv's 49 rows: 7 x 3); the k-block holds the B
    panel (``kb x nv x 64`` bytes) in a quarter of the L1 block (4 KiB of a 48 KiB L1d), which measured best
    on an Intel Xeon (Emerald Rapids, 2 threads, 128 x 768 x 768: 64 deep 623 GOPS, 256 deep 417); the
    write-back tile is the register tile."""
    m, n, k = _extents(task)
    ins = _instruction(task, target)
    groups, kgroups = n // ins.lanes, k // ins.depth
    regs = vector_registers(target)
    if ins.depth == 4:
        tiles = [(mr * nv, nv, mr) for nv in _divisors(groups) if nv <= 4 for mr in _divisors(m)
                 if mr * nv + nv + 1 <= regs]
    else:
        # the 16-bit path spends shuffle-port work on every A broadcast (2 bytes zero-extended), so a square
        # tile that shares it beats filling the registers with rows: on x86-64-v3 code (Intel Xeon, 2 threads,
        # 3136 x 576 x 64) 4 x 4 ran 78 GOPS, 2 x 4 70, 14 x 1 44 (B then sign-extended in the loop too).  Rows
        # no 4 divides take up to 7 (ResNet-50's 7 x 7 convs, 49 rows, 512 -> 512: 7 x 2 121-135 GOPS, 1 x 4
        # 62-89, 7 x 1 85)
        tiles = [(mr * nv, nv, mr) for nv in _divisors(groups) if nv <= 4 for mr in _divisors(m)
                 if mr <= 7 and mr * nv <= 16]
    _, nv, mr = max(tiles)
    panel_row = ins.depth * nv * ins.lanes * tvm.DataType(ins.weight).bits // 8  # B bytes per group of k
    kb = max(d for d in _divisors(kgroups) if d * panel_row <= l1_block_bytes(target) // 4)
    cfg = {"tile_rows": (m // mr, mr), "tile_j": (groups // nv, 1, nv), "tile_k": (kgroups // kb, kb)}
    return tuple(cfg[kn.name] for kn in space(task, target).knobs)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedule(task: Task, config, target: tvm.target.Target) -> s_tir.Schedule:
    ins = _instruction(task, target)
    lanes, depth = ins.lanes, ins.depth
    cfg = check_config(space(task, target), config)
    (rows_o, mr), (j_o, j_1, nv), (k_o, kb) = cfg["tile_rows"], cfg["tile_j"], cfg["tile_k"]
    # a kernel serving a range of lengths (pipeline.symbolic): its rows padded to whole register tiles (a
    # padded u8 copy: read through clamped indices, the A operand no longer matches the instruction's
    # pattern), their count following the length
    symbolic = symbolic_axes(task)
    if any(a.role in symbolic for a in task.axes if a.reduce or a.role == task.vector_axis):
        raise InvalidConfig(f"{task.name}: a symbolic column or depth does not split into the instruction's tiles")
    padding = [mr if a.role in symbolic else 1 for a in task.axes] if symbolic else None
    # producers (a zero-point cast) inlined into the anchor
    p = prepare(task, inline_producers=True, einsum_padding=padding)
    if padding:  # the padded copy: parallel over its rows, its depth in vectors (K is whole 4-deep groups)
        for blk in p.producers_left[:]:
            if p.sch.get(blk).name_hint.endswith("_pad"):
                p.producers_left.remove(blk)
                loops = p.sch.get_loops(blk)
                p.sch.parallel(p.sch.fuse(*loops[:-1]) if len(loops) > 1 else loops[0])
    if p.producers_left:
        raise InvalidConfig(f"{task.name}: a producer of the int8 product cannot be inlined")
    sch, anchor, writeback = p.sch, p.anchor, p.writeback
    packed = sch.cache_read(anchor, _b_index(sch, anchor, task), "global")
    if task.kind == IMPLICIT_CONV:
        sch.transform_layout(packed, ("write", 0),
                             lambda r, s, kk, j: (j // lanes, r, s, kk // depth, j % lanes, kk % depth))
    else:
        sch.transform_layout(packed, ("write", 0), lambda kk, j: (j // lanes, kk // depth, j % lanes, kk % depth))
    sch.annotate(packed, PREPROC, True)
    loops = sch.get_loops(anchor)
    if task.kind == IMPLICIT_CONV:
        row_loops, j, taps, kk = loops[:1], loops[1], loops[2:4], loops[4]
    else:
        *row_loops, j, kk = loops
        taps = []
    rows = sch.fuse(*row_loops) if len(row_loops) > 1 else row_loops[0]
    r0, r1 = sch.split(rows, [None if symbolic else rows_o, mr])
    j0, j1, j2, j3 = sch.split(j, [j_o, j_1, nv, lanes])
    k0, k1, k2 = sch.split(kk, [k_o, kb, depth])
    sch.reorder(r0, j0, j1, *taps, k0, k1, r1, j2, j3, k2)
    outer = sch.fuse(r0, j0)
    sch.parallel(outer)
    sch.reverse_compute_at(writeback, j1)
    wb_loops = sch.get_loops(writeback)
    inner = sch.get(wb_loops[-1]).extent
    if int(inner) % lanes == 0:
        lo, li = sch.split(wb_loops[-1], [None, lanes])
        sch.vectorize(li)
    sch.decompose_reduction(anchor, taps[0] if taps else k0)
    sch.unroll(r1)
    sch.unroll(j2)
    try:
        sch.tensorize(j3, registered(ins))
    except RuntimeError as exc:  # TVM's InternalError / ScheduleError: a tile that breaks the 16 x 4 pattern
        raise InvalidConfig(f"int8 tile does not tensorize: {str(exc).splitlines()[0][:200]}") from None
    return sch


def _b_index(sch, anchor, task: Task) -> int:
    names = [r.source.name for r in sch.get(anchor).reads]
    b_name = _operands(task)[1][0]
    return names.index(b_name)


def apply(task: Task, config, target: tvm.target.Target) -> tirx.PrimFunc:
    return schedule(task, config, target).mod["main"].with_attr("tirx.is_scheduled", True)
