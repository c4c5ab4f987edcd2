"""Software prefetch of a pre-packed weight's panels: the next panel spread over the current panel's work, or,
where one register tile reads each panel once, the current panel's next k-block spread over the current one.

A matmul with a constant B runs over B's column panels (``[N/nb, K, nb]``, :func:`.cpu._prepack`), and each
core computes every row tile of one panel before the next.  In a model the weights come from DRAM (BERT-base
streams 340 MB per inference), and the hardware prefetchers only see a panel once its first row tile reads
it: that tile then waits on DRAM at its full FMA rate of demand (192 bytes per 12 cycles), and the other row
tiles find the panel in L2.  Prefetching the *next* panel a few lines at a time, at the start of every
k-block of every row tile, spreads the stream evenly over the panel's work: on an Intel Xeon (AVX-512, 2
threads) BERT-base's 128x768x3072 with cold weights ran 2.53 -> 2.14 ms, against 1.95 ms for the same kernel
with the weights already in cache.  Prefetches go to L2 (``prefetcht1``): a panel (147 KB) is larger
than L1.

Where one register tile covers every row (a few tokens: GPT-2 or BERT at 8), each panel is read once, in
order, and the next panel is too far ahead (BERT-base at 8 tokens: its MLP matmuls 0.55 -> 0.66 ms with it).
Such a stream still starves: a k-step of an 8-row tile is ~40 instructions for 3 new cache lines, so the
core's out-of-order window holds few misses in flight, and the kernel streamed 10-13 GB/s where a
matrix-vector product (6 instructions per 4 lines) streams 23.  So the current panel's *next* k-block is
prefetched, a few lines at every step of the loop inside the current k-block (3 lines per step of 64 in an
8 x 48 tile over 768).  Intel Xeon, 2 threads, weights streamed from DRAM by rotating 48 copies of each:
8x768x3072 0.70 ms with the whole next k-block prefetched at the top of each k-block, 0.48 spread over its
steps, 0.65 for onnxruntime's MatMul in the same rotation; 8x3072x768 0.81 -> 0.54; 4x768x3072 0.66 -> 0.46;
2x768x3072 0.59 -> 0.39.  A one-row tile keeps none: its stream is already fast, and a
prefetch of the next k-block cost it 15% (1x768x3072 0.41 -> 0.48 ms).  A kernel serving a range of lengths
does the same at the lengths one tile covers, and prefetches the next panel at the others (:func:`plan`);
served 2..512, at 8 tokens GPT-2 ran 34.9 -> 25.9 ms and BERT-base 26.4 -> 18.4 with it (onnxruntime 34.1
and 25.3 in the same runs), against the next k-block prefetched whole at the top of each k-block, which was
all a served tile repeated down the rows could take (``cpu.SERVED_ROW_REPEAT``).

The NCHW[x]c convs do not take it: their input-channel chunks are short (a 1x1 conv's is 256 FMAs), so the
prefetch loop's index arithmetic costs more than it hides (Intel Xeon, cold weights: ResNet-50's 64->256 1x1
at 56x56 0.44 -> 0.54 ms with it, 256->1024 at 14x14 0.45 -> 0.47), and with the channel chunks outside the
rows (their default where weights are large) each chunk is read once, in order, already.

TVM's schedule primitives have no prefetch, so it is inserted into the scheduled PrimFunc as a loop of
``tirx.prefetch`` calls (LLVM's ``llvm.prefetch``) at the top of the k-block loop, or of the loop inside it.
A prefetch never faults and changes no value: the kernel computes what it did.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx

from ..targets.caches import CACHE_LINE
from ..tir_rewrite import rebuilt_loop, rewrite_stmts

L2_LOCALITY = 2   # llvm.prefetch locality 2: x86 prefetcht1, into L2


@dataclass(frozen=True)
class PanelPrefetch:
    """Where and what to prefetch.  ``panel`` is the current panel's index and ``slot`` the position of the
    current k-block among the panel's (``slots`` of them), both in loop variables bound at ``at``'s top."""
    buffer: tirx.Buffer          # the packed weight, [panels, ...]: one panel contiguous
    at: tirx.Var                 # the k-block loop: each iteration first prefetches its share
    panel: tirx.PrimExpr
    slot: tirx.PrimExpr
    slots: int | tirx.PrimExpr  # an expression where a sharing loop's count follows a symbolic length
    index_dtype: str             # the loops' index type (int64 in imported models)
    shared: tirx.PrimExpr | None = None  # with a symbolic count: true when more than one tile shares the panel
    next_panel: bool = True      # the next panel's lines at the top of each k-block (where tiles share a panel)
    ahead: tirx.Var | None = None  # the loop (inside a k-block, or ``at``) that prefetches the next k-block's lines
    ahead_steps: int = 1         # its extent (1 for ``at``: the whole next k-block at once)
    blocks: int = 1              # the k-blocks of a panel (the extent of ``at``)


def plan(sch: s_tir.Schedule, packed_block, outer_fused, outer_extents: list[int], panel_position: int,
         panel_loop, sharing_loops: list, k_loops: tuple) -> PanelPrefetch | None:
    """The prefetch of a schedule whose current panel is ``S0 * S1`` of one axis (a matmul's columns).

    ``outer_fused``: the parallel loop, the fusion of loops of ``outer_extents`` (the panel axis' S0 at
    ``panel_position``); ``panel_loop``: the panel axis' S1 loop; ``sharing_loops``: the loops between it and
    ``k_block`` (the k-block loop), whose iterations all read the same panel, so they
    count the slots with the k-blocks; ``k_loops``: ``(k_block, k_inner)``.  Where no loop shares the panel
    (at a symbolic length: where it does not), one register tile reads each panel once: the current panel's
    next k-block is prefetched over the steps of ``k_inner`` (the loop inside the k-block; None for a one-row
    tile, a plain stream the hardware prefetchers follow: a matrix-vector product, 1 x 650 x 2624 on an
    Intel Xeon, 0.36 ms without, 0.40 with, and then no prefetch at all)."""
    buffer = sch.get(packed_block).writes[0].source
    fused = sch.get(outer_fused).loop_var
    inner = 1
    for e in outer_extents[panel_position + 1:]:
        inner *= e
    s0 = tirx.floormod(tirx.floordiv(fused, inner), outer_extents[panel_position]) if len(outer_extents) > 1 else fused
    loop = sch.get(panel_loop)
    panel = s0 * loop.extent + loop.loop_var
    slot, slots = 0, 1
    for rv in sharing_loops:  # a symbolic count (the rows of a kernel serving a range of lengths) stays an expression
        loop = sch.get(rv)
        count = int(loop.extent) if isinstance(loop.extent, tirx.IntImm) else loop.extent
        slot, slots = slot * loop.extent + loop.loop_var, slots * count
    k_block, k_inner = k_loops
    k = sch.get(k_block)
    blocks = int(k.extent)
    ahead = sch.get(k_inner) if blocks > 1 and k_inner is not None else None
    # the prefetching loop's steps: 1 where it is the k-block loop itself (the next k-block whole at its top)
    steps = 1 if ahead is None or ahead.loop_var.same_as(k.loop_var) else int(ahead.extent)
    if isinstance(slots, int) and slots == 1:
        return None if ahead is None else PanelPrefetch(
            buffer, k.loop_var, panel, k.loop_var, 1, str(k.extent.ty), None, next_panel=False,
            ahead=ahead.loop_var, ahead_steps=steps, blocks=blocks)
    # a symbolic count: at lengths of one row tile the panel is read once, as above (BERT-base served 2..512 at
    # 8 tokens, Intel Xeon, 2 threads: the MLP matmuls 0.66 -> 0.55 ms without the next panel's prefetch there),
    # and its next k-block is prefetched as in a static kernel; at the others, the next panel.  ``k_inner`` is
    # the k-block loop itself where the kernel's tile repeats down the rows (``cpu.SERVED_ROW_REPEAT``): the
    # next k-block whole at its top.
    shared = None if isinstance(slots, int) else slots > 1
    one_tile = {} if ahead is None or shared is None else {"ahead": ahead.loop_var, "ahead_steps": steps,
                                                           "blocks": blocks}
    return PanelPrefetch(buffer, k.loop_var, panel, slot * k.extent + k.loop_var, slots * blocks,
                         str(k.extent.ty), shared, **one_tile)


def insert(func: tirx.PrimFunc, p: PanelPrefetch) -> tirx.PrimFunc:
    """``func`` with the prefetch loop placed first in the body of the loop over ``p.at``."""
    panels, *inner = (int(x) for x in p.buffer.shape)
    size = 1
    for e in inner:
        size *= e
    per_line = CACHE_LINE * 8 // tvm.DataType(str(p.buffer.dtype)).bits
    lines = -(-size // per_line)
    i64 = p.index_dtype

    def lines_of(panel, slot, slots) -> tirx.For:
        """A loop prefetching the lines of slot ``slot`` of ``slots`` equal shares of panel ``panel``."""
        if isinstance(slots, int):
            share = tirx.const(-(-lines // slots), i64)
        else:  # the lines per slot follow the length: the whole panel is still spread over its slots
            share = tirx.floordiv(tirx.const(lines, i64) + slots - 1, slots)
        t = tirx.Var("prefetch_line", i64)
        flat = tirx.min((slot * share + t) * per_line, tirx.const(size - 1, i64))
        index = []
        for e in reversed(inner):   # the panel's element at ``flat``, in the buffer's own axes
            index.insert(0, tirx.floormod(flat, e))
            flat = tirx.floordiv(flat, e)
        address = tirx.address_of(tirx.BufferLoad(p.buffer, [panel, *index]))
        call = tirx.call_intrin("void", "tirx.prefetch", address, 0, L2_LOCALITY, 1)
        return tirx.For(t, tirx.const(0, i64), share, tirx.ForKind.SERIAL, tirx.Evaluate(call))

    at_top, in_block = None, None  # the loops placed at the top of ``p.at``'s body and of ``p.ahead``'s
    if p.ahead is not None:  # the current panel's next k-block, at once or a few lines at each inner step
        whole = p.ahead.same_as(p.at)
        slot = p.at + 1 if whole else (p.at + 1) * p.ahead_steps + p.ahead
        here = tirx.IfThenElse(p.at + 1 < tirx.const(p.blocks, i64),
                               lines_of(p.panel, slot, p.blocks * (1 if whole else p.ahead_steps)), None)
        if p.shared is not None and not whole:  # only at lengths one tile covers
            here = tirx.IfThenElse(tirx.Not(p.shared), here, None)
        at_top, in_block = (here, None) if whole else (None, here)
    if p.next_panel:
        nxt = lines_of(tirx.min(p.panel + 1, tirx.const(panels - 1, i64)), p.slot, p.slots)
        at_top = nxt if p.shared is None else tirx.IfThenElse(p.shared, nxt, at_top)
    body = func.body
    for var, loop in ((p.at, at_top), (p.ahead, in_block)):
        if loop is None:
            continue
        body, found = rewrite_stmts(body, lambda s, v=var, lp=loop: rebuilt_loop(s, tirx.SeqStmt([lp, s.body]))
                                    if isinstance(s, tirx.For) and s.loop_var.same_as(v) else None)
        if not found:
            raise ValueError(f"no loop over {var.name} in the scheduled kernel")
    return func.with_body(body)
