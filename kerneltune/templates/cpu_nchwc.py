"""CPU template for NCHW[x]c convolutions (:mod:`kerneltune.templates.conv_nchwc`): NeoCPU's schedule as a search space.

Loop nest (Liu et al., "Optimizing CNN Model Inference on CPUs", USENIX ATC'19, section 3.1; the levels are
Ansor's SSRSRS tiling, Zheng et al., OSDI'20, applied to the blocked axes)::

    parallel(fuse(n, ob0, y0))           # S0: output-channel blocks x row tiles (s0_order: or rows outer)
      [ic0]                              # R0 here with ic_order=outer (write-back + epilogue after it)
      ob1, y1 | y1, ob1  (s1_order)      # S1
        x0                               #     <- write-back + epilogue of one register tile
          ic0                            # R0: input-channel chunks           (dense / grouped only)
            ry, rx  (rx unrolled: unroll_kw)
              ic1, rci                   # R1: ic_bn = ic1 x a input channels  (dense / grouped only)
                ob2, y2, x1 (unrolled)   # S3: register tile, ob2 x y2 x reg_n vector accumulators
                  o  (vectorized)        #     oc_bn = ob2 x d output channels

Knobs: ``tile_ob`` (F/d -> ob0, ob1, ob2: ``oc_bn`` = ob2 x d), ``tile_y`` (OH -> y0, y1, y2), ``tile_x``
(OW -> x0, ``reg_n``), ``tile_ic`` (input blocks per group -> ic0, ic1: ``ic_bn`` = ic1 x a), ``unroll_kw``,
``s1_order``, ``s0_order`` (which axis the cores split: output channels, or rows), ``ic_order`` (the
input-channel chunks inside each register tile, or outside all the tiles of a parallel chunk: one chunk of
the weights then serves every row of it from L1, the partial sums wait in memory), ``pad`` (the zero
padding as a parallel copy of the input, a copy of the rows each parallel chunk reads, or inlined with bounds
checks), ``unroll`` (``pragma_auto_unroll_max_step`` of the rest).  ``a`` and ``d``, the data and output
blocks, are the graph's choice (the task's layouts); the template's ``ic_bn``/``oc_bn`` are its register
and reduction tiles in multiples of them, and the weights (constants) are packed into ``OIHW[ic_bn]i[oc_bn]o``
panels in the order the loop nest reads them, at build time (:mod:`kerneltune.prepack`).

Depthwise convs have no ``ic`` loops: each output lane reads its own input lane, the weight vector of a tap
is reused by the ``y2 x reg_n`` outputs of the register tile.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from ..prepack import PREPROC
from ..space import ChoiceKnob, DiscreteKnob, FactorKnob, ProductLimit, SearchSpace
from ..targets.caches import l1_block_bytes
from ..targets.host import num_cores, vector_lanes, vector_registers
from ..task import Task
from .common import InvalidConfig, check_config, prepare
from .conv_nchwc import MAX_UNROLLED_TAPS, compute_width
from .cpu import _largest_divisor_at_most, has_producers

UNROLL = (0, 16, 64, 512)
# Register tiles with more vector accumulators than this spill (32 zmm registers, some for operands) and
# unroll into huge bodies that take LLVM minutes: refused before building.
MAX_ACCUMULATORS = 48


def _extent(task: Task, role: str) -> int:
    return next((a.extent for a in task.axes if a.role == role), 1)


def depthwise(task: Task) -> bool:
    return not any(a.role == "rco" for a in task.axes)


def _vectors_per_block(task: Task, target: tvm.target.Target | None) -> int:
    """Vector registers one output block of ``d`` lanes takes (1 when the target is unknown)."""
    d = task.dims["d"]
    return -(-d // vector_lanes(target, task.dtype)) if target is not None else 1


def padded_width(task: Task) -> int:
    """The output width the ``x`` axis is split as (:func:`~kerneltune.templates.conv_nchwc.compute_width`).
    A dense conv with unrolled taps is already computed that wide; the others are split as if they were,
    the extra columns masked on ``x``, not on the vector lanes, so the code stays vectorized."""
    return compute_width(_extent(task, "x"))


def space(task: Task, target: tvm.target.Target | None = None) -> SearchSpace:
    """The knobs (module docstring), constrained to register tiles of at most :data:`MAX_ACCUMULATORS`
    vectors: about half of the unconstrained tiles were beyond it on ResNet-50's convs, and a searcher
    drawing them wasted a trial each."""
    knobs: list = []
    for role, levels in (("ob", 3), ("y", 3), ("x", 2)):
        if _extent(task, role) > 1:
            extent = padded_width(task) if role == "x" else _extent(task, role)
            knobs.append(FactorKnob(f"tile_{role}", extent, levels))
    if not depthwise(task) and _extent(task, "rco") > 1:
        knobs.append(FactorKnob("tile_ic", _extent(task, "rco"), 2))
        knobs.append(ChoiceKnob("ic_order", ("inner", "outer")))
    if _extent(task, "rx") > 1:
        knobs.append(ChoiceKnob("unroll_kw", (True, False)))
    if _extent(task, "ob") > 1 and _extent(task, "y") > 1:
        knobs.append(ChoiceKnob("s1_order", ("oc_outer", "y_outer")))
        knobs.append(ChoiceKnob("s0_order", ("oc_outer", "y_outer")))
    if has_producers(task):
        knobs.append(ChoiceKnob("pad", ("stage", "tile", "inline")))
    knobs.append(DiscreteKnob("unroll", UNROLL))
    tile = ProductLimit((("tile_ob", 2), ("tile_y", 2), ("tile_x", 1)), MAX_ACCUMULATORS,
                        _vectors_per_block(task, target))
    return SearchSpace(knobs, (tile,))


def _factors(cfg: dict, role: str, task: Task, levels: int) -> tuple[int, ...]:
    key = f"tile_{role}"
    if key in cfg:
        return tuple(cfg[key])
    return (_extent(task, role),) + (1,) * (levels - 1)


def schedule(task: Task, config, target: tvm.target.Target) -> s_tir.Schedule:
    cfg = check_config(space(task, target), config)
    dw = depthwise(task)
    fob, fy, fx = _factors(cfg, "ob", task, 3), _factors(cfg, "y", task, 3), _factors(cfg, "x", task, 2)
    fic = _factors(cfg, "ic", task, 2) if not dw else (1, 1)
    d = task.dims["d"]
    lanes = vector_lanes(target, task.dtype)
    accumulators = fob[2] * -(-d // lanes) * fy[2] * fx[1]
    if accumulators > MAX_ACCUMULATORS:
        raise InvalidConfig(f"register tile of {accumulators} vectors exceeds {MAX_ACCUMULATORS}")
    p = prepare(task, inline_producers=cfg.get("pad", "inline") == "inline")
    sch = p.sch
    if cfg.get("pad") == "stage":  # the padding copy: parallel over its outer loops, vectorized over lanes
        for blk in p.producers_left:
            loops = sch.get_loops(blk)
            sch.parallel(sch.fuse(*loops[:-1]))
            sch.vectorize(loops[-1])
    loops = sch.get_loops(p.anchor)
    if dw:
        n, ob, y, x, o, ry, rx = loops
    else:
        n, ob, y, x, o, rco, ry, rx, rci = loops
    ob0, ob1, ob2 = sch.split(ob, list(fob))
    y0, y1, y2 = sch.split(y, list(fy))
    x0, x1 = sch.split(x, list(fx))
    s1 = [ob1, y1] if cfg.get("s1_order", "oc_outer") == "oc_outer" else [y1, ob1]
    if dw:
        reds = [ry, rx]
    else:
        ic0, ic1 = sch.split(rco, list(fic))
        reds = [ic0, ry, rx, ic1, rci]
    s0 = [ob0, y0] if cfg.get("s0_order", "oc_outer") == "oc_outer" else [y0, ob0]
    ic_outer = not dw and cfg.get("ic_order", "inner") == "outer"
    if ic_outer:
        sch.reorder(n, *s0, reds[0], *s1, x0, *reds[1:], ob2, y2, x1, o)
    else:
        sch.reorder(n, *s0, *s1, x0, *reds, ob2, y2, x1, o)
    outer = sch.fuse(n, *s0)
    sch.parallel(outer)
    if cfg.get("pad") == "tile":  # pad just the rows one parallel chunk reads, while they are in cache
        for blk in p.producers_left:
            sch.compute_at(blk, outer)
            sch.vectorize(sch.get_loops(blk)[-1])
    if cfg["unroll"]:
        sch.annotate(outer, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(outer, "pragma_unroll_explicit", 1)
    if d > 1:
        sch.vectorize(o)
    for lp in (ob2, y2, x1):
        sch.unroll(lp)
    if cfg.get("unroll_kw"):
        sch.unroll(rx)
    _pack_weight(sch, p.anchor, task, fob[2] * d, 1 if dw else fic[1] * task.dims["a"], dw)
    sch.reverse_compute_at(p.writeback, outer if ic_outer else x0)
    wb = sch.get_loops(p.writeback)
    if d > 1:
        sch.vectorize(wb[-1])
    init = sch.decompose_reduction(p.anchor, reds[0])
    iloops = sch.get_loops(init)
    if d > 1:
        sch.vectorize(iloops[-1])
    return sch


def _pack_weight(sch, anchor, task: Task, ocb: int, icb: int, dw: bool) -> None:
    """Copy the OIHW weight into ``[F/ocb, Cg/icb, KH, KW, icb, ocb]`` panels (depthwise:
    ``[C/ocb, 1, KH, KW, ocb]``): the register tile's weights become one contiguous vector per input
    channel and tap.  A model weight (layout-free) gets the copy as a build-time rewrite block
    (:data:`kerneltune.prepack.PREPROC`); a runtime weight is copied per call.  Blocks that do not divide the
    channels (padded layouts) read the OIHW weight directly."""
    f, cg = task.dims["F"], task.dims["C"] // task.dims["G"]
    if f % ocb or cg % icb:
        return
    weight = _weight_buffer(sch.get(anchor), task)
    idx = [r.source.name for r in sch.get(anchor).reads].index(weight)
    packed = sch.cache_read(anchor, idx, "global")
    if dw:
        sch.transform_layout(packed, ("write", 0),
                             lambda fo, c, ry, rx: (fo // ocb, c, ry, rx, fo % ocb))
    else:
        sch.transform_layout(packed, ("write", 0),
                             lambda fo, c, ry, rx: (fo // ocb, c // icb, ry, rx, c % icb, fo % ocb))
    if weight in task.weights:  # PrimFunc parameters are the buffers themselves (TVM 0.27)
        sch.annotate(packed, PREPROC, True)
    else:  # packed per call: at least in parallel
        loops = sch.get_loops(packed)
        sch.parallel(loops[0])


def _weight_buffer(block, task: Task) -> str:
    for r in block.reads:
        if len(r.source.shape) == 4:
            return r.source.name
    raise InvalidConfig(f"{task.anchor} reads no 4-d (OIHW) weight")


# --------------------------------------------------------------------------------------------- default

def default_config(task: Task, target: tvm.target.Target):
    """Heuristic config without tuning (see :func:`_default_dict` for the rules and the measurements)."""
    sp = space(task, target)
    values = _default_dict(task, target)
    return tuple(values[name] for name in sp.names)


def _default_dict(task: Task, target: tvm.target.Target) -> dict:
    """NeoCPU's structure with register tiles sized for 32 vector registers (1-thread sweeps of every tile
    on this Zen 4, ResNet-50 / MobileNet-v2 shapes: the defaults are within ~1% of the best tile for dense
    3x3 and 1x1 convs, 112-116 GFLOP/s of a ~116 single-core peak):

    * ``oc_bn``: two output blocks in the register tile when a block is one vector (each broadcast input
      value feeds two FMAs), else one;
    * ``reg_n`` over output width: the largest divisor of OW that keeps about 24 accumulators, at most 14;
      more output rows (``y2``) when the row is short (7x7, 14x14 maps).  A dense conv's tile also leaves
      registers for what one reduction step holds live beside it, a broadcast input per output and the
      ``oc_bn`` weight vectors: past the register file LLVM spills inside the FMA loop (Intel Xeon,
      Inception-v3's 80->192 3x3 on a 71-wide map: 2 blocks x 12 columns, 38 live vectors, 8.3 ms; 9
      columns, 29 live, 5.9 ms);
    * ``ic_bn`` = one input block (NeoCPU's order: input-channel chunks outside the kernel window).  Where
      one register tile's weight panel (``oc_bn`` x C x KH x KW) is over two L1 blocks and the weights are
      at least half the input, the chunks go outside the rows instead (``ic_order=outer``, ``ic_bn`` up to
      one L1 block) and the cores split channels: otherwise every register tile streams the whole panel
      from L2 (Intel Xeon, 2 threads, cold weights: ResNet-50's 256 3x3 at 14x14 0.89 -> 0.82 ms, 512 3x3
      at 7x7 1.33 -> 1.23, 1024->256 1x1 0.49 -> 0.43, 2048->512 0.57 -> 0.52, the model 38.4 -> 35.8 ms
      A/B; Inception-v3's 768->192 1x1 at 17x17, whose cores split rows before, 0.38 -> 0.34 ms, the model
      53.6 -> 52.6 ms).  Smaller panels are read from L1 already and lose to the partial sums' extra traffic
      (256->1024 1x1, 32 KiB: 0.39 -> 0.43 ms), and much smaller weights keep the rows split (64 3x3 at
      56x56: 0.78 -> 0.82 ms with it);
    * everything else in S0, which is parallel: many small chunks balance two cores.  The cores split rows
      (``s0_order=y_outer``) where the weights are smaller than the input (and not taken by the rule
      above): each core then keeps its own rows of the activations from one conv to the next instead of
      reading the half the other core wrote, and reads every weight (Intel Xeon, 2 threads: ResNet-50 31.0
      -> 29.6 ms, MobileNet-v2 3.16 -> 3.00 ms in alternating blocks, Inception-v3 unchanged; timed in the
      model, ResNet-50's convs ran 1.17x slower than the same calls repeated warm with channels split, 1.06x
      on one thread).  Larger weights (the 7x7 and 14x14 stages) keep channels split, each core reading
      half of them.  The rows stay split where a core's share overflows its L2 too: splitting channels
      where a core's rows of the output (MobileNet-v2's 16 -> 96 at 112x112, 2.4 MB) or its whole share
      (ResNet-50's 256 -> 128 and 256 -> 512 at 56x56, 2.4 and 2.9 MB) exceed a 2 MiB L2 ran MobileNet-v2
      1.01-1.2x and ResNet-50 1.01-1.03x slower (Intel Xeon, three alternating rounds each);
    * dense convs pad in a separate parallel copy (bounds checks in their long inner loops cost ~15%);
      depthwise convs read each input once per tap, where the extra pass over the input costs more than the
      checks: padding inlined (MobileNet-v2 144x56x56: 87 vs 39 GFLOP/s, 1 thread), and a smaller register
      tile of ~8 accumulators (no input reuse between them, only the tap's weight vector);
    * ``unroll_kw`` on up to 5 taps: a dense conv with 7 taps in a row runs faster with the tap loop kept
      (Intel Xeon, 2 threads, cold weights: ResNet-50's 7x7 stem 1.07 -> 0.78 ms, Inception-v3's 1x7 convs
      0.61 -> 0.51 ms at 192 channels, 0.52 -> 0.43 at 160; 3x3, 5x5 and 1x3 convs within 1% either way);
    * unroll 16; a dense 1x1 conv whose output row is one or two whole register tiles (the 7x7 and 14x14
      maps of ResNet's and MobileNet's last stages) unrolls 512, the whole channel block of the tile
      (Intel Xeon, 2 threads, cold weights: 1.06-1.14x on 512->2048, 2048->512, 960->160, 1280->320 at 7x7
      and 8x8, 1.03-1.07x on 256->1024, 1024->256, 1024->512 at 14x14; 3x3 convs lose 13-28% with it, 28-
      and 56-wide rows 1-6%, and a 17-wide row split as 18 runs 1.8x slower).
    """
    lanes = vector_lanes(target, task.dtype)
    d = task.dims["d"]
    nvec = -(-d // lanes)
    ob_ext, oh, ow = _extent(task, "ob"), _extent(task, "y"), padded_width(task)
    dw = depthwise(task)
    budget, max_x = (8, 8) if dw else (24, 14)
    budget = budget * vector_registers(target) // 32  # sized for AVX-512's 32 registers; AVX2 has 16

    def spatial(ob2: int) -> tuple[int, int]:
        width = max(1, budget // (ob2 * nvec))
        if not dw:  # a step's live registers: the tile, one broadcast input per output, the weight vectors
            width = min(width, max(1, (vector_registers(target) - ob2 * nvec) // (ob2 * nvec + 1)))
        x1 = _largest_divisor_at_most(ow, min(width, max_x))
        return x1, (_largest_divisor_at_most(oh, max(1, width // x1)) if x1 < 8 else 1)

    ob2 = 2 if not dw and nvec == 1 and ob_ext % 2 == 0 else 1
    x1, y2 = spatial(ob2)
    if ob2 == 2 and 2 * x1 * y2 * nvec < budget // 2:
        # Two output blocks left no room for a row of a prime-wide map (AVX2's 12 accumulators, 7x7: 2 x 1
        # tiles, 2 accumulators; ResNet-50's 512 3x3 conv at 3.86 ms where 64 trials found 1.57 with one
        # block and 7 outputs): one block, the whole row.
        ob2 = 1
        x1, y2 = spatial(1)
    weights_per_input = _weights_per_input(task)
    s0_rows = weights_per_input < 1
    tile_y, tile_ic, ic_order = (oh // y2, 1, y2), (_extent(task, "rco"), 1), "inner"
    if not dw and weights_per_input >= 0.5 and _panel_bytes(task, ob2 * d) > 2 * l1_block_bytes(target):
        tile_y, tile_ic = _ic_outer_tiles(task, target, ob2 * d, ob_ext // ob2, oh // y2, y2)
        ic_order, s0_rows = "outer", False
    return {
        "tile_ob": (ob_ext // ob2, 1, ob2),
        "tile_y": tile_y,
        "tile_x": (ow // x1, x1),
        "tile_ic": tile_ic,
        "ic_order": ic_order,
        "unroll_kw": dw or task.dims["KW"] <= MAX_UNROLLED_TAPS,
        "s1_order": "oc_outer",
        "s0_order": "y_outer" if s0_rows else "oc_outer",
        "pad": "inline" if dw else "stage",
        "unroll": 512 if not dw and task.dims["KH"] == task.dims["KW"] == 1 and ow <= 2 * x1
        and ow == task.dims["OW"] else 16,
    }


def _panel_bytes(task: Task, oc_bn: int) -> int:
    """Bytes of the weights one register tile's output channels (``oc_bn``) read over the whole reduction."""
    d = task.dims
    return oc_bn * (d["C"] // d["G"]) * d["KH"] * d["KW"] * tvm.DataType(task.dtype).bits // 8


def _ic_outer_tiles(task: Task, target: tvm.target.Target, oc_bn: int, chunks: int, rows: int,
                    y2: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """(``tile_y``, ``tile_ic``) of the input-channel-outer order: the rows of a parallel chunk move to S1 so
    one L1-sized chunk of the weights (``ic_bn`` channels, at most
    :func:`~kerneltune.targets.caches.l1_block_bytes`) serves them all,
    while as many row groups stay parallel as two chunks per core need."""
    cores = num_cores(target)
    y0 = next(y for y in range(1, rows + 1) if rows % y == 0 and (chunks * y >= 2 * cores or y == rows))
    blocks, a = _extent(task, "rco"), task.dims["a"]
    block_bytes = _panel_bytes(task, oc_bn) * a // (task.dims["C"] // task.dims["G"])  # one input block's
    ic1 = _largest_divisor_at_most(blocks, max(1, l1_block_bytes(target) // max(1, block_bytes)))
    return (y0, rows // y0, y2), (blocks // ic1, ic1)


def _weights_per_input(task: Task) -> float:
    """Elements of the conv's weight per element of its input."""
    d = task.dims
    return d["F"] * (d["C"] // d["G"]) * d["KH"] * d["KW"] / (d["N"] * d["C"] * d["H"] * d["W"])


__all__ = ["space", "schedule", "default_config", "InvalidConfig"]
