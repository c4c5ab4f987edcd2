"""Software prefetch of a pre-packed weight's next panel, spread over the current panel's work.

A matmul with a constant B runs over B's column panels (``[N/nb, K, nb]``, :func:`.cpu._prepack`), and each
core computes every row tile of one panel before the next.  In a model the weights come from DRAM (BERT-base
streams 340 MB per inference), and the hardware prefetchers only see a panel once its first row tile reads
it: that tile then waits on DRAM at its full FMA rate of demand (192 bytes per 12 cycles), and the other row
tiles find the panel in L2.  Prefetching the *next* panel a few lines at a time, at the start of every
k-block of every row tile, spreads the stream evenly over the panel's work: on an Intel Xeon (AVX-512, 2
threads) BERT-base's 128x768x3072 with cold weights ran 2.53 -> 2.14 ms, against 1.95 ms for the same kernel
with the weights already in cache.  Prefetches go to L2 (``prefetcht1``): a panel (147 KB) is larger
than L1.

The NCHW[x]c convs do not take it: their input-channel chunks are short (a 1x1 conv's is 256 FMAs), so the
prefetch loop's index arithmetic costs more than it hides (Intel Xeon, cold weights: ResNet-50's 64->256 1x1
at 56x56 0.44 -> 0.54 ms with it, 256->1024 at 14x14 0.45 -> 0.47), and with the channel chunks outside the
rows (their default where weights are large) each chunk is read once, in order, already.

TVM's schedule primitives have no prefetch, so it is inserted into the scheduled PrimFunc as a loop of
``tirx.prefetch`` calls (LLVM's ``llvm.prefetch``) at the top of the k-block loop.  A prefetch never faults and
changes no value: the kernel computes what it did.
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


def plan(sch: s_tir.Schedule, packed_block, outer_fused, outer_extents: list[int], panel_position: int,
         panel_loop, sharing_loops: list, k_block) -> PanelPrefetch | None:
    """The prefetch of a schedule whose current panel is ``S0 * S1`` of one axis (a matmul's columns).

    ``outer_fused``: the parallel loop, the fusion of loops of ``outer_extents`` (the panel axis' S0 at
    ``panel_position``); ``panel_loop``: the panel axis' S1 loop; ``sharing_loops``: the loops between it and
    ``k_block`` (the k-block loop), whose iterations all read the same panel, so they
    count the slots with the k-blocks.  None when no loop shares the panel: one register tile then reads
    each panel once, a plain stream the hardware prefetchers follow (a matrix-vector product, 1 x 650 x
    2624 on an Intel Xeon: 0.36 ms without, 0.40 with)."""
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
    if isinstance(slots, int) and slots == 1:
        return None
    # a symbolic count: at lengths of one row tile the panel is read once, a plain stream, as above (BERT-base
    # served 2..512 at 8 tokens, Intel Xeon, 2 threads: the MLP matmuls 0.66 -> 0.55 ms with the prefetch
    # skipped there, as a static build of that length skips it)
    shared = None if isinstance(slots, int) else slots > 1
    k = sch.get(k_block)
    return PanelPrefetch(buffer, k.loop_var, panel, slot * k.extent + k.loop_var, slots * int(k.extent),
                         str(k.extent.ty), shared)


def insert(func: tirx.PrimFunc, p: PanelPrefetch) -> tirx.PrimFunc:
    """``func`` with the prefetch loop placed first in the body of the loop over ``p.at``."""
    panels, *inner = (int(x) for x in p.buffer.shape)
    size = 1
    for e in inner:
        size *= e
    per_line = CACHE_LINE * 8 // tvm.DataType(str(p.buffer.dtype)).bits
    lines = -(-size // per_line)
    i64 = p.index_dtype
    if isinstance(p.slots, int):
        share = tirx.const(-(-lines // p.slots), i64)
    else:  # the lines per slot follow the length: the whole panel is still spread over its slots
        share = tirx.floordiv(tirx.const(lines, i64) + p.slots - 1, p.slots)
    t = tirx.Var("prefetch_line", i64)
    flat = tirx.min((p.slot * share + t) * per_line, tirx.const(size - 1, i64))
    index = []
    for e in reversed(inner):   # the panel's element at ``flat``, in the buffer's own axes
        index.insert(0, tirx.floormod(flat, e))
        flat = tirx.floordiv(flat, e)
    nxt = tirx.min(p.panel + 1, tirx.const(panels - 1, i64))
    address = tirx.address_of(tirx.BufferLoad(p.buffer, [nxt, *index]))
    call = tirx.call_intrin("void", "tirx.prefetch", address, 0, L2_LOCALITY, 1)
    loop = tirx.For(t, tirx.const(0, i64), share, tirx.ForKind.SERIAL, tirx.Evaluate(call))
    if p.shared is not None:
        loop = tirx.IfThenElse(p.shared, loop, None)
    body, found = rewrite_stmts(func.body, lambda s: rebuilt_loop(s, tirx.SeqStmt([loop, s.body]))
                                if isinstance(s, tirx.For) and s.loop_var.same_as(p.at) else None)
    if not found:
        raise ValueError(f"no loop over {p.at.name} in the scheduled kernel")
    return func.with_body(body)
