"""CPU (llvm) template: Ansor's "SSRSRS" multi-level tiling of the anchor, epilogue fused into the write-back.

Loop structure for every anchor axis split into S0..S3 (spatial) and R0..R1 (reduction)::

    parallel(fuse(S0...))            # one chunk of output tiles per core
      S1...                          # <- write-back block (epilogue) computed here, tile = S2*S3
        R0...                        # k-blocking: the operands' panels stay in L1/L2
          S2...
            R1...
              S3... (last one vectorized)   # register tile: accumulators stay in registers

The accumulator is a ``local`` buffer covering the S2*S3 tile; LLVM keeps it in vector registers when the
S3 tile is small and unrolled (``pragma_auto_unroll_max_step``).  A conv's pad block is either inlined into
the anchor or kept as a separate parallel, vectorized copy (knob ``pad``; a stride-2 conv's copy may store
even and odd columns apart); other epilogue blocks are inlined
into the write-back.  ``decompose_reduction`` comes last, splitting the accumulator's init out of the k-loops.

Knobs: ``tile_<role>`` (factor, 4 levels spatial / 2 levels reduction) per axis of extent > 1, ``unroll``
(0/16/64/512); with two or more spatial axes ``s1_order`` (axis/reversed: which operand's panel stays in
cache across the S1 loops); for the matmul family ``pack`` (none/panel: copy B's column panel contiguous at
the outermost S1 loop; prepack, when B is a model weight: B stored as panels ``[N/nb, K, nb]`` once, at
build time, see :mod:`kerneltune.prepack`); for convs ``pad`` (stage/inline, and phases at stride 2).
"""
from __future__ import annotations

import logging
import math

import tvm
from tvm import s_tir

from ..space import ChoiceKnob, ProductLimit, SearchSpace, divisors, prime_factors
from ..calibrate import calibrated
from ..targets.caches import k_block_depth, l1_block_bytes
from ..targets.host import num_cores, vector_lanes, vector_registers
from ..prepack import PREPROC
from ..task import Task, root_blocks, symbolic_axes
from . import full_tiles, tail_tiles, prefetch
from .common import InvalidConfig, check_config, prepare, split_axes, tile_knobs, tiles, unroll_knob

log = logging.getLogger(__name__)

UNROLL = (0, 16, 64, 512)


def has_producers(task: Task) -> bool:
    """Whether the anchor has producer blocks (a conv's pad) that can be inlined or kept as a stage."""
    return any(b != task.anchor for b in task.block_names[:task.block_names.index(task.anchor)])


# Rows of a register tile: a rows axis whose extent has no divisor at least this large (a prime such as ViT's
# 197 tokens) is split as if rounded up to a multiple of ROW_PAD.  A vector axis with no divisor of at least
# half a vector is rounded up to VECTOR_PAD, a multiple of every x86 vector width (8 fp32 lanes with AVX2,
# 16 with AVX-512): the space is the task's alone, whatever the target.
MIN_ROW_TILE, ROW_PAD, VECTOR_PAD = 4, 8, 16


def padded_extents(task: Task) -> dict[str, int]:
    """Axes split past their end (``split`` masks the extra iterations): the rows axis of a matmul whose
    extent only splits into thin register tiles, and a vector axis no vector width divides.  ViT-B/16's 197
    tokens (prime) gave 1-row tiles, each B vector loaded for one FMA: its MLP matmuls ran at 15 GFLOP/s (of
    466 on an Intel Xeon) and the model at 14x onnxruntime; split as 200 rows (1.5% masked work) the tile is
    4 rows deep again, 1.6x onnxruntime end to end.  Its attention scores (197 columns) ran scalar: split as
    208 they run in 16-lane vectors, 4x faster.  Convs keep exact splits (their rows are filters, a multiple
    of 8 in every real model; their vector axis is the block)."""
    if task.kind == "conv2d":
        return {}
    out = {}
    rows = rows_axis(task)
    if rows is not None:
        e = task.axis(rows).extent
        if e > ROW_PAD and _largest_divisor_at_most(e, 16) < MIN_ROW_TILE:
            out[rows] = -(-e // ROW_PAD) * ROW_PAD
    wide = vector_padding(task.axis(task.vector_axis).extent)
    if wide:
        out[task.vector_axis] = wide
    return out


def weight_padding(extent: int) -> int | None:
    """The column count a constant weight is padded to in the graph (else None): :func:`vector_padding`'s
    length, else the next multiple of 4 vectors (the widest register tile) when the zero columns cost at most
    1/32 more work, else of one vector at most 1/16.  An LSTM's 4 x 650 = 2600 gate columns split into 13-lane
    vectors (8 whole lanes divide them, 16 do not): on an Intel Xeon (AVX-512) its recurrent 1 x 650 x 2600
    product with cold weights ran 0.87 ms, 0.33 ms as 2608 columns in 16-lane vectors, and the 35-row input
    projection 1.12 vs 0.87 ms; its 35 x 650 x 10000 decoder, 1 thread, 5.4 ms in 7 rows x 1 vector, 4.8 ms
    as 10048 columns in 2 vectors.  Unlike an activation's masked split, the padding is free: zero columns
    in the constant, one slice of the output."""
    wide = vector_padding(extent)
    for multiple, waste in ((4 * VECTOR_PAD, 32), (VECTOR_PAD, 16)):
        up = -(-extent // multiple) * multiple
        if wide is None and extent > VECTOR_PAD and up != extent and (up - extent) * waste <= extent:
            wide = up
    return wide


def vector_padding(extent: int) -> int | None:
    """The length a vector axis of ``extent`` is split as, when no vector width divides it (else None).
    The mask such a split needs falls on the vector lanes, and LLVM then emits scalar code: GPT-2's LM head
    (50257 columns) ran at 67 GFLOP/s, 211 once its weight was padded to 50272 columns.  So constant weights
    are padded in the graph instead (:func:`pipeline.relax_import._padded_weight`); an activation (ViT's
    197 x 197 attention scores) still gets the masked split, 4x faster than one lane wide."""
    if extent > VECTOR_PAD and _largest_divisor_at_most(extent, VECTOR_PAD) < VECTOR_PAD // 2:
        return -(-extent // VECTOR_PAD) * VECTOR_PAD
    return None


def space(task: Task) -> SearchSpace:
    knobs = tile_knobs(task, 4, 2, padded_extents(task)) + [unroll_knob(UNROLL)]
    multi_spatial = sum(1 for a in task.axes if not a.reduce and a.extent > 1) > 1
    if multi_spatial:
        # Order of the S1 loops (which operand panel stays in cache across the other's tiles):
        # "axis" = output order (rows outer: an A panel is reused, B streams), "reversed" (B panel reused).
        knobs.append(ChoiceKnob("s1_order", ("axis", "reversed")))
    if task.kind != "conv2d":
        prepack = ("prepack",) if _vector_operand_name(task) in task.weights else ()
        if multi_spatial:
            knobs.append(ChoiceKnob("pack", ("none", "panel") + prepack))
        elif prepack:
            # A matrix-vector product (a batch-1 classifier): streaming the weight is its whole cost, and B's
            # rows one row stride apart defeat the prefetcher; packed panels make each thread's stream
            # contiguous.
            knobs.append(ChoiceKnob("pack", ("none",) + prepack))
    if has_producers(task):
        # inline: no extra pass, but a bounds check per load; stage: one parallel copy, branch-free inner loop;
        # phases: the copy stores even and odd columns apart, so a stride-2 conv reads contiguous vectors.
        phases = ("phases",) if _phase_width(task) else ()
        knobs.append(ChoiceKnob("pad", ("stage", "inline") + phases))
    rows = rows_axis(task)
    if task.kind != "conv2d" and rows in task.served and any(k.name == f"tile_{rows}" for k in knobs):
        # a tuner searches served tiles that keep their registers (:data:`SERVED_ROW_REPEAT`)
        return SearchSpace(knobs, (ProductLimit(((f"tile_{rows}", 2),), SERVED_ROW_REPEAT),))
    return SearchSpace(knobs)


def _vector_operand(sch, anchor, task: Task) -> str:
    """Name of the input the anchor reads along the vector axis (B of a matmul)."""
    return _operand_along(sch.get(anchor), task)


def _vector_operand_name(task: Task) -> str | None:
    found = [b for b in root_blocks(task.func) if b.name_hint == task.anchor]
    try:
        return _operand_along(found[0], task) if found else None
    except ValueError:
        return None


def _operand_along(block, task: Task) -> str:
    from tvm.tirx.analysis import undefined_vars

    var = task.axis(task.vector_axis).var
    out = block.writes[0].source.name
    for region in block.reads:
        used = {v.name for rng in region.region for v in undefined_vars(rng.min)}
        if region.source.name != out and var in used:
            return region.source.name
    raise ValueError(f"no operand of {task.anchor} is indexed by {var}")


def schedule(task: Task, config, target: tvm.target.Target) -> s_tir.Schedule:
    """The schedule of ``config`` (its trace replays the primitives: the MetaSchedule export)."""
    return _schedule(task, config, target)[0]


def apply(task: Task, config, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """The scheduled kernel as it is built: the schedule's function, plus the software prefetch of a
    pre-packed weight's next panel (:mod:`.prefetch`) and, in a kernel with a symbolic extent, its masked
    write-back split into whole tiles and the rest (:mod:`.full_tiles`).  No schedule primitive expresses
    either, so the trace of :func:`schedule` leaves them out; nor the skipping of register tiles wholly past a
    symbolic end (:mod:`.tail_tiles`)."""
    sch, panel_prefetch, tails = _schedule(task, config, target)
    func = sch.mod["main"]
    for loop_var, axis, extent in tails:  # first: a guard wraps a perfect nest, which a prefetch loop breaks
        func = tail_tiles.guard(func, loop_var, axis, extent)
    if panel_prefetch is not None:
        func = prefetch.insert(func, panel_prefetch)
    if symbolic_axes(task):
        func = full_tiles.hoist(func)
    return func.with_attr("tirx.is_scheduled", True)


def _schedule(task: Task, config, target: tvm.target.Target):
    cfg = check_config(space(task), config)
    factors = _symbolic_tiles(task, tiles(task, cfg, 4, 2))
    padding = _einsum_padding(task, factors)
    # a kernel serving a range padded on spatial axes only: read through each operand padded on its outer
    # dimensions, no padded copy (one padded along the vector axis keeps its copy: clamped, its vector loads
    # would gather, and a prepacked panel copy of it has no fixed width).  MiniLM's served scores Q K^T, Q read
    # through instead of copied beside K^T (Intel Xeon, 2 threads, warm): 10.5 -> 8.7 us at 8 tokens, 53.5 ->
    # 50.4 at 77, 99.5 -> 94.6 at 128, 892.9 -> 885.3 at 384
    clamp = padding is not None and any(None in f for f in factors) and \
        all(m == 1 for m, a in zip(padding, task.axes) if a.reduce)
    p = prepare(task, inline_producers=cfg.get("pad", "inline") == "inline", einsum_padding=padding, clamp=clamp)
    sch = p.sch
    if cfg.get("pad") == "phases":
        _split_phases(sch, p.producers_left[0])
    for blk in p.producers_left:
        loops = sch.get_loops(blk)
        sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 1 else loops[0])
        if len(loops) > 1:
            _vectorize_copy(sch, loops[-1], vector_lanes(target, task.dtype))
    parts = split_axes(sch, p.anchor, task, factors)
    spatial = [lp for lp, a in zip(parts, task.axes) if not a.reduce]
    reduction = [lp for lp, a in zip(parts, task.axes) if a.reduce]
    # Unsplit (extent-1) axes contribute one loop: spatial ones go to S0, reductions to R0.
    lvl = lambda ls, i, n: (ls[i] if len(ls) == n else (ls[0] if i == 0 else None))  # noqa: E731
    s = [[x for x in (lvl(ls, i, 4) for ls in spatial) if x is not None] for i in range(4)]
    r = [[x for x in (lvl(ls, i, 2) for ls in reduction) if x is not None] for i in range(2)]
    if cfg.get("s1_order") == "reversed":
        s[1] = s[1][::-1]
    sch.reorder(*s[0], *s[1], *r[0], *s[2], *r[1], *s[3])
    # the parallel loop's parts, read before fusing (None: a symbolic extent)
    s0_extents = [int(e) if isinstance((e := sch.get(lp).extent), tvm.tirx.IntImm) else None for lp in s[0]]
    outer = sch.fuse(*s[0]) if len(s[0]) > 1 else s[0][0]
    sch.parallel(outer)
    if cfg["unroll"]:
        sch.annotate(outer, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(outer, "pragma_unroll_explicit", 1)
    lanes = vector_lanes(target, task.dtype)
    vec = [a.role for a in task.axes].index(task.vector_axis)
    _vectorize(sch, s[3][-1], factors[vec][3], lanes)
    # Width of the vector axis' register tile: the panel copy and the write-back are vectorized along it.
    # With a width of 1 their innermost loop is another, strided axis (k, or the rows): vectorizing that
    # asks LLVM for e.g. a 768-lane gather, which took it 89 s to compile (G-BFS starts from such configs).
    nb = _panel_width(task, factors)
    if cfg.get("pack") == "panel":
        # Copy the vector-indexed operand's panel (B[:, j-tile]) into a contiguous buffer at the outermost
        # S1 loop: its rows are then adjacent in memory instead of one row stride (often a multiple of 4 KiB
        # -> same cache set, new TLB page) apart.
        packed = sch.cache_read(p.anchor, _vector_operand(sch, p.anchor, task), "global")
        if task.dims.get("tb"):
            # B is stored [.., N, K]: the packed copy is transposed to [.., K, N] so the vector loads along
            # j are contiguous instead of strided gathers.
            sch.transform_layout(packed, ("write", 0), lambda *idx: (*idx[:-2], idx[-1], idx[-2]))
        sch.compute_at(packed, s[1][0])
        loops = sch.get_loops(packed)
        if task.dims.get("tb"):
            # loop over the packed layout (k outer, j inner): vector gathers from B, contiguous stores
            # (1 thread 128x768x768^T: 93 GFLOP/s; vectorized scatter 73, scalar 85, unpacked 19)
            if nb > 1:
                sch.reorder(loops[-1], loops[-2])
                sch.vectorize(loops[-2])
        elif nb > 1:
            sch.vectorize(loops[-1])
    panels = _prepack(sch, p.anchor, task, factors) if cfg.get("pack") == "prepack" else None
    sch.reverse_compute_at(p.writeback, s[1][-1])
    if nb > 1:
        _vectorize(sch, sch.get_loops(p.writeback)[-1], nb, lanes)
    sch.decompose_reduction(p.anchor, r[0][0])
    panel_prefetch = None
    if (panels is not None and len(factors[vec]) == 4 and len(sch.get(panels).writes[0].source.shape) == 3
            and None not in s0_extents):  # a symbolic S0 (the parallel chunks follow the length): no panel index
        spatial_roles = [a.role for a in task.axes if not a.reduce]
        panel_s1 = parts[vec][1]   # one of s[1]; the S1 loops inside it share its panel
        rows = rows_axis(task)
        row_f = factors[[a.role for a in task.axes].index(rows)] if rows is not None else (1, 1, 1, 1)
        tile_rows = row_f[2] * row_f[3] if len(row_f) == 4 and None not in row_f[2:] else 1  # one k-block's rows
        k_inner = r[1][0] if r[1] and tile_rows > 1 else None  # a one-row tile streams fast alone
        if k_inner is not None and row_f[2] != 1 and rows in symbolic_axes(task):
            k_inner = r[0][0]  # a served tile repeated down the rows: a loop inside the k-block costs its registers
        panel_prefetch = prefetch.plan(sch, panels, outer, s0_extents, spatial_roles.index(task.vector_axis),
                                       panel_s1, s[1][s[1].index(panel_s1) + 1:], (r[0][0], k_inner))
    return sch, panel_prefetch, _tail_guards(sch, task, parts, factors)


def _tail_guards(sch, task: Task, parts, factors) -> list[tuple]:
    """``(S2 loop variable, anchor iterator, length)`` of each symbolic spatial axis repeating its register
    tile inside a k-block (S2 > 1): :mod:`.tail_tiles` skips the repeats wholly past the length."""
    repeated = [i for i, (a, f, lp) in enumerate(zip(task.axes, factors, parts))
                if not a.reduce and None in f and len(f) == 4 and f[2] > 1 and len(lp) == 4]
    if not repeated:  # every static kernel (each config a tuner applies): no block lookup
        return []
    block = next(b for b in root_blocks(task.func) if b.name_hint == task.anchor)
    return [(sch.get(parts[i][2]).loop_var, i, block.iter_vars[i].dom.extent) for i in repeated]


def _phase_width(task: Task) -> int | None:
    """The width of a conv's padded input when the conv reads it at a column stride of 2 and the width is
    even (then it splits into even and odd columns of equal length), else None."""
    if task.kind != "conv2d" or not has_producers(task):
        return None
    pad = [b for b in root_blocks(task.func) if b.name_hint == task.block_names[0]][0]
    shape = pad.writes[0].source.shape
    ow, kw = task.dims["OW"], task.dims["KW"]
    if len(shape) != 4 or ow < 2:
        return None
    width = int(shape[3])
    return width if (width - kw) // (ow - 1) == 2 and width % 2 == 0 else None


def _split_phases(sch, pad) -> None:
    """Store a stride-2 conv's padded input as its even and odd columns, ``[n, c, h, w % 2, w // 2]``, and
    copy it in that order.  Read at stride 2 along the vector axis, NCHW data is a gather per vector (TVM
    emits a load per lane); phase-split, tap ``rx`` of output column ``x`` reads ``[.., rx % 2, x + rx // 2]``:
    contiguous.  ShuffleNet-v2's stem (3 -> 24 channels, 3x3, stride 2, 224 x 224) on an Intel Xeon, 2
    threads: 181 -> 95 us; the copy itself gathers once per input element, the conv gathered once per tap."""
    phase = lambda n, c, h, w: (n, c, h, w % 2, w // 2)  # noqa: E731
    sch.transform_layout(pad, ("write", 0), phase)
    sch.transform_block_layout(pad, phase)


def _depthwise(task: Task) -> bool:
    return task.kind == "conv2d" and task.dims["G"] > 1 and task.dims["G"] == task.dims["C"] == task.dims["F"]


def _vectorize(sch, loop, width: int, lanes: int) -> None:
    """Vectorize ``loop`` (``width`` iterations); a width of whole vectors whose count is no power of two
    (3 x 16 lanes) becomes an unrolled loop of single vectors: LLVM legalizes a <48 x float> operation into
    a pile of 128-bit moves and shuffles (128x768x3072 in 8 rows x 48 columns, pre-packed: 7 GFLOP/s)."""
    count = width // lanes
    if width > lanes and width % lanes == 0 and count & (count - 1):
        outer, inner = sch.split(loop, factors=[count, lanes])
        sch.vectorize(inner)
        sch.unroll(outer)
    else:
        sch.vectorize(loop)


def _lane_padding(task: Task) -> list[int] | None:
    """``pad_einsum`` multiples that pad the vector axis, when it is split past its end (an activation no
    vector width divides: ViT's 197 x 197 attention scores): a split past the end masks the vector lanes,
    which LLVM turns into scalar code (12 x 197 x 64 x 197 on an Intel Xeon, 2 threads: 0.86 ms, 70 GFLOP/s);
    computed on a zero-padded copy of the operand and cropped, 0.39 ms (0.21 ms for 208 columns: the copy and
    the masked write-back's last lanes are the rest).  The rows axis, when it is split past its end too, is
    padded with it: its mask otherwise guarded every FMA of the register tile (0.48 -> 0.31 ms warm; ViT-B/16
    end to end 159.3 -> 153.7 ms, onnxruntime 158.0, one run)."""
    padded = padded_extents(task)
    if task.vector_axis not in padded:
        return None
    rows = rows_axis(task)
    return [VECTOR_PAD if a.role == task.vector_axis else ROW_PAD if a.role == rows and rows in padded else 1
            for a in task.axes]


def _vectorize_copy(sch, loop, lanes: int) -> None:
    """Vectorize a copy's innermost loop; one of symbolic extent (a padded operand of a kernel serving a
    range of lengths) in whole vectors when its padding provably makes it a multiple of them, else left
    scalar (a split past a symbolic end leaves a mask no vector loop takes)."""
    extent = sch.get(loop).extent
    if isinstance(extent, tvm.tirx.IntImm):
        sch.vectorize(loop)
    elif tvm.sym.Analyzer().can_prove(tvm.tirx.floormod(extent, lanes) == 0):
        sch.vectorize(sch.split(loop, [None, lanes])[1])


def _symbolic_tiles(task: Task, factors: list[tuple]) -> list[tuple]:
    """The tiles of each axis whose extent is symbolic (a kernel of a build that serves a range of lengths,
    scheduled with the tiles of its instance at a representative length: :mod:`pipeline.symbolic`), with the
    one loop whose count follows the length marked None: S1 when S0 is 1 (the rows of each parallel chunk
    sweep a weight panel while it is in cache), else S0 (S1 folded into it).  The axis is padded to a whole
    number of the other tiles (:func:`_einsum_padding`), so no loop has a partial tile: a mask left in the
    register tile guarded every FMA (BERT-base at 77 tokens, Intel Xeon, 2 threads: the FFN kernels at
    ~90 GFLOP/s), and an S1 tile fixed at the representative length (16 x 8 rows) would pad 8 tokens to 128.
    A symbolic reduction (attention's ``scores V`` over the tokens) is not k-blocked: padded, it would need
    zeros, so a copy of both operands per call, where its operands are small enough to stay in cache.  Its
    k-block is then one step deep, so the register tile repeated down the rows inside it (S2) would hold every
    repeat's accumulators across each step: S2 goes into S1, one register tile per k loop.  MiniLM's
    ``scores V`` served 2..512 (Intel Xeon, 2 threads, warm), 2 x 8 rows -> 8: 50.2 -> 22.2 us at 77 tokens,
    1340.8 -> 802.1 at 384."""
    symbolic = symbolic_axes(task)
    unsplit = any(a.reduce and a.role in symbolic for a in task.axes)
    out = []
    for a, f in zip(task.axes, factors):
        if len(f) == 4 and unsplit and f[2] > 1:
            f = (f[0], f[1] * f[2], 1, f[3])
        if a.role not in symbolic:
            out.append(f)
        elif len(f) == 4:
            out.append((1, None, *f[2:]) if f[0] == 1 else (None, 1, *f[2:]))
        else:  # a reduction: unsplit, so it needs no zero padding (a padded copy of both operands per call)
            out.append((None, 1))
    return out


def _einsum_padding(task: Task, factors: list[tuple]) -> list[int] | None:
    """``pad_einsum`` multiples: :func:`_lane_padding`'s, and for each symbolic axis the product of its fixed
    tiles (:func:`_symbolic_tiles`): at most one register tile per axis, never the range's maximum."""
    lanes = _lane_padding(task)
    if all(None not in f for f in factors):
        return lanes
    out = list(lanes or [1] * len(task.axes))
    for i, f in enumerate(factors):
        if None in f:
            out[i] = math.lcm(out[i], math.prod(x for x in f if x is not None))
    return out


def _panel_width(task: Task, factors) -> int:
    """The S2*S3 tile of the vector axis: the width of one B panel and of the write-back's inner loop."""
    vec = [a.role for a in task.axes].index(task.vector_axis)
    return factors[vec][2] * factors[vec][3]


def _prepack(sch, anchor, task: Task, factors):
    """Store the weight B as panels ``[.., N/nb, K, nb]`` (nb = the S2*S3 tile of the vector axis), so the
    k-loop over one output tile reads one contiguous stream.  The copy is a root block annotated for
    ``RemoveWeightLayoutRewriteBlock`` (tuning) and ``SplitLayoutRewritePreproc`` + ``FoldConstant`` (build)."""
    nb = _panel_width(task, factors)
    packed = sch.cache_read(anchor, _vector_operand(sch, anchor, task), "global")
    if task.axis(task.vector_axis).extent % nb:
        # a vector axis split past its end: the panels would need padding, which RemoveWeightLayoutRewriteBlock
        # (tuning's strip) cannot take; constant weights arrive padded (pipeline.relax_import._padded_weight)
        raise InvalidConfig(f"prepack needs panels of {nb} that divide the weight's {task.vector_axis} axis")
    if task.dims.get("tb"):   # B[.., j, k]
        sch.transform_layout(packed, ("write", 0), lambda *i: (*i[:-2], i[-2] // nb, i[-1], i[-2] % nb))
    else:                     # B[.., k, j]
        sch.transform_layout(packed, ("write", 0), lambda *i: (*i[:-2], i[-1] // nb, i[-2], i[-1] % nb))
    sch.annotate(packed, PREPROC, True)
    return packed


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in divisors(n) if d <= cap)


def _rows_tile(task: Task, rows: int, cap: int) -> int:
    """The register tile's rows (S3): the largest divisor of ``rows`` up to ``cap``, and in a grouped conv one
    that covers whole groups or a whole share of one.  A tile straddling a group boundary reads two groups'
    inputs at rows that vary from tile to tile: ShuffleNet v1's 240 -> 60 1x1 in 3 groups (20 filters each) at
    28x28 ran 0.081 ms in tiles of 6 filters, 0.040 in tiles of 5 (Intel Xeon, 2 threads); ResNeXt's 4-filter
    groups run about as fast in tiles of 8 as of 4 (0.215 and 0.209 ms at 56x56)."""
    width = task.dims["F"] // task.dims["G"] if task.kind == "conv2d" else rows
    return max(d for d in divisors(rows) if d <= cap and (width % d == 0 or d % width == 0))


def rows_axis(task: Task) -> str | None:
    """The spatial axis whose register-tile rows reuse one vector of the contiguous operand.

    conv2d: output channels ``f`` (a data vector along ``x`` is reused by every filter); matmul family: the
    row axis of A (a B vector along ``j`` is reused by every row).  Batch axes never: they share nothing.
    """
    if task.kind == "conv2d":
        return "f" if task.axis("f").extent > 1 else None
    cands = [a.role for a in task.axes if not a.reduce and a.extent > 1 and a.role != task.vector_axis
             and not a.role.startswith("b")]
    return cands[-1] if cands else None


def default_config(task: Task, target: tvm.target.Target, row_repeat: int | None = None):
    """Heuristic tiles without tuning, from interleaved best-of-N sweeps on this Zen 5 (noisy, shared).

    * vector axis: S3 = whole vectors (up to 4: 64 fp32 lanes with AVX-512), else the largest divisor that
      fits one vector (a 56-wide conv row: 4 x 14 lanes, 105 GFLOP/s, vs 7 x 8 lanes 69, vs 2 x 28 lanes 7);
    * rows axis: S3 = accumulators / (vectors x conv rows), accumulators: :func:`_accumulators`.  Matmuls
      repeat the
      register tile down the rows inside one k-block (S2) so the B block is reused from L1: 4x on this Zen 5
      (1 thread, 128x768x768: 157 vs 135 GFLOP/s for S2 = 2), 1-2x on an Intel Xeon, so it is measured once
      per CPU (``row_repeat``: :func:`time_row_repeats`).  Convs take 2 output rows (y) and 8 filters,
      so each weight broadcast feeds 2 FMAs (52 vs 44 GFLOP/s for 16 filters x 1 row; NCHW stays load-bound);
    * reductions: R1 (inner) along ``k`` / ``rc*ry*rx`` deep enough to fill a third of L1 with the widest B
      panel (:func:`~kerneltune.targets.caches.k_block_depth`: 64 on a 48 KiB L1d) so operand panels stay in L1;
    * parallel: prime factors move from S1 (then S2, S3) of the outer axes to S0 until every core has work;
    * a conv's padding stays a separate stage (bounds checks in the inner loop cost ~10x), stored as even and
      odd columns for a stride-2 conv; a pad of 0 and a depthwise conv's padding are inlined; unroll 64.
    """
    sp = space(task)
    if row_repeat is None and task.kind != "conv2d":
        row_repeat = calibrated("matmul_row_repeat", target, STATIC_ROW_REPEAT, time_row_repeats)
    lanes = vector_lanes(target, task.dtype)
    accumulators = _accumulators(task, target)
    vec, rows = task.vector_axis, rows_axis(task)
    window = 1
    for a in task.axes:
        if a.reduce and a.role != "rc" and a.role != "k":
            window *= a.extent
    padded = padded_extents(task)
    extent = {a.role: padded.get(a.role, a.extent) for a in task.axes}  # as split: masked past the end
    vec_s3 = _vector_tile(extent[vec], lanes)
    if vec in task.served:
        vec_s3 = _served_vector_tile(extent[vec], lanes, vec_s3)
    if rows is not None and task.kind != "conv2d":
        vec_s3 = _fill_accumulators(extent[vec], extent[rows], lanes, accumulators, vec_s3)
    nvec = -(-vec_s3 // lanes)
    # conv: a second output row shares every weight broadcast, then filters fill 16 vector accumulators
    y_s3 = _largest_divisor_at_most(task.axis("y").extent, 2) if task.kind == "conv2d" else 1
    # R1 of each reduction: k / rc deep enough for the operand panels to stay in L1, the others whole
    depth, l1_block = k_block_depth(target), l1_block_bytes(target)
    inner = {a.role: _k_block(extent[a.role], max(1, depth // window)) if a.role in ("k", "rc")
             else extent[a.role] for a in task.axes if a.reduce}
    # A served axis the register tile does not use (a batch, in a build serving a range of batches) stays whole
    # in S0: tiled, it is padded to its tile at every size (batch 1 computed as 2) and, split to feed the
    # cores, leaves one core idle at the range's low end (MiniLM served 1..4 x 2..512, one batch of 8 tokens:
    # its matmuls 31-34 GFLOP/s, 68-69 in a build serving one batch; Intel Xeon, 2 threads).  The cores are
    # fed from the other axes.
    whole = {r for r in task.served if r not in (vec, rows)}
    cfg: dict = {}
    for a in task.axes:
        if a.extent == 1:
            continue
        e = extent[a.role]
        if a.reduce:
            cfg[a.role] = [e // inner[a.role], inner[a.role]]
            continue
        if a.role in whole:
            cfg[a.role] = [e, 1, 1, 1]
            continue
        s2 = 1
        if a.role == vec:
            s3 = vec_s3
        elif a.role == rows:
            s3 = _rows_tile(task, e, max(1, accumulators // (nvec * y_s3)))
            if task.kind == "conv2d":
                s2 = 1
            elif rows in task.served:
                s2 = SERVED_ROW_REPEAT
            elif _rows_fit_l1(e, vec_s3, inner.get("k", 1), task.dtype, l1_block):
                s2 = e // s3  # every row inside the k-block: each B block read once, from L1
            else:
                s2 = _largest_divisor_at_most(e // s3, row_repeat)
        elif task.kind == "conv2d" and a.role == "y":
            s3 = y_s3
        else:
            s3 = 1
        cfg[a.role] = [1, e // (s2 * s3), s2, s3]
    split = [a.role for a in task.axes if not a.reduce and a.extent > 1 and a.role not in whole]
    if rows in split and vec in split and split.index(vec) > split.index(rows) and extent[vec] > extent[rows]:
        # the cores split the larger operand: B (K x N) is larger than A (M x K) when N > M, and split by rows
        # each core streams all of it (BERT's 128 x 768 x 3072, 2 threads, cold: 241 GFLOP/s by rows, 276 by
        # columns on an Intel Xeon)
        split.remove(vec)
        split.insert(split.index(rows), vec)
    _balance_parallel(cfg, split, num_cores(target), vec)
    values = {f"tile_{k}": tuple(v) for k, v in cfg.items()}
    values["unroll"] = 64
    # Dense matmuls: pack each B panel once (reversed S1 order puts the panel loop outermost).  1 thread,
    # 128x768x3072: 66 vs 53 GFLOP/s median, neutral on 128x768x768; batch matmuls (small K) leave it.
    # A weight B is packed at build time instead (below).
    # Transposed B (either kind) is packed into [k, j] order: strided gathers otherwise (19 vs 93 GFLOP/s).
    pack = task.kind == "matmul" or bool(task.dims.get("tb"))
    values["s1_order"] = "reversed" if pack else "axis"
    values["pack"] = "panel" if pack else "none"
    knob = {k.name: k for k in sp.knobs}.get("pack")
    if knob is not None and "prepack" in knob.values and vec not in padded:
        # B is a model weight: store it as panels once, at build time.  The run-time panel copy reads B one row
        # stride apart (a new 4 KiB page per 256-byte row: the prefetcher gives up) and repeats for every
        # column panel.  BERT-base's MLP matmuls on an Intel Xeon, 2 threads: 128x768x3072 2.95 -> 2.59 ms cold
        # (2.70 -> 2.25 warm), 128x3072x768 2.86 -> 2.70; a matrix-vector product streams the weight contiguous.
        values["pack"] = "prepack"
    # A padding pad block has bounds checks (if_then_else) that cost ~10x inside the conv's inner loop; a
    # pad of 0 is a plain copy, better inlined.  A stride-2 conv copies its input as even and odd columns.
    # A depthwise conv reads each input element KH*KW times for one FMA each, and its copy (scalar: the bounds
    # check) cost more than the checks inline: ShuffleNet-v2's seven NCHW depthwise convs inlined, the model
    # 3.94 -> 3.71 ms (Intel Xeon, 2 threads; NCHWc depthwise inlines too, :mod:`.cpu_nchwc`).
    if "pad" in sp.names:
        padded = "if_then_else" in task.func.script()
        values["pad"] = ("inline" if not padded or _depthwise(task) else
                         "phases" if _phase_width(task) else "stage")
    return tuple(values[name] for name in sp.names)


# Vector registers a matmul's register tile leaves to its operands: up to 4 B vectors and a broadcast of A,
# with room to spare.
OPERAND_REGISTERS = 8


def _accumulators(task: Task, target: tvm.target.Target) -> int:
    """Vector accumulators of the default register tile.  A matmul keeps all but :data:`OPERAND_REGISTERS`:
    24 of AVX-512's 32 (8 rows x 3 vectors: each B vector loaded feeds 8 FMAs, not 4), 8 of AVX2's 16
    (x86-64-v3 on an Intel Xeon, 128x768x3072: 2 rows x 4 vectors 148 GFLOP/s, 4 x 4 spilled: 110).  On an
    Intel Xeon (AVX-512, 2 threads, weights cold) 8 x 3 vectors against 4 x 4: BERT-base's 128x768x3072
    2.64 -> 2.43 ms, 128x3072x768 2.66 -> 2.49, 128x768x768 0.67 -> 0.64.  NCHW convs keep half the
    registers (their rows are filters, 2 output rows share each weight broadcast)."""
    registers = vector_registers(target)
    return registers // 2 if task.kind == "conv2d" else registers - OPERAND_REGISTERS


def _k_block(depth: int, cap: int) -> int:
    """Depth of one k-block (R1): the largest divisor of ``depth`` up to ``cap``, or the whole depth when that
    divisor is under a quarter of ``cap``.  ViT-B/16's attention-weighted values (197 x 197 x 64 per head)
    reduce over 197 tokens, a prime: 1-deep blocks sent the 20 accumulators of the register tile to memory and
    back for every FMA step (55 GFLOP/s in place on an Intel Xeon); one 197-deep block keeps them in registers."""
    block = _largest_divisor_at_most(depth, cap)
    return depth if block * 4 < cap else block


def _rows_fit_l1(rows: int, width: int, k_inner: int, dtype: str, l1_block: int) -> bool:
    """Whether the A block of every row (rows x k_inner) and one B block (k_inner x width) fit in ``l1_block``
    bytes (:func:`~kerneltune.targets.caches.l1_block_bytes`): then the register tile repeats down all the
    rows inside one k-block (S2 = every row tile) and each B block is read once, from L1.  A 35-token LM's
    35 x 650 x 10048 decoder, cold, 2 threads, Intel Xeon: 2.96 -> 2.70 ms (it streams a 26 MB weight); its
    35 x 650 x 2624 input projection 0.75 -> 0.73.  128 rows (BERT) need 32 KiB for A alone and keep the
    calibrated rows tile."""
    return (rows + width) * k_inner * (tvm.DataType(dtype).bits // 8) <= l1_block


# The matmul rows tile (S2) without a measurement (tuned on a Zen 5), the candidates (preferred first on
# ties), the shapes they are timed on (BERT-base's two MLP matmuls: 16 row tiles of 8, so every candidate
# is a different schedule; ViT-B/16's 197 tokens, 25 tiles, leave S2 = 1 only), and the margin a
# candidate must win by over the static choice.
STATIC_ROW_REPEAT, ROW_REPEATS = 4, (4, 2, 1)
ROW_REPEAT_SHAPES = ((128, 768, 3072), (128, 3072, 768))
# Each timing runs ROW_REPEAT_RUNS cold calls (the cache flush before each, 22 ms for the 9.4 MB weight, is
# most of the time): 5 rounds of 15 took 12.6 s of a first build on an Intel Xeon, 3 of 7 take 4 s, and the
# minimum over rounds of each round's median still separates 1 from 4 there by 20%.
ROW_REPEAT_MARGIN, ROW_REPEAT_ROUNDS, ROW_REPEAT_RUNS = 0.03, 3, 7


def time_row_repeats(target: tvm.target.Target) -> int:
    """The matmul rows tile S2 this CPU runs best: the register tile repeated S2 times down the rows inside
    one k-block trades L1 reuse of the B block against the A rows it streams and against how the rows split
    between the cores, and the best S2 differs between cores of the same vector width and register count: 4 on
    a Zen 5 (128x768x768, 1 thread: 157 vs 135 GFLOP/s for 2), 1 on an Intel Xeon (2 threads, cold weights:
    ViT-B/16's 197-token MLP matmuls 242-262 vs 185-209 GFLOP/s for 4; the model untuned 168 vs 204 ms, BERT-
    base 104 vs 108).  Each candidate of :data:`ROW_REPEATS` is timed on :data:`ROW_REPEAT_SHAPES` with cold
    weights, in interleaved rounds (min over rounds of each round's median); one replaces the static choice
    only when faster by more than :data:`ROW_REPEAT_MARGIN` on the geometric mean."""
    import dataclasses
    import math

    import numpy as np

    from ..prepack import kernel_timer
    from ..task import make_task

    timers: dict[int, list] = {s2: [] for s2 in ROW_REPEATS}
    for m, k, n in ROW_REPEAT_SHAPES:
        # B is a model weight, as in the models the rows tile is for: pre-packed, the default for a weight (a
        # run-time panel copy, what a weightless task gets, is another kernel: it picked 4 where 1 ran 6% faster)
        task = dataclasses.replace(make_task("matmul", f"{m},{k},{n}"), weights=("B",))
        inputs = task.make_inputs(0)
        for s2 in ROW_REPEATS:
            timers[s2].append(kernel_timer(apply(task, default_config(task, target, s2), target), task, inputs,
                                           target, number=1, repeat=ROW_REPEAT_RUNS, cold=True))
    best: dict[int, list[float]] = {s2: [math.inf] * len(ROW_REPEAT_SHAPES) for s2 in ROW_REPEATS}
    for _ in range(ROW_REPEAT_ROUNDS):  # interleaved: a noisy moment slows every candidate alike
        for s2 in ROW_REPEATS:
            for i, timer in enumerate(timers[s2]):
                best[s2][i] = min(best[s2][i], float(np.median(timer())))
    score = {s2: math.exp(float(np.mean(np.log(best[s2])))) for s2 in ROW_REPEATS}
    log.debug("matmul rows tile: geometric-mean seconds %s", score)
    pick = min(ROW_REPEATS, key=lambda s2: (score[s2], ROW_REPEATS.index(s2)))
    return pick if score[pick] < score[STATIC_ROW_REPEAT] * (1 - ROW_REPEAT_MARGIN) else STATIC_ROW_REPEAT


def _vector_tile(extent: int, lanes: int) -> int:
    """Innermost vector length: a multiple of ``lanes`` dividing ``extent`` (<= 4 vectors), else the largest
    divisor of ``extent`` that fits one vector (a partial vector, e.g. 14 of 16 lanes, is one masked op;
    a length such as 28 or 56 that is neither becomes a pile of shuffles: measured 7 vs 105 GFLOP/s)."""
    whole = [d for d in divisors(extent) if d % lanes == 0 and d <= 4 * lanes]
    if whole:
        return max(whole)
    return _largest_divisor_at_most(extent, lanes)


# A served kernel (rows following a served length) does not repeat its register tile down the rows inside a
# k-block (S2 = 1), whatever a static kernel's ``matmul_row_repeat``.  With S2 > 1 the accumulator tile is
# indexed by the S2 loop, and LLVM keeps it in registers only by promoting it over the k loop inside, which
# a prefetch loop there defeats (each FMA then loads and stores its accumulator); with S2 = 1 its indices are
# constants and it is registers from the start.  So the served kernel can take the static kernels' spread
# prefetch (:mod:`.prefetch`) at lengths one tile covers, and it loses nothing at the others.  Served
# 2..512, tiles of 128 rows, against S2 = 2 with the next k-block prefetched whole (Intel Xeon, 2 threads,
# weights rotated through 48 copies; medians of 9): 768x3072 at 8 rows 0.77 -> 0.52 ms (static build's
# kernel 0.52), 32: 1.17 -> 1.04, 77: 2.04 -> 1.63 (1.63), 128: 2.78 -> 2.70 (2.82), 384: 7.77 -> 7.01
# (7.07); 3072x768 at 8: 0.78 -> 0.53 (0.53), 128: 2.46 -> 2.16 (2.32); warm 384x1536 at 8: 0.045 -> 0.034.
SERVED_ROW_REPEAT = 1

# Vectors a vector axis that follows a served size spans at most (:func:`_served_vector_tile`).
SERVED_VECTORS = 2


def _served_vector_tile(extent: int, lanes: int, widest: int) -> int:
    """The vector tile of an axis that follows a served size (attention's scores ``Q K^T`` over the tokens): at
    most :data:`SERVED_VECTORS` vectors.  The axis is padded to its tile at every size (:func:`_symbolic_tiles`),
    and four vectors padded 77 tokens to 128 and 8 to 64.  MiniLM's scores (12 heads of 32, served 2..512,
    tiles of its instance at 128; Intel Xeon, 2 threads, warm): 4 rows x 64 columns 17.4, 75.5, 102.9, 938.6 us
    at 8, 77, 128, 384 tokens; 8 x 32: 11.5, 59.0, 97.3, 900.1; 8 x 16: 8.5, 62.6, 115.1, 984.3."""
    narrower = [d for d in divisors(extent) if d % lanes == 0 and d <= min(widest, SERVED_VECTORS * lanes)]
    return max(narrower) if narrower else widest


def _fill_accumulators(extent: int, rows: int, lanes: int, accumulators: int, widest: int) -> int:
    """The vector tile whose register tile (rows x vectors) holds the most accumulators; ties keep the
    widest.  The widest tile alone left 35-row matmuls (an LM over 35 tokens) one row deep: 4 vectors x 1 row,
    each B vector loaded for one FMA; 2 vectors x 7 rows fills 14 of AVX-512's 16 (Intel Xeon, 1 thread,
    35 x 650 x 10048: 4.8 vs 7.5 ms)."""
    options = [d for d in divisors(extent) if d % lanes == 0 and d <= widest] or [widest]

    def used(width: int) -> int:
        vectors = -(-width // lanes)
        return _largest_divisor_at_most(rows, max(1, accumulators // vectors)) * vectors

    return max(options, key=lambda w: (used(w), w))


def _balance_parallel(cfg: dict, roles: list[str], want: int, vector: str | None = None) -> None:
    """Make the S0 (parallel) product >= want, taking factors from S1, then S2, S3, ``roles`` in order.
    From a role, a prime that makes the chunks a multiple of ``want`` goes first: 5 chunks on 2 cores (ViT's
    200 rows as 5 x 40) leave one core idle a sixth of the time, 2 do not.  Else the smallest factor giving at
    least 4 chunks per core (an odd count then idles a core at most 1/8 of the time): GPT-2's LM head splits
    its 1571 column tiles, not its rows, so each core streams half of the 154 MB weight, not all of it.  The
    vector axis' S3 (the register tile's width) is split only when nothing else is left: halving it to make
    2 chunks gave a 35 x 650 x 10000 matmul 8-lane vectors, 3.5 ms vs 2.9 for 25 x 25 chunks of 16 lanes
    (Intel Xeon, 2 threads)."""
    def par() -> int:
        out = 1
        for r in roles:
            out *= cfg[r][0]
        return out

    def take(r: str, lvl: int, p: int) -> None:
        cfg[r][lvl] //= p
        cfg[r][0] *= p

    for lvl in (1, 2, 3):
        if par() >= want:
            return
        for r in roles:
            if lvl == 3 and r == vector:
                continue
            even = [p for p in sorted(set(prime_factors(cfg[r][lvl]))) if par() * p >= want and par() * p % want == 0]
            many = [d for d in divisors(cfg[r][lvl]) if par() * d >= 4 * want]
            if even or many:
                take(r, lvl, (even or many)[0])
                return
    for lvl in (1, 2, 3):
        for r in roles:
            while par() < want and cfg[r][lvl] > 1:
                take(r, lvl, min(d for d in divisors(cfg[r][lvl]) if d > 1))


__all__ = ["space", "schedule", "apply", "default_config", "InvalidConfig"]
