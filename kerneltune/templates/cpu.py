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
the anchor or kept as a separate parallel, vectorized copy (knob ``pad``); other epilogue blocks are inlined
into the write-back.  ``decompose_reduction`` comes last, splitting the accumulator's init out of the k-loops.

Knobs: ``tile_<role>`` (factor, 4 levels spatial / 2 levels reduction) per axis of extent > 1, ``unroll``
(0/16/64/512), and ``pad`` (stage/inline) for convs.
"""
from __future__ import annotations

import tvm
from tvm import tirx

from ..space import ChoiceKnob, SearchSpace
from ..task import Task
from .common import InvalidConfig, check_config, prepare, split_axes, tile_knobs, tiles, unroll_knob

UNROLL = (0, 16, 64, 512)


def has_producers(task: Task) -> bool:
    """Whether the anchor has producer blocks (a conv's pad) that can be inlined or kept as a stage."""
    return any(b != task.anchor for b in task.block_names[:task.block_names.index(task.anchor)])


def space(task: Task) -> SearchSpace:
    knobs = tile_knobs(task, 4, 2) + [unroll_knob(UNROLL)]
    if has_producers(task):
        # inline: no extra pass, but a bounds check per load; stage: one parallel copy, branch-free inner loop.
        knobs.append(ChoiceKnob("pad", ("stage", "inline")))
    return SearchSpace(knobs)


def vector_lanes(target: tvm.target.Target, dtype: str) -> int:
    """fp32 lanes of the widest vector unit: 16 with AVX-512, else 8 (AVX2); scaled by element size."""
    mcpu = str(target.attrs.get("mcpu", "")) if "mcpu" in target.attrs else ""
    mattr = [str(a) for a in target.attrs.get("mattr", [])] if "mattr" in target.attrs else []
    avx512 = mcpu in ("znver4", "znver5", "skylake-avx512", "cascadelake", "icelake-server", "sapphirerapids",
                      "cooperlake", "tigerlake", "icelake-client", "graniterapids") or "+avx512f" in mattr
    bits = 512 if avx512 else 256
    return max(1, bits // tvm.DataType(dtype).bits)


def num_cores(target: tvm.target.Target) -> int:
    return int(target.attrs["num-cores"]) if "num-cores" in target.attrs else 1


def apply(task: Task, config, target: tvm.target.Target) -> tirx.PrimFunc:
    cfg = check_config(space(task), config)
    factors = tiles(task, cfg, 4, 2)
    p = prepare(task, inline_producers=cfg.get("pad", "inline") == "inline")
    sch = p.sch
    for blk in p.producers_left:
        loops = sch.get_loops(blk)
        sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 1 else loops[0])
        if len(loops) > 1:
            sch.vectorize(loops[-1])
    parts = split_axes(sch, p.anchor, task, factors)
    spatial = [lp for lp, a in zip(parts, task.axes) if not a.reduce]
    reduction = [lp for lp, a in zip(parts, task.axes) if a.reduce]
    # Unsplit (extent-1) axes contribute one loop: spatial ones go to S0, reductions to R0.
    lvl = lambda ls, i, n: (ls[i] if len(ls) == n else (ls[0] if i == 0 else None))  # noqa: E731
    s = [[x for x in (lvl(ls, i, 4) for ls in spatial) if x is not None] for i in range(4)]
    r = [[x for x in (lvl(ls, i, 2) for ls in reduction) if x is not None] for i in range(2)]
    sch.reorder(*s[0], *s[1], *r[0], *s[2], *r[1], *s[3])
    outer = sch.fuse(*s[0]) if len(s[0]) > 1 else s[0][0]
    sch.parallel(outer)
    if cfg["unroll"]:
        sch.annotate(outer, "pragma_auto_unroll_max_step", cfg["unroll"])
        sch.annotate(outer, "pragma_unroll_explicit", 1)
    sch.vectorize(s[3][-1])
    sch.reverse_compute_at(p.writeback, s[1][-1])
    sch.vectorize(sch.get_loops(p.writeback)[-1])
    sch.decompose_reduction(p.anchor, r[0][0])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in _divisors(n) if d <= cap)


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


def default_config(task: Task, target: tvm.target.Target):
    """Heuristic tiles without tuning, chosen from a sweep on 128x768x768 (see the module docstring).

    * vector axis: S3 = whole vectors (up to 4: 64 fp32 lanes with AVX-512), else the largest divisor that
      fits one vector (a 56-wide conv row: 4 x 14 lanes, 105 GFLOP/s, vs 7 x 8 lanes 69, vs 2 x 28 lanes 7);
    * rows axis: S3 = 16 / vectors -> 16 vector accumulators (of 32 zmm); matmuls reuse the tile twice
      per k-block (S2 = 2); convs take 8 filters x 2 output rows so each weight broadcast feeds 2 FMAs
      (measured 52 vs 44 GFLOP/s for 16 filters x 1 row on a 56x56x64 3x3 conv; NCHW stays load-bound);
    * reductions: R1 (inner) = 64 deep along ``k`` / ``rc*ry*rx`` so operand panels stay in L1;
    * parallel: prime factors move from S1 (then S2, S3) of the outer axes to S0 until every core has work.
    """
    sp = space(task)
    lanes = vector_lanes(target, task.dtype)
    vec, rows = task.vector_axis, rows_axis(task)
    window = 1
    for a in task.axes:
        if a.reduce and a.role != "rc" and a.role != "k":
            window *= a.extent
    vec_s3 = _vector_tile(task.axis(vec).extent, lanes)
    nvec = -(-vec_s3 // lanes)
    # conv: a second output row shares every weight broadcast, then filters fill 16 vector accumulators
    y_s3 = _largest_divisor_at_most(task.axis("y").extent, 2) if task.kind == "conv2d" else 1
    cfg: dict = {}
    for a in task.axes:
        if a.extent == 1:
            continue
        e = a.extent
        if a.reduce:
            inner = e if a.role not in ("k", "rc") else _largest_divisor_at_most(e, max(1, 64 // window))
            cfg[a.role] = [e // inner, inner]
            continue
        s2 = 1
        if a.role == vec:
            s3 = vec_s3
        elif a.role == rows:
            s3 = _largest_divisor_at_most(e, max(1, 16 // (nvec * y_s3)))
            s2 = _largest_divisor_at_most(e // s3, 2) if task.kind != "conv2d" else 1
        elif task.kind == "conv2d" and a.role == "y":
            s3 = y_s3
        else:
            s3 = 1
        cfg[a.role] = [1, e // (s2 * s3), s2, s3]
    _balance_parallel(cfg, [a.role for a in task.axes if not a.reduce and a.extent > 1], num_cores(target))
    values = {f"tile_{k}": tuple(v) for k, v in cfg.items()}
    values["unroll"] = 64
    # A padding pad block has bounds checks (if_then_else) that cost ~10x inside the conv's inner loop; a
    # pad of 0 is a plain copy, better inlined.
    values["pad"] = "stage" if "if_then_else" in task.func.script() else "inline"
    return tuple(values[name] for name in sp.names)


def _vector_tile(extent: int, lanes: int) -> int:
    """Innermost vector length: a multiple of ``lanes`` dividing ``extent`` (<= 4 vectors), else the largest
    divisor of ``extent`` that fits one vector (a partial vector, e.g. 14 of 16 lanes, is one masked op;
    a length such as 28 or 56 that is neither becomes a pile of shuffles: measured 7 vs 105 GFLOP/s)."""
    whole = [d for d in _divisors(extent) if d % lanes == 0 and d <= 4 * lanes]
    if whole:
        return max(whole)
    return _largest_divisor_at_most(extent, lanes)


def _balance_parallel(cfg: dict, roles: list[str], want: int) -> None:
    """Make the S0 (parallel) product >= want, taking prime factors from S1, then S2, S3, outer axes first."""
    def par() -> int:
        out = 1
        for r in roles:
            out *= cfg[r][0]
        return out

    for lvl in (1, 2, 3):
        for r in roles:
            while par() < want and cfg[r][lvl] > 1:
                p = min(d for d in _divisors(cfg[r][lvl]) if d > 1)
                cfg[r][lvl] //= p
                cfg[r][0] *= p


__all__ = ["space", "apply", "default_config", "InvalidConfig", "vector_lanes"]
