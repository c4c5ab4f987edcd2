"""GPU (cuda / rocm) template: OpEvo's / AutoTVM's "SSSRRSRS"-style tiling with shared and local caching.

Every spatial axis is split into 4 (blockIdx, vthread, threadIdx, inner), every reduction axis into 3 for
the matmul family (outer: shared-memory step, middle: register step, inner) and 2 for conv2d (as in OpEvo's
templates).  Loop order::

    blockIdx.x = fuse(S0...)  vthread = fuse(S1...)  threadIdx.x = fuse(S2...)
      R0...          <- both operands' tiles copied to shared memory (cooperative fetch by all threads)
        R1...        <- each thread copies its operand slices from shared to local (registers)
          [R2...]
            S3...    accumulate into the thread's local tile
      write-back of the local tile with the epilogue applied (at the threadIdx loop)

A conv's pad stays a separate, flat elementwise kernel (inlining it would put out-of-range reads into the
shared copy).  ``unroll`` (auto_unroll_max_step) and ``unroll_explicit`` are OpEvo's unroll knobs.
Invalid configs (more threads than the target allows, shared tiles over its limit) raise InvalidConfig
from :func:`apply`, before anything is built.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from ..space import ChoiceKnob, DiscreteKnob, SearchSpace
from ..task import Task
from .common import InvalidConfig, check_config, prepare, split_axes, tile_knobs, tiles

UNROLL = (0, 125, 256)


def _reduce_levels(task: Task) -> int:
    return 2 if task.kind == "conv2d" else 3


def space(task: Task) -> SearchSpace:
    return SearchSpace(tile_knobs(task, 4, _reduce_levels(task))
                       + [DiscreteKnob("unroll", UNROLL), ChoiceKnob("unroll_explicit", (0, 1))])


def limits(target: tvm.target.Target) -> tuple[int, int]:
    """(max threads per block, max shared memory bytes per block) of ``target``."""
    attrs = target.attrs
    threads = int(attrs["max_num_threads"]) if "max_num_threads" in attrs else 1024
    shared = int(attrs["max_shared_memory_per_block"]) if "max_shared_memory_per_block" in attrs else 48 * 1024
    return threads, shared


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def schedule(task: Task, config, target: tvm.target.Target) -> s_tir.Schedule:
    cfg = check_config(space(task), config)
    levels_r = _reduce_levels(task)
    factors = tiles(task, cfg, 4, levels_r)
    max_threads, max_shared = limits(target)
    sp = [f for f, a in zip(factors, task.axes) if not a.reduce]
    threads = _prod(f[2] for f in sp)
    if threads > max_threads:
        raise InvalidConfig(f"{threads} threads per block > {max_threads}")
    if _prod(f[1] for f in sp) > 64:
        raise InvalidConfig(f"{_prod(f[1] for f in sp)} virtual threads > 64 (unrolled code would explode)")

    p = prepare(task, inline_producers=False)
    sch = p.sch
    for blk in p.producers_left:  # the pad kernel: flat, one element per thread
        fused = sch.fuse(*sch.get_loops(blk))
        bx, tx = sch.split(fused, [None, min(256, max_threads)])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")

    operands = [r.source.name for r in sch.get(p.anchor).reads]
    parts = split_axes(sch, p.anchor, task, factors)
    spatial = [lp for lp, a in zip(parts, task.axes) if not a.reduce]
    reduction = [lp for lp, a in zip(parts, task.axes) if a.reduce]
    lvl = lambda ls, i, n: (ls[i] if len(ls) == n else (ls[0] if i == 0 else None))  # noqa: E731
    s = [[x for x in (lvl(ls, i, 4) for ls in spatial) if x is not None] for i in range(4)]
    r = [[x for x in (lvl(ls, i, levels_r) for ls in reduction) if x is not None] for i in range(levels_r)]
    sch.reorder(*s[0], *s[1], *s[2], *[x for lv in r for x in lv], *s[3])
    bx = sch.fuse(*s[0]) if len(s[0]) > 1 else s[0][0]
    vx = sch.fuse(*s[1]) if len(s[1]) > 1 else s[1][0]
    tx = sch.fuse(*s[2]) if len(s[2]) > 1 else s[2][0]
    sch.bind(bx, "blockIdx.x")
    sch.bind(vx, "vthread.x")
    sch.bind(tx, "threadIdx.x")
    sch.annotate(bx, "pragma_auto_unroll_max_step", cfg["unroll"])
    sch.annotate(bx, "pragma_unroll_explicit", cfg["unroll_explicit"])
    sch.reverse_compute_at(p.writeback, tx)

    anchor_loops = [sch.get(lp) for lp in sch.get_loops(p.anchor)]
    depth = 1 + next(i for i, lp in enumerate(anchor_loops) if lp.same_as(sch.get(r[0][-1])))
    shared_bytes = 0
    for name in operands:
        cache = sch.cache_read(p.anchor, name, "shared")
        sch.compute_at(cache, r[0][-1])
        loops = sch.get_loops(cache)[depth:]
        shared_bytes += _prod(sch.get(lp).extent for lp in loops) * tvm.DataType(task.dtype).bits // 8
        fused = sch.fuse(*loops)
        _, inner = sch.split(fused, [None, threads])
        sch.bind(inner, "threadIdx.x")
        local = sch.cache_read(p.anchor, name + "_shared", "local")
        sch.compute_at(local, r[1][-1])
    if shared_bytes > max_shared:
        raise InvalidConfig(f"{shared_bytes} bytes of shared memory per block > {max_shared}")
    sch.decompose_reduction(p.anchor, r[0][0])
    return sch


def _div(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def default_config(task: Task, target: tvm.target.Target):
    """A safe starting point, not a tuned one (only the build was checked here, no GPU was available).

    matmul family: 16x16 threads, 4x4 outputs per thread on the two innermost spatial axes, k step 8.
    conv2d: per block 16 filters (4 threads x 4) x 8 rows x 16 columns (8 threads x 2), rc step 8, whole
    kernel window -- data and weight tiles of a few KiB of shared memory.  Reduction steps shrink until the
    config passes the target's limits.
    """
    sp = space(task)
    levels_r = _reduce_levels(task)
    spatial = [a for a in task.axes if not a.reduce and a.extent > 1]
    inner2 = [a.role for a in spatial[-2:]]
    conv_plan = {"f": (4, 4), "y": (8, 1), "x": (8, 2)}
    for k_cap in (8, 4, 2, 1):
        values = {}
        for a in task.axes:
            if a.extent == 1:
                continue
            e = a.extent
            if a.reduce:
                cap = k_cap if a.role in ("k", "rc") else e
                step = _div(e, cap)
                values[f"tile_{a.role}"] = (e // step, step, 1) if levels_r == 3 else (e // step, step)
                continue
            if task.kind == "conv2d" and a.role in conv_plan:
                t = _div(e, conv_plan[a.role][0])
                i = _div(e // t, conv_plan[a.role][1])
            elif task.kind != "conv2d" and a.role in inner2:
                t = _div(e, 16)
                i = _div(e // t, 4)
            else:
                t, i = 1, 1
            values[f"tile_{a.role}"] = (e // (t * i), 1, t, i)
        values["unroll"] = 256
        values["unroll_explicit"] = 1
        config = tuple(values[n] for n in sp.names)
        try:
            schedule(task, config, target)
            return config
        except InvalidConfig:
            continue
    return config
