"""CPU template for the Winograd NCHW[x]c kernel (:mod:`kerneltune.templates.winograd_nchwc`).

The kernel works one chunk of tiles at a time, so that what the stages hand each other stays in the
core's cache (the transformed input is (m+2)^2/m^2 times the input, the GEMMs' output as much times the
output: ResNet-50's 64-channel layer at 56x56 in F(4x4) makes 1.8 MB of each, which streamed through
memory when each stage ran over the whole map)::

    parallel(n, ty0, tx0)                          # a chunk: ty1*ty2 x tx1*tx2 tiles
      wino_pad: the chunk's input rows, zero-padded
      wino_v: per tile and channel block           # B^T d B, the first half (wino_bt) in registers
      e*nu                                         # alpha^2 GEMMs
        fb0                                        #   output-channel chunks
          [c0]                                     #   input-channel chunks here with c_order=outer
          ty1, tx1                                 #   register tiles of the chunk
            [c0] c1                                #   channels
              ty2, tx2, fb1 unrolled, vectorized(d) #  register tile: ty2*tx2 tiles x fb1 vectors
      per tile: wino_at (A^T M, in registers), then its m x m outputs + epilogue, stored

Knobs: ``tile_ty`` / ``tile_tx`` (tile rows / columns -> parallel chunks, tiles of a chunk, register
rows), ``tile_fb`` (output blocks -> chunks, register columns), ``tile_c`` (input channels -> c0, c1) with
``c_order`` (``inner``: the register tile sums all of C; ``outer``: one chunk of U, ``c1 x fb1 x d``,
serves every register tile of the chunk from L1 and the partial sums wait in M), ``unroll``
(``pragma_auto_unroll_max_step`` of the chunk).
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from ..space import ChoiceKnob, DiscreteKnob, FactorKnob, ProductLimit, SearchSpace
from ..targets.caches import l1_block_bytes
from ..targets.host import num_cores, vector_registers
from ..task import Task
from .common import InvalidConfig, check_config
from .cpu import _largest_divisor_at_most
from .cpu_nchwc import _extent, _factors, _vectors_per_block

UNROLL = (0, 16, 64)
# Register tiles with more vector accumulators than this spill (see cpu_nchwc.MAX_ACCUMULATORS).
MAX_ACCUMULATORS = 28


def space(task: Task, target: tvm.target.Target | None = None) -> SearchSpace:
    dims = task.dims
    knobs: list = []
    for role in ("ty", "tx"):
        if _extent(task, role) > 1:
            knobs.append(FactorKnob(f"tile_{role}", _extent(task, role), 3))
    if dims["F"] // dims["d"] > 1:
        knobs.append(FactorKnob("tile_fb", dims["F"] // dims["d"], 3))
    knobs.append(FactorKnob("tile_c", dims["C"], 2))
    knobs.append(ChoiceKnob("c_order", ("inner", "outer")))
    knobs.append(DiscreteKnob("unroll", UNROLL))
    tile = ProductLimit((("tile_ty", 2), ("tile_tx", 2), ("tile_fb", 2)), MAX_ACCUMULATORS, _vectors_per_block(task, target))
    return SearchSpace(knobs, (tile,))


def _blocks(sch: s_tir.Schedule, task: Task) -> dict:
    return {name: sch.get_sblock(name) for name in task.block_names}


def _chunk_loops(sch: s_tir.Schedule, block, extents: list[tuple[str, int]]) -> dict:
    """The loops ``compute_at`` made for ``block`` under a chunk, by role: it makes one per block variable
    whose extent in the chunk is over 1, in the block's order (``extents``), and none for the others."""
    loops = sch.get_loops(block)[1:]
    present = [role for role, ext in extents if ext > 1]
    if len(loops) != len(present):
        raise InvalidConfig(f"{sch.get(block).name_hint}: {len(loops)} loops under the chunk, expected {present}")
    return dict(zip(present, loops))


def schedule(task: Task, config, target: tvm.target.Target) -> s_tir.Schedule:
    cfg = check_config(space(task, target), config)
    dims = task.dims
    a, d, m = dims["a"], dims["d"], dims["m"]
    al = m + 2
    fy, fx = _factors(cfg, "ty", task, 3), _factors(cfg, "tx", task, 3)
    ffb, fc = _factors(cfg, "fb", task, 3), tuple(cfg["tile_c"])
    if fy[2] * fx[2] * ffb[2] * _vectors_per_block(task, target) > MAX_ACCUMULATORS:
        raise InvalidConfig(f"register tile of {fy[2] * fx[2] * ffb[2]} vectors exceeds {MAX_ACCUMULATORS}")
    rows, cols = fy[1] * fy[2], fx[1] * fx[2]  # a chunk's tiles
    fbs = ffb[1] * ffb[2]  # a chunk's output blocks
    sch = s_tir.Schedule(task.func)
    b = _blocks(sch, task)
    names = list(task.block_names)
    after = names[names.index("wino_out"):]
    for name in after[:-1]:  # the output transform and the epilogue but its last: inlined into the store
        sch.compute_inline(b[name])
    store = b[after[-1]]
    c_outer = cfg["c_order"] == "outer"
    acc = None if c_outer else sch.cache_write(b["wino_gemm"], 0, "local")

    # the chunks: the store's tiles, parallel; per tile, A^T M in registers, then its outputs + epilogue
    n, fb, y, x, fi = sch.get_loops(store)
    ty, i = sch.split(y, [None, m])
    tx, j = sch.split(x, [None, m])
    ty0, ty1 = sch.split(ty, [None, rows])
    tx0, tx1 = sch.split(tx, [None, cols])
    fbp, fb = sch.split(fb, [ffb[0], fbs])
    sch.reorder(n, fbp, ty0, tx0, fb, ty1, tx1, i, j, fi)
    chunk = sch.fuse(n, fbp, ty0, tx0)
    sch.parallel(chunk)
    if cfg["unroll"]:
        sch.annotate(chunk, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(chunk, "pragma_unroll_explicit", 1)
    _in_registers(sch, b["wino_at"], tx1)
    sch.unroll(i)
    sch.unroll(j)
    sch.vectorize(fi)

    # the chunk's GEMMs before it: register tile ty2*tx2 tiles x fb1 vectors
    gemm = b["wino_gemm"]
    if acc is not None:
        sch.compute_at(acc, chunk)
    sch.compute_at(gemm, chunk)
    loops = _chunk_loops(sch, gemm, [("e", al), ("nu", al), ("n", 1), ("ty", rows), ("tx", cols), ("fb", fbs),
                                     ("fi", d), ("rc", dims["C"])])
    unit = lambda: sch.add_unit_loop(gemm)  # noqa: E731 - a role the chunk left without a loop
    ty1, ty2 = sch.split(loops["ty"], [fy[1], fy[2]]) if "ty" in loops else (unit(), unit())
    tx1, tx2 = sch.split(loops["tx"], [fx[1], fx[2]]) if "tx" in loops else (unit(), unit())
    fb0, fb1 = sch.split(loops["fb"], list(ffb[1:])) if "fb" in loops else (unit(), unit())
    c0, c1 = sch.split(loops["rc"], list(fc))
    fi = loops["fi"]
    bat = sch.fuse(loops["e"], loops["nu"])
    if c_outer:
        sch.reorder(bat, fb0, c0, ty1, tx1, c1, ty2, tx2, fb1, fi)
    else:
        sch.reorder(bat, fb0, ty1, tx1, c0, c1, ty2, tx2, fb1, fi)
        sch.reverse_compute_at(acc, tx1)
        sch.vectorize(sch.get_loops(acc)[-1])
    for lp in (ty2, tx2, fb1):
        sch.unroll(lp)
    sch.vectorize(fi)
    init = sch.decompose_reduction(gemm, c0)
    sch.vectorize(sch.get_loops(init)[-1])

    # the chunk's input transform before its GEMMs: per tile and channel block, B^T d in registers
    v = b["wino_v"]
    sch.compute_at(v, chunk)
    loops = _chunk_loops(sch, v, [("e", al), ("nu", al), ("n", 1), ("ty", rows), ("tx", cols), ("c", dims["C"])])
    cb, ci = sch.split(loops["c"], [None, a])
    sch.reorder(*[loops[r] for r in ("ty", "tx") if r in loops], cb, loops["e"], loops["nu"], ci)
    _in_registers(sch, b["wino_bt"], cb)
    sch.unroll(loops["e"])
    sch.unroll(loops["nu"])
    sch.vectorize(ci)
    sch.compute_at(b["wino_pad"], chunk)
    sch.vectorize(sch.get_loops(b["wino_pad"])[-1])
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
    """A register tile of two output blocks (each broadcast V value feeds two FMAs) by the most tiles of a
    row that divide it and keep the accumulators and a broadcast per tile in the register file (a row too
    short for it adds rows); chunks of whole tile rows, as many as two per core, else fewer rows; the
    channels in one chunk unless one register tile's U panel (``C x fb1 x d``) is over two L1 blocks, where
    chunks of one L1 block go outside the register tiles (``c_order=outer``)."""
    dims = task.dims
    nvec = _vectors_per_block(task, target)
    fbs = dims["F"] // dims["d"]
    regs = vector_registers(target)
    th, tw = _extent(task, "ty"), _extent(task, "tx")

    def tile(fb1: int) -> tuple[int, int, int]:
        rows = max(1, min(12, (regs - fb1 * nvec) // (fb1 * nvec + 1)))
        tx2 = _largest_divisor_at_most(tw, rows)
        ty2 = _largest_divisor_at_most(th, max(1, rows // tx2)) if tx2 < rows // 2 else 1
        return fb1, tx2, ty2

    # two output blocks unless one holds more tiles: AVX2's 16 registers leave 4 rows beside two blocks,
    # and a prime row of 7 tiles (28x28 in F(4x4)) would get 1 of them (2 accumulators) where one block
    # takes all 7
    options = [tile(2)] if fbs % 2 == 0 and nvec == 1 else []
    fb1, tx2, ty2 = max(options + [tile(1)], key=lambda o: o[0] * o[1] * o[2])
    # parallel chunks of whole tile rows where there are enough of them, else of fewer columns
    cores = max(1, num_cores(target))
    itemsize = tvm.DataType(task.dtype).bits // 8
    # where U outweighs the transformed input, the cores split the output channels (each reads half of U;
    # the input transform is repeated, and small): ResNet-50's 512 3x3 at 7x7 in F(4x4), 37.7 MB of U to
    # 0.1 MB of input, ran 1.66 ms with the tiles split, every core streaming all of U
    u_bytes = (dims["m"] + 2) ** 2 * dims["C"] * dims["F"] * itemsize
    v_bytes = (dims["m"] + 2) ** 2 * dims["N"] * th * tw * dims["C"] * itemsize
    fbp = _largest_divisor_at_most(fbs // fb1, cores) if u_bytes > v_bytes else 1
    row_tiles = th // ty2
    ty0 = next(y for y in range(1, row_tiles + 1)
               if row_tiles % y == 0 and (dims["N"] * fbp * y >= 2 * cores or y == row_tiles))
    tx_tiles = tw // tx2
    tx0 = 1
    if dims["N"] * fbp * ty0 < 2 * cores:
        tx0 = next(x for x in range(1, tx_tiles + 1)
                   if tx_tiles % x == 0 and (dims["N"] * fbp * ty0 * x >= 2 * cores or x == tx_tiles))
    panel = dims["C"] * fb1 * dims["d"] * itemsize
    block = l1_block_bytes(target)
    c1, order = dims["C"], "inner"
    if panel > 2 * block:
        c1 = _largest_divisor_at_most(dims["C"], max(dims["a"], block // (fb1 * dims["d"] * itemsize)))
        order = "outer"
    return {"tile_ty": (ty0, row_tiles // ty0, ty2), "tile_tx": (tx0, tx_tiles // tx0, tx2),
            "tile_fb": (fbp, fbs // (fbp * fb1), fb1), "tile_c": (dims["C"] // c1, c1), "c_order": order, "unroll": 16}


__all__ = ["space", "schedule", "default_config", "InvalidConfig"]
