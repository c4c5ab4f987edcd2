"""Pieces every template shares: the error type, knob construction, and the schedule preamble that
turns a fused PrimFunc into "one anchor block + one write-back block".

Why a write-back block: both the CPU and GPU templates accumulate the anchor's output tile in a small
``local`` buffer and write it out (with the epilogue applied) once per tile.  When the anchor has an
epilogue (bias, gelu, relu, residual add), the epilogue's elementwise blocks are inlined into the last one,
and that last block *is* the write-back: it reads the local accumulator and writes the output parameter.
Without an epilogue, ``cache_write`` creates it.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir

from ..tir_rewrite import rebuilt_realize, rewrite_stmts
from ..space import DiscreteKnob, FactorKnob, Knob, SearchSpace
from ..task import Task


class InvalidConfig(ValueError):
    """A config the template refuses before building (wrong arity, too many threads, too much shared memory)."""


def tile_knobs(task: Task, spatial_levels: int, reduce_levels: int,
               padded: dict[str, int] | None = None) -> list[Knob]:
    """One factor knob ``tile_<role>`` per anchor axis with extent > 1 (extent-1 axes have no choice).
    ``padded`` gives an axis a split of a larger extent: the loop is split as if it were that long and the
    iterations past its end are masked (``split`` adds the predicate)."""
    padded = padded or {}
    return [FactorKnob(f"tile_{a.role}", padded.get(a.role, a.extent), reduce_levels if a.reduce else spatial_levels)
            for a in task.axes if a.extent > 1]


def check_config(space: SearchSpace, config) -> dict:
    """The config as a name->value dict, or :class:`InvalidConfig` if it is not a point of ``space``."""
    config = tuple(tuple(v) if isinstance(v, list) else v for v in config)
    if not space.contains(config):
        raise InvalidConfig(f"config {config!r} is not in the search space {space.names}")
    return space.as_dict(config)


def tiles(task: Task, cfg: dict, levels_s: int, levels_r: int) -> list[tuple[int, ...]]:
    """Per-axis factor tuple (extent-1 axes: all ones), in anchor-axis order."""
    out = []
    for a in task.axes:
        n = levels_r if a.reduce else levels_s
        out.append(tuple(cfg[f"tile_{a.role}"]) if a.extent > 1 else (1,) * n)
    return out


@dataclass
class Prepared:
    """Schedule state after the preamble: the anchor, its write-back block and its split-ready loops."""

    sch: s_tir.Schedule
    anchor: s_tir.schedule.SBlockRV
    writeback: s_tir.schedule.SBlockRV
    producers_left: list  # producer blocks that could not be inlined (the GPU template schedules pads)


def prepare(task: Task, inline_producers: bool, einsum_padding: list[int] | None = None,
            clamp: bool = False) -> Prepared:
    """Inline producers (pads) if asked, inline the epilogue chain, and make the local write-back block.

    ``einsum_padding`` (a multiple per anchor iterator) first pads the anchor's computation with
    ``pad_einsum``: padded copies of its inputs (kept as stages: inlined, their bounds check would sit in the
    inner loop again) and a crop of its output, which joins the epilogue.  With ``clamp`` (only spatial axes
    padded) the copies of operands padded on outer dimensions only are read through instead: the padding rows
    read the operand's last row (:func:`clamp_padded_reads`), values the crop drops, so no bounds check and no
    copy remain.  An operand padded along its innermost dimension keeps its copy: read through, its vector
    loads would clamp lane by lane."""
    sch = s_tir.Schedule(task.func)
    anchor = sch.get_sblock(task.anchor)
    root_name = task.func.body.block.name_hint
    root = sch.get_sblock(root_name)
    before = {sch.get(b).name_hint for b in sch.get_child_blocks(root)}
    if einsum_padding:
        sch.pad_einsum(anchor, einsum_padding)
        if clamp:
            names = [sch.get(b).name_hint for b in sch.get_child_blocks(root)]
            pads = {name for name in set(names[:names.index(task.anchor)]) - before
                    if _outer_padding(sch.get(sch.get_sblock(name)))}
            sch = s_tir.Schedule(clamp_padded_reads(sch.mod["main"], pads))
            for name in pads:
                sch.compute_inline(sch.get_sblock(name))
            anchor, root = sch.get_sblock(task.anchor), sch.get_sblock(root_name)
    children = sch.get_child_blocks(root)
    names = [sch.get(b).name_hint for b in children]
    pos = names.index(task.anchor)
    producers_left = []
    for name in names[:pos]:
        if inline_producers and name in before:
            try:
                sch.compute_inline(sch.get_sblock(name))
                continue
            except s_tir.ScheduleError:
                pass
        producers_left.append(sch.get_sblock(name))
    epilogue = names[pos + 1:]
    for name in epilogue[:-1]:
        sch.compute_inline(sch.get_sblock(name))
    if epilogue:
        writeback = sch.get_sblock(epilogue[-1])
        sch.set_scope(anchor, 0, "local")
    else:
        writeback = sch.cache_write(anchor, 0, "local")
    return Prepared(sch, anchor, writeback, producers_left)


_IF_THEN_ELSE = "prim.if_then_else"


def _outer_padding(block) -> bool:
    """Whether a padded copy's innermost dimension is its operand's whole one (only outer dimensions padded)."""
    (read,), (write,) = block.reads, block.writes
    source, padded = read.source.shape, write.source.shape
    return len(source) == len(padded) and tvm.sym.Analyzer().can_prove_equal(source[-1], padded[-1])


def clamp_padded_reads(func: tvm.tirx.PrimFunc, blocks: set[str]) -> tvm.tirx.PrimFunc:
    """``func`` with each of ``blocks`` (``pad_einsum``'s padded copies: ``if_then_else(in bounds, X[..], 0)``)
    reading ``X`` at its indices clamped into ``X``'s shape instead.  Right only where every padded axis is
    spatial: a padding row or column then holds a copy of the last real one, which only padding outputs read."""
    def clamp(stmt):
        if isinstance(stmt, s_tir.SBlockRealize) and stmt.block.name_hint in blocks:
            return rebuilt_realize(stmt, _clamped(stmt.block.body))
        return None

    return func.with_body(rewrite_stmts(func.body, clamp)[0])


def _clamped(store):
    value = store.value
    if not (isinstance(store, tvm.tirx.BufferStore) and isinstance(value, tvm.ir.Call)
            and getattr(value.op, "name", "") == _IF_THEN_ELSE and isinstance(value.args[1], tvm.ir.TensorLoad)):
        raise InvalidConfig("a padded copy that is not an in-bounds select")
    load = value.args[1]
    index = [tvm.tirx.min(i, extent - 1) for i, extent in zip(load.indices, load.source.shape)]
    return tvm.tirx.BufferStore(store.buffer, tvm.tirx.BufferLoad(load.source, index), store.indices)


def split_axes(sch: s_tir.Schedule, anchor, task: Task, factors: list[tuple[int, ...]]) -> list[list]:
    """Split each anchor loop by its factors; returns per-axis lists of loops (outermost first).

    A loop whose extent is symbolic (a kernel of a build that serves a range of lengths, scheduled with the
    tiles of its instance at a representative length: :mod:`pipeline.symbolic`) takes the factor marked None,
    else its outermost, from the extent: ``ceil(n / tile)`` (the CPU template pads such an axis to whole tiles
    first; unpadded, the last tile is masked)."""
    loops = sch.get_loops(anchor)
    if len(loops) != len(task.axes):
        raise InvalidConfig(f"anchor {task.anchor} has {len(loops)} loops, expected {len(task.axes)}")
    out = []
    for loop, f in zip(loops, factors):
        fixed = isinstance(sch.get(loop).extent, tvm.tirx.IntImm)
        f = list(f) if fixed or None in f else [None, *f[1:]]
        out.append(list(sch.split(loop, f)) if len(f) > 1 else [loop])
    return out


def unroll_knob(values: tuple[int, ...]) -> DiscreteKnob:
    return DiscreteKnob("unroll", values)
