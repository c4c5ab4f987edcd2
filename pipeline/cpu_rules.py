"""Default CPU schedules for the kernels no template covers (elementwise, layout, gather, leftovers).

dlight ships two CPU rules (GEMV and Reduction: softmax, layer norm) and nothing for injective kernels, and
TVM's default lowering leaves every loop serial and scalar.  On BERT that makes the reshape/transpose, bias,
GELU and mask kernels cost as much as the matmuls, on one core.  These two rules give them the minimum a
CPU needs: inline the chain into one loop nest, parallelize the outer spatial loops across the thread pool
and vectorize the innermost loop.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.base.utils import get_extent
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width

# Below this many output elements per thread the fork/join of the pool costs more than it saves.
MIN_PARALLEL_ELEMS = 4096


def vector_lanes(target: Target, dtype_bits: int = 32) -> int:
    bits = llvm_get_vector_width(target)
    return max((bits if bits > 0 else 128) // dtype_bits, 1)


def _out_bits(sch: s_tir.Schedule, block) -> int:
    writes = sch.get(block).writes
    return writes[0].source.dtype.bits if writes else 32


def _parallel_vectorize(sch: s_tir.Schedule, block, lanes: int, num_cores: int) -> None:
    """Vectorize the innermost loop by ``lanes`` and parallelize the fused loops outside the vector.

    Only the innermost loop is vectorized (not a fusion of all loops) so vector accesses stay contiguous
    with simple index arithmetic; everything outside it is fused into one parallel loop.
    """
    loops = sch.get_loops(block)
    if not loops:
        return
    inner = loops[-1]
    extent = get_extent(sch, inner)
    total = 1
    for lp in loops:
        e = get_extent(sch, lp)
        if not isinstance(e, int):
            return
        total *= e
    outer_loops = list(loops[:-1])
    if extent >= 2 * lanes and extent % lanes == 0:
        io, ii = sch.split(inner, factors=[None, lanes])
        sch.vectorize(ii)
        outer_loops.append(io)
    elif 4 <= extent <= lanes:
        sch.vectorize(inner)
    else:
        outer_loops.append(inner)
    if num_cores > 1 and total >= MIN_PARALLEL_ELEMS and outer_loops:
        sch.parallel(sch.fuse(*outer_loops) if len(outer_loops) > 1 else outer_loops[0])


class Injective(CPUScheduleRule):
    """All-spatial kernels: inline into one block, then parallel + vectorized loop."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(b.is_injective() for b in infos):
            return None
        infos = try_inline(sch, infos)
        cores = int(target.attrs.get("num-cores", 1))
        for info in infos:
            _parallel_vectorize(sch, info.block_rv, vector_lanes(target, _out_bits(sch, info.block_rv)), cores)
        return sch


class ParallelFallback(CPUScheduleRule):
    """Anything else (reductions dlight rejects, gathers): inline what can be, parallelize outer spatial."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline(sch, infos)
        if int(target.attrs.get("num-cores", 1)) < 2:
            return sch
        for info in infos:
            loops = sch.get_loops(info.block_rv)
            kinds = info.dom_kind()
            lead = len(kinds) - len(kinds.lstrip("S"))
            if lead == 0 or len(loops) < lead:
                continue
            outer = sch.fuse(*loops[:lead]) if lead > 1 else loops[0]
            if isinstance(get_extent(sch, outer), int) and get_extent(sch, outer) > 1:
                sch.parallel(outer)
        return sch
