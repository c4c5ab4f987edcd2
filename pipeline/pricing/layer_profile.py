"""``run-model DIR --profile``: where the shipped build spends its time, kernel by kernel, in the ONNX model's
own terms, beside onnxruntime's profile of the same file.

Each kernel call is timed inside the VM (:func:`pipeline.pricing.profile.time_calls`) and named by the ONNX nodes it
computes (report.json's ``call_sites``, :mod:`pipeline.passes.provenance`).  A kernel's rate is set against this
CPU's roofline: the lower of the practical FMA peak and its bytes over the read bandwidth, both measured once
per CPU (:func:`pipeline.pricing.sanity.cpu_facts`).

onnxruntime's profile (``SessionOptions.enable_profiling``) names its own nodes, many of them fused or made
up ("gemm_input_reshape_token_21").  Each is credited to the ONNX node of the file that produces one of its
outputs, or, for a node whose outputs are all its own, to that of the first later node that does
(:func:`ort_node_times`).  Both profiles are then summed over the ONNX nodes each of our kernel calls covers
(:func:`side_by_side`): a row compares the same piece of the model.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from graphopt.onnx_io import node_names
from pipeline.pricing.profile import PREPACKED, CallTime, time_calls
from pipeline.passes.provenance import CallSite

BUILTIN = "vm.builtin."  # the VM's own calls (allocation, shape checks): not kernels


@dataclass
class KernelRow:
    """One kernel of the shipped build: all its calls in one model run."""

    kernel: str
    calls: int
    ms: float  # per model run, all calls
    share: float  # of the kernels' total
    gflops: float | None  # achieved GFLOP/s (None: no FLOP count, e.g. a copy)
    roofline_pct: float | None  # of this CPU's roofline for its FLOPs and bytes
    nodes: list[str]  # the ONNX nodes of its first call
    sites: list[list[str]] = field(default_factory=list)  # the ONNX nodes of each call
    site_ms: list[float] = field(default_factory=list)  # the time of each call


@dataclass
class Comparison:
    """One piece of the model: the ONNX nodes one of our kernel calls computes, timed by both engines."""

    nodes: list[str]
    ours_ms: float
    ort_ms: float
    kernel: str | None  # ours; None: nodes onnxruntime runs that no kernel of ours computes


@dataclass
class LayerProfile:
    kernels: list[KernelRow]
    kernels_ms: float  # the kernels' sum (instrumented)
    latency_ms: float  # the model timed whole, without the instrument
    peak_gflops: float
    bandwidth_gbs: float
    traced: float  # the share of kernel time whose calls name their ONNX nodes
    ort: list[Comparison] | None = None
    ort_ms: float | None = None  # onnxruntime's node times summed
    ort_skipped: str | None = None  # why there is no onnxruntime column

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def align(calls: Sequence[CallTime], sites: Sequence[CallSite]) -> list[tuple[CallTime, tuple[str, ...]]]:
    """Each kernel call with the ONNX nodes of its call site.  The build makes the calls in the order of
    ``sites``; should the counts differ (a folder from an older build), calls are matched by kernel name in
    order, and a call with no match names no nodes."""
    kernels = [c for c in calls if not c.name.startswith(BUILTIN)]
    if len(kernels) == len(sites):
        return [(c, s.nodes) for c, s in zip(kernels, sites)]
    out, k = [], 0
    for c in kernels:
        base = c.name.removesuffix(PREPACKED)
        j = next((j for j in range(k, len(sites)) if sites[j].kernel == base), None)
        out.append((c, sites[j].nodes if j is not None else ()))
        k = j + 1 if j is not None else k
    return out


def _task_costs(report: Mapping[str, Any], sizes: Mapping[str, int] | None = None) -> dict[str, tuple[float, float]]:
    """Kernel name -> (FLOPs, bytes read and written) per call, from report.json's tasks; in a build serving a
    range, at the served ``sizes`` of the profiled call (a task's cost is at the representative size: its
    ``scaling`` exponents carry it to the call's)."""
    from pipeline.pricing.sanity import kernel_bytes

    at = ((report.get("served") or {}).get("representative")) or {}
    out = {}
    for t in report.get("tasks") or []:
        flops = float(t.get("flops") or 0.0)
        nbytes = float(kernel_bytes(t.get("shapes") or [], t.get("dtype") or "float32"))
        for dim, (ef, eb) in (t.get("scaling") or {}).items():
            if sizes and dim in sizes and at.get(dim):
                ratio = sizes[dim] / at[dim]
                flops, nbytes = flops * ratio ** ef, nbytes * ratio ** eb
        for name in t.get("names") or [t["name"]]:
            out[name] = (flops, nbytes)
    return out


def kernel_rows(aligned, report: Mapping[str, Any], peak: float, bandwidth: float,
                sizes: Mapping[str, int] | None = None) -> list[KernelRow]:
    """The calls summed per kernel, slowest first, with their rates against the roofline (``sizes``: the
    served dimensions' sizes in the profiled call)."""
    from pipeline.pricing.sanity import roofline

    costs = _task_costs(report, sizes)
    rows: dict[str, KernelRow] = {}
    for call, nodes in aligned:
        row = rows.setdefault(call.name, KernelRow(call.name, 0, 0.0, 0.0, None, None, list(nodes)))
        row.calls += 1
        row.ms += call.ms
        row.sites.append(list(nodes))
        row.site_ms.append(call.ms)
    total = sum(r.ms for r in rows.values()) or 1.0
    for row in rows.values():
        row.share = row.ms / total
        flops, nbytes = costs.get(row.kernel.removesuffix(PREPACKED), (0.0, 0.0))
        if flops > 0 and row.ms > 0:
            row.gflops = flops * row.calls / (row.ms * 1e6)
            row.roofline_pct = 100.0 * row.gflops / roofline(flops, nbytes, peak, bandwidth)
    return sorted(rows.values(), key=lambda r: -r.ms)


def profile_shipped(model, feeds: Mapping[str, np.ndarray], runs: int = 10) -> LayerProfile:
    """The per-kernel profile of a loaded :class:`pipeline.artifact.Model` on ``feeds``."""
    from graphopt.timing import latency
    from pipeline.pricing.sanity import cpu_facts
    import tvm

    vm, args, dev = model.instrumentable(feeds)
    calls = time_calls(vm, args, dev, runs)
    whole = latency(model.runner(feeds), runs)
    sites = [CallSite.from_json(s) for s in model.report.get("call_sites") or []]
    aligned = align(calls, sites)
    target = model.report["deploy"].get("target") or model.report.get("target_detail")
    peak, bandwidth = cpu_facts(tvm.target.Target(json.loads(target)) if target and target.startswith("{")
                                else tvm.target.Target(target or "llvm"))
    rows = kernel_rows(aligned, model.report, peak, bandwidth, _served_sizes(model, feeds))
    total = sum(r.ms for r in rows)
    traced = sum(c.ms for c, n in aligned if n) / (total or 1.0)
    return LayerProfile(rows, total, whole.p50_ms, peak, bandwidth, traced)


def _served_sizes(model, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The size of each served dimension in ``feeds`` (a build serving a range: :mod:`pipeline.symbolic`)."""
    out = {}
    for spec in model.inputs:
        value = feeds.get(spec.name) if isinstance(feeds, Mapping) else None
        for axis, (name, _, _) in (spec.ranges or {}).items():
            if value is not None and np.ndim(value) > int(axis):
                out[name] = int(np.shape(value)[int(axis)])
    return out


def _anchors(optimized: onnx.GraphProto, original: onnx.GraphProto) -> dict[str, str | None]:
    """onnxruntime's optimized node name -> the node of ``original`` it is credited to: by its name where
    onnxruntime derived it from one (the node's own, ``NODE_token_N``, ``NODE/MatMulAddFusion``, or
    ``TENSOR_nchwc`` for a blocked conv writing that tensor), else by the output it writes, else (its outputs all its own: a
    reorder, a reshape around a Gemm) by the first later node credited so."""
    produced: dict[str, str] = {}
    names = set()
    for n, name in zip(original.node, node_names(original)):
        if name:
            names.add(name)
            produced.update((t, name) for t in n.output)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in optimized.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)

    def by_name(name: str) -> str | None:
        if name in names:
            return name
        untokened = re.sub(r"_token_\d+$", "", name)  # a node onnxruntime made from one (a fused QLinearConv)
        if untokened in names:
            return untokened
        if name.endswith("_nchwc") and name.removesuffix("_nchwc") in produced:
            return produced[name.removesuffix("_nchwc")]
        prefixes = [n for n in names if name.startswith(n + "/")]
        return max(prefixes, key=len) if prefixes else None

    def anchor(n: onnx.NodeProto, seen: set[str]) -> str | None:
        own = by_name(n.name) or next((produced[t] for t in n.output if t in produced), None)
        if own is not None or n.name in seen:
            return own
        seen.add(n.name)
        for t in n.output:
            for c in consumers.get(t, []):
                found = anchor(c, seen)
                if found is not None:
                    return found
        return None

    return {n.name: anchor(n, set()) for n in optimized.node}


def ort_node_times(path: str | os.PathLike, feeds: Mapping[str, np.ndarray], threads: int,
                   runs: int = 10) -> dict[str, float]:
    """onnxruntime's time per ONNX node of ``path`` (ms per run; module docstring), at its best (all graph
    optimizations, ``threads`` intra-op threads), the first run left out."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "ort")
        so.intra_op_num_threads = threads
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(Path(tmp) / "ort_optimized.onnx")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        for _ in range(runs + 1):
            sess.run(None, dict(feeds))
        events = json.loads(Path(sess.end_profiling()).read_text())
        optimized = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
    anchors = _anchors(optimized, onnx.load(str(path), load_external_data=False).graph)
    per_node: dict[str, list[float]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "Node" and name.endswith("_kernel_time"):
            per_node.setdefault(name.removesuffix("_kernel_time"), []).append(e["dur"] / 1e3)
    out: dict[str, float] = {}
    for ort_node, durations in per_node.items():
        timed = durations[1:] if len(durations) > 1 else durations  # the first run warms up
        node = anchors.get(ort_node) or f"(onnxruntime) {ort_node}"
        out[node] = out.get(node, 0.0) + sum(timed) / len(timed)
    return out


def side_by_side(rows: Sequence[KernelRow], ort: Mapping[str, float]) -> list[Comparison]:
    """Both profiles summed over the ONNX nodes of each of our kernel calls; onnxruntime's nodes no call of
    ours covers become rows of their own.  Slowest first (the slower engine's time)."""
    out: list[Comparison] = []
    taken: set[str] = set()
    for row in rows:
        for nodes, ms in zip(row.sites, row.site_ms):
            fresh = [n for n in nodes if n not in taken]
            taken.update(fresh)
            out.append(Comparison(list(nodes), ms, sum(ort.get(n, 0.0) for n in fresh), row.kernel))
    for node, ms in ort.items():
        if node not in taken:
            out.append(Comparison([node], 0.0, ms, None))
    return sorted(out, key=lambda c: -max(c.ours_ms, c.ort_ms))


def with_ort(profile: LayerProfile, path: str | os.PathLike, feeds: Mapping[str, np.ndarray],
             threads: int, runs: int = 10) -> LayerProfile:
    """``profile`` with onnxruntime's column (or why there is none)."""
    try:
        ort = ort_node_times(path, feeds, threads, runs)
    except Exception as exc:  # noqa: BLE001 - the comparison is optional; the reason is shown
        profile.ort_skipped = f"onnxruntime could not profile {path}: {str(exc).splitlines()[0][:160]}"
        return profile
    profile.ort = side_by_side(profile.kernels, ort)
    profile.ort_ms = sum(ort.values())
    return profile


def _short(nodes: Sequence[str], width: int = 60) -> str:
    if not nodes:
        return "(not traced)"
    text = nodes[0] if len(nodes) == 1 else f"{nodes[0]} +{len(nodes) - 1}"
    return text if len(text) <= width else "..." + text[-(width - 3):]


def format_profile(profile: LayerProfile, top: int = 20) -> str:
    """The table run-model --profile prints."""
    lines = [f"kernels {profile.kernels_ms:.3f} ms in all (timed one by one) vs {profile.latency_ms:.3f} ms the "
             f"model run whole; roofline: {profile.peak_gflops:.0f} GFLOP/s peak, {profile.bandwidth_gbs:.0f} GB/s",
             f"{'ms':>8} {'share':>6} {'calls':>5} {'GFLOP/s':>8} {'%roof':>6}  ONNX nodes [kernel]"]
    for r in profile.kernels[:top]:
        rate = f"{r.gflops:8.1f}" if r.gflops is not None else f"{'-':>8}"
        roof = f"{r.roofline_pct:6.0f}" if r.roofline_pct is not None else f"{'-':>6}"
        lines.append(f"{r.ms:8.3f} {r.share:6.1%} {r.calls:>5} {rate} {roof}  {_short(r.nodes)} [{r.kernel}]")
    if len(profile.kernels) > top:
        rest = profile.kernels[top:]
        lines.append(f"{sum(r.ms for r in rest):8.3f} {sum(r.share for r in rest):6.1%} "
                     f"{sum(r.calls for r in rest):>5}  ... {len(rest)} more kernels (all in --json)")
    if profile.ort is not None:
        lines += ["", f"beside onnxruntime on the same ONNX nodes (its nodes sum to {profile.ort_ms:.3f} ms):",
                  f"{'ours ms':>8} {'ORT ms':>8} {'ratio':>6}  ONNX nodes"]
        for c in profile.ort[:top]:
            ratio = f"{c.ours_ms / c.ort_ms:5.2f}x" if c.ort_ms > 0 and c.ours_ms > 0 else f"{'-':>6}"
            lines.append(f"{c.ours_ms:8.3f} {c.ort_ms:8.3f} {ratio}  {_short(c.nodes)}")
        lines.append("ratio: our time over onnxruntime's (below 1: ours is faster)")
    elif profile.ort_skipped:
        lines.append(profile.ort_skipped)
    return "\n".join(lines)


def plot_profile(profile: LayerProfile, path: str | os.PathLike, top: int = 20) -> None:
    """Where the time goes: the ``top`` pieces of the model, ours beside onnxruntime's, as horizontal bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from graphopt.fileio import write_bytes_atomic

    pieces = profile.ort if profile.ort is not None else [
        Comparison(r.nodes, r.ms, 0.0, r.kernel) for r in profile.kernels]
    pieces = pieces[:top][::-1]
    labels = [_short(c.nodes, 48) for c in pieces]
    y = np.arange(len(pieces))
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(pieces) + 1.6))
    ax.barh(y + 0.2, [c.ours_ms for c in pieces], height=0.4, label="ours (optimize-model)", color="#1f77b4")
    if profile.ort is not None:
        ax.barh(y - 0.2, [c.ort_ms for c in pieces], height=0.4, label="onnxruntime", color="#ff7f0e")
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel("ms per inference")
    title = (f"where the time goes: the {len(pieces)} slowest pieces of the model\nours {profile.latency_ms:.2f} ms "
             f"per inference (its kernels timed one by one: {profile.kernels_ms:.2f} ms)")
    if profile.ort_ms is not None:
        title += f"; onnxruntime's nodes {profile.ort_ms:.2f} ms"
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.07 - 1.2 / (len(pieces) + 5)), ncol=2, fontsize=8)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())
