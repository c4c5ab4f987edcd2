"""CPU template for the Winograd NCHW[x]c kernel (:mod:`kerneltune.templates.winograd_nchwc`).

Loop nests, one per stage, each parallel over its outer loops::

    wino_pad     parallel(n, C/a, rows)  vectorized(a)
    wino_v       parallel(tile, C/a)                        # one input tile of one channel block
                   wino_bt: e, s unrolled, vectorized(a)    #   B^T d, in registers
                   e, nu unrolled, vectorized(a)            #   (B^T d) B -> V[e, nu, tile, c]
    wino_gemm    parallel(e*nu, fb0)                        # alpha^2 GEMMs x output-channel chunks
                   p0                                       #   row tiles (tiles of the image)
                     c0                                     #   input-channel chunks (``c_order``)
                       c1
                         p1, fb1 unrolled, vectorized(d)    #   register tile: p1 x fb1 vectors
    wino_out     parallel(n, F/d, tile rows)                # the output transform + epilogue
                   tile column
                     wino_at: i, nu unrolled, vectorized(d) #   A^T M
                     i, j unrolled, vectorized(d)           #   (A^T M) A, bias/ReLU/residual, stored

Knobs: ``tile_p`` (tiles -> p0, p1: register rows), ``tile_fb`` (output blocks -> fb0, fb1: register
columns), ``tile_c`` (input channels -> c0, c1) with ``c_order`` (``inner``: the register tile sums all of
C, the chunks only order the reads; ``outer``: a chunk of U, ``c1 x fb1 x d``, serves every row tile from
L1 and the partial sums wait in M), ``unroll`` (``pragma_auto_unroll_max_step`` of the GEMM's chunk).
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from ..space import ChoiceKnob, DiscreteKnob, FactorKnob, ProductLimit, SearchSpace
from ..targets.caches import l1_block_bytes
from ..targets.host import vector_lanes, vector_registers
from ..task import Task
from .common import InvalidConfig, check_config
from .cpu import _largest_divisor_at_most

UNROLL = (0, 16, 64)
# Register tiles with more vector accumulators than this spill (see cpu_nchwc.MAX_ACCUMULATORS).
MAX_ACCUMULATORS = 28


def _vectors(task: Task, target: tvm.target.Target | None) -> int:
    d = task.dims["d"]
    return -(-d // vector_lanes(target, task.dtype)) if target is not None else 1


def space(task: Task, target: tvm.target.Target | None = None) -> SearchSpace:
    dims = task.dims
    knobs: list = [FactorKnob("tile_p", dims["P"], 2)]
    if dims["F"] // dims["d"] > 1:
        knobs.append(FactorKnob("tile_fb", dims["F"] // dims["d"], 2))
    knobs.append(FactorKnob("tile_c", dims["C"], 2))
    knobs.append(ChoiceKnob("c_order", ("inner", "outer")))
    knobs.append(DiscreteKnob("unroll", UNROLL))
    tile = ProductLimit((("tile_p", 1), ("tile_fb", 1)), MAX_ACCUMULATORS, _vectors(task, target))
    return SearchSpace(knobs, (tile,))


def _blocks(sch: s_tir.Schedule, task: Task) -> dict:
    return {name: sch.get_sblock(name) for name in task.block_names}


def schedule(task: Task, config, target: tvm.target.Target) -> s_tir.Schedule:
    cfg = check_config(space(task, target), config)
    dims = task.dims
    a, d, m = dims["a"], dims["d"], dims["m"]
    fp = tuple(cfg["tile_p"])
    ffb = tuple(cfg.get("tile_fb", (1, 1)))
    fc = tuple(cfg["tile_c"])
    if fp[1] * ffb[1] * _vectors(task, target) > MAX_ACCUMULATORS:
        raise InvalidConfig(f"register tile of {fp[1] * ffb[1]} vectors exceeds {MAX_ACCUMULATORS}")
    sch = s_tir.Schedule(task.func)
    b = _blocks(sch, task)
    names = list(task.block_names)
    after = names[names.index("wino_out"):]
    for name in after[:-1]:  # the output transform and the epilogue but its last: inlined into the store
        sch.compute_inline(b[name])
    store = b[after[-1]]

    # the padded input: a parallel copy
    loops = sch.get_loops(b["wino_pad"])
    sch.parallel(sch.fuse(*loops[:3]))
    sch.vectorize(loops[-1])

    # input transform: per tile and channel block, B^T d in registers, then V
    e, nu, p, c = sch.get_loops(b["wino_v"])
    cb, ci = sch.split(c, [None, a])
    sch.reorder(p, cb, e, nu, ci)
    outer = sch.fuse(p, cb)
    sch.parallel(outer)
    _in_registers(sch, b["wino_bt"], outer)
    sch.unroll(e)
    sch.unroll(nu)
    sch.vectorize(ci)

    # the GEMMs: register tile p1 x fb1 vectors accumulated in local over the channels
    gemm = b["wino_gemm"]
    e, nu, p, fb, fi, rc = sch.get_loops(gemm)
    bat = sch.fuse(e, nu)
    p0, p1 = sch.split(p, list(fp))
    fb0, fb1 = sch.split(fb, list(ffb))
    c0, c1 = sch.split(rc, list(fc))
    c_outer = cfg["c_order"] == "outer"
    if c_outer:
        sch.reorder(bat, fb0, c0, p0, c1, p1, fb1, fi)
    else:
        sch.reorder(bat, fb0, p0, c0, c1, p1, fb1, fi)
    par = sch.fuse(bat, fb0)
    sch.parallel(par)
    if not c_outer:
        acc = sch.cache_write(gemm, 0, "local")
        sch.reverse_compute_at(acc, p0)
        sch.vectorize(sch.get_loops(acc)[-1])
    sch.unroll(p1)
    sch.unroll(fb1)
    sch.vectorize(fi)
    if cfg["unroll"]:
        sch.annotate(par, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(par, "pragma_unroll_explicit", 1)
    init = sch.decompose_reduction(gemm, c0)
    sch.vectorize(sch.get_loops(init)[-1])

    # output transform + epilogue: per output tile, A^T M in registers, then the m x m outputs
    n, fb, y, x, fi = sch.get_loops(store)
    ty, i = sch.split(y, [None, m])
    tx, j = sch.split(x, [None, m])
    sch.reorder(n, fb, ty, tx, i, j, fi)
    rows = sch.fuse(n, fb, ty)
    sch.parallel(rows)
    _in_registers(sch, b["wino_at"], tx)
    sch.unroll(i)
    sch.unroll(j)
    sch.vectorize(fi)
    return sch


def _in_registers(sch: s_tir.Schedule, block, loop) -> None:
    """A transform's first half (``B^T d``, ``A^T M``) computed per tile at ``loop``, in a local buffer whose
    rows and columns are unrolled and whose channel lanes are one vector: LLVM keeps it in registers, and
    the selects of :func:`~kerneltune.templates.winograd_nchwc._row_sums` fold to one sum per row."""
    sch.compute_at(block, loop)
    sch.set_scope(block, 0, "local")
    loops = sch.get_loops(block)
    at = sch.get(loop)
    outer = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(at)) + 1
    for lp in loops[outer:-1]:
        sch.unroll(lp)
    sch.vectorize(loops[-1])


# --------------------------------------------------------------------------------------------- default

def default_config(task: Task, target: tvm.target.Target):
    sp = space(task, target)
    values = _default_dict(task, target)
    return tuple(values[name] for name in sp.names)


def _default_dict(task: Task, target: tvm.target.Target) -> dict:
    """A register tile of two output blocks (each broadcast V value feeds two FMAs) by the most tile rows
    that divide the tiles and keep the accumulators and a broadcast per row in the register file; the
    channels in one chunk unless one register tile's U panel (``C x fb1 x d``) is over an L1 block, where
    chunks of one L1 block go outside the rows (``c_order=outer``)."""
    dims = task.dims
    nvec = _vectors(task, target)
    fbs = dims["F"] // dims["d"]
    fb1 = 2 if fbs % 2 == 0 and nvec == 1 else 1
    regs = vector_registers(target)
    rows = max(1, min(12, (regs - fb1 * nvec) // (fb1 * nvec + 1)))
    p1 = _largest_divisor_at_most(dims["P"], rows)
    itemsize = tvm.DataType(task.dtype).bits // 8
    panel = dims["C"] * fb1 * dims["d"] * itemsize
    block = l1_block_bytes(target)
    c1 = dims["C"]
    order = "inner"
    if panel > 2 * block:
        c1 = _largest_divisor_at_most(dims["C"], max(dims["a"], block // (fb1 * dims["d"] * itemsize)))
        order = "outer"
    return {"tile_p": (dims["P"] // p1, p1), "tile_fb": (fbs // fb1, fb1), "tile_c": (dims["C"] // c1, c1),
            "c_order": order, "unroll": 16}


__all__ = ["space", "schedule", "default_config", "InvalidConfig"]
