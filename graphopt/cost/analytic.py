"""Roofline cost: ``max(FLOPs / peak, bytes / bandwidth) + launch overhead`` against this machine's peak
FLOP rate and memory bandwidth, both measured once with numpy and cached.  Fast and deterministic: for
tests, and for targets that cannot be measured here (only relative costs mean anything then).
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import numpy as np

from graphopt import ops
from graphopt.cost.analysis import numel
from graphopt.cost.base import LAUNCH_OVERHEAD_S, CostModel, Shape, itemsize, params_key
from graphopt.cost.cache import CostCache, cache_dir
from graphopt.ir import Graph, Node


def measure_machine(force: bool = False) -> dict[str, float]:
    """Peak float32 FLOP/s (numpy sgemm) and memory bandwidth (numpy copy), measured once and cached (both
    measured again when either cached number is missing or not a positive rate)."""
    cache = CostCache(cache_dir() / "machine.json")
    cached = {key: cache.get(key) for key in ("peak_flops", "bandwidth")}
    if not force and None not in cached.values():
        return cached
    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    peak = 2 * n ** 3 / best
    src = np.ones(1 << 23, dtype=np.float32)  # 32 MiB, beyond the caches
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    bandwidth = 2 * src.nbytes / best
    result = {"peak_flops": peak, "bandwidth": bandwidth}
    for key, value in result.items():
        cache.put(key, value)
    cache.flush()
    return result


def op_flops(op: str, params: dict[str, Any], in_shapes: Sequence[Shape], out_shapes: Sequence[Shape]) -> float:
    """Multiply-adds count twice; data movement ops count zero; everything else one FLOP per output."""
    out = sum(math.prod(s) for s in out_shapes)
    name = op.lower()
    if "matmul" in name or name in ("gemm", "linear", "dense"):
        return 2.0 * out * in_shapes[0][-1]
    if "conv" in name and len(in_shapes) > 1:
        w = in_shapes[1]
        return 2.0 * out * math.prod(w[1:])
    if "pool" in name:
        k = params.get("kernel") or params.get("kernel_shape") or (1, 1)
        return float(out * math.prod(k if isinstance(k, (tuple, list)) else (k, k)))
    if name in ("concat", "split", "transpose", "reshape", "flatten", "squeeze", "unsqueeze") or name.startswith(
            ("concat", "split", "transpose", "reshape")):
        return 0.0
    return float(out)


_VIEW_OPS = ("reshape", "flatten", "squeeze", "unsqueeze")


class AnalyticCost(CostModel):
    """Roofline cost against the measured peak and bandwidth of this machine."""

    name = "analytic"

    def __init__(self, peak_flops: float | None = None, bandwidth: float | None = None):
        if peak_flops is None or bandwidth is None:
            m = measure_machine()
            peak_flops = peak_flops or m["peak_flops"]
            bandwidth = bandwidth or m["bandwidth"]
        self.peak_flops = float(peak_flops)
        self.bandwidth = float(bandwidth)
        self._memo: dict[Any, float] = {}

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / self.bandwidth) + LAUNCH_OVERHEAD_S

    def op_cost(self, op: str, params: dict[str, Any], in_shapes: Sequence[Shape], dtype: str = "float32") -> float:
        key = (op, params_key(params), tuple(in_shapes), dtype)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        out_shapes = [tuple(s) for s in ops.infer_shape(op, params, list(in_shapes))]
        if op.lower().startswith(_VIEW_OPS):
            cost = LAUNCH_OVERHEAD_S
        else:
            size = itemsize(dtype)
            nbytes = size * (sum(math.prod(s) for s in in_shapes) + sum(math.prod(s) for s in out_shapes))
            cost = self._roofline(op_flops(op, params, in_shapes, out_shapes), nbytes)
        self._memo[key] = cost
        return cost

    def opaque_cost(self, node: Node, graph: Graph) -> float:
        ins = [graph.tensor(t) for t in node.inputs if t]
        outs = [graph.tensor(t) for t in node.outputs if t]
        nbytes = 0.0
        for info in ins + outs:
            n = numel(info.shape) if info is not None else None
            nbytes += (n or 0) * itemsize(info.dtype if info else "float32")
        flops = 0.0
        in_shapes = [tuple(i.shape) for i in ins if i is not None and i.is_static]
        out_shapes = [tuple(o.shape) for o in outs if o is not None and o.is_static]
        if node.op_type in ("MatMul", "Gemm") and len(in_shapes) >= 2 and out_shapes:
            k = in_shapes[0][-1] if node.op_type == "MatMul" or not node.attr("transA") else in_shapes[0][0]
            flops = 2.0 * math.prod(out_shapes[0]) * k
        elif node.op_type == "Conv" and len(in_shapes) >= 2 and out_shapes:
            flops = 2.0 * math.prod(out_shapes[0]) * math.prod(in_shapes[1][1:])
        elif out_shapes:
            flops = float(sum(math.prod(s) for s in out_shapes))
        if node.op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Shape", "Identity"):
            return LAUNCH_OVERHEAD_S
        return self._roofline(flops, nbytes)
