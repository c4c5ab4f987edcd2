"""The graph-optimization stage: import -> substitution search -> constant folding -> export -> check.

Convolution biases are split off before the search (``Conv(x,w,b)`` -> ``Conv(x,w)`` + bias add, the form the
rules are written in) and fused back afterwards, so the exported model keeps ONNX's usual spelling.

Only the verified rule library (:func:`graphopt.rules.load_rules`) is used by default; every result is
checked by running the input and the output model in onnxruntime on the same seeded random inputs, so a
wrong rewrite shows up as ``outputs_equal: false`` rather than as a silently different model.

The search adds up per-operator timings, which cannot see how the backend fuses and schedules the merged
kernels (an Inception block whose 1x1 convs were merged is cheaper by that sum but slower end to end in both
onnxruntime and TVM).  So when a substitution was applied and the cost model measures (``time_models``),
the whole input and the whole candidate are timed with the same engine, interleaved, and the candidate is
kept only if it is at least ``e2e_margin`` faster; otherwise the input graph is handed back unchanged
(:func:`check_end_to_end`).

The same blindness cuts the other way for merges: when the search keeps nothing, the graph with every
parallel matmul/conv group merged (:func:`merged_alternative`) is timed against the input too, and kept if it
is faster by the same margin (NASRNN, all 70 merges: priced +64% per operator, 1.04x faster end to end in TVM).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from graphopt.cost.base import CostModel
from graphopt.cost.factory import make_cost_model
from graphopt.cost.kernel_count import KernelCountCost
from graphopt.ir import Graph
from graphopt.errors import UserError
from graphopt.fileio import write_bytes_atomic
from graphopt.feeds import max_abs_err, random_inputs, run_ort
from graphopt.onnx_io import InputShapes, export_onnx, import_onnx, load_model
from graphopt.rewrite import eliminate_common_subexpressions, fold_constants, fuse_conv_bias, split_conv_bias
from graphopt.rules import LIBRARY_PATH, Rule, load_rules
from graphopt.search import SearchResult, search

TOLERANCE = 1e-4
TARGETS = ("llvm", "cuda", "rocm")
E2E_MARGIN = 0.02  # the candidate must be this much faster end to end, beyond timing noise, to be kept
E2E_RUNS = 20


@dataclass
class E2ECheck:
    """The end-to-end verdict on a search result: which graph is handed back, and why."""

    kept: str  # "optimized", "original", or "merged" (merged_alternative)
    status: str  # "measured", "disabled", or "skipped: <reason>"
    margin: float
    ms_before: float | None = None
    ms_after: float | None = None
    backend: str | None = None

    def report(self) -> dict[str, Any]:
        return {"kept": self.kept, "e2e_check": self.status, "e2e_ms_before": self.ms_before,
                "e2e_ms_after": self.ms_after, "e2e_backend": self.backend, "e2e_margin": self.margin}


def check_margin(margin: float) -> None:
    if not 0.0 <= margin < 1.0:
        raise UserError(f"--e2e-margin {margin} must be a fraction in [0, 1), e.g. 0.02 for 2%")


def check_end_to_end(original: Graph, candidate: Graph, cost_model: CostModel, applied: dict[str, int],
                     enabled: bool = True, margin: float = E2E_MARGIN, runs: int = E2E_RUNS) -> E2ECheck:
    """Time both whole graphs with the cost model's engine and keep ``candidate`` only if it is faster by
    ``margin`` (a fraction of the original's time).  Nothing is timed when the check is disabled, when no
    substitution was applied (folding alone never slows a model down), or when the cost model measures
    nothing (analytic): then the candidate is kept, and ``status`` says the check was not made."""
    check_margin(margin)
    if not enabled:
        return E2ECheck("optimized", "disabled", margin)
    if not any(applied.values()):
        return E2ECheck("optimized", "skipped: no substitution applied", margin)
    times = cost_model.time_models([original, candidate], runs)
    if times is None:
        return E2ECheck("optimized", f"skipped: the {cost_model.name} cost model measures nothing", margin)
    before, after = times.seconds
    kept = "optimized" if after <= before * (1.0 - margin) else "original"
    return E2ECheck(kept, "measured", margin, before * 1e3, after * 1e3, times.backend)


def finish(graph: Graph) -> tuple[Graph, int, int]:
    """A copy of a search result made ready to export: weight-only subgraphs folded, duplicate nodes merged,
    conv biases fused back; with the numbers of folded and deduplicated nodes."""
    out = graph.copy()
    folded = fold_constants(out)
    deduplicated = eliminate_common_subexpressions(out)
    fuse_conv_bias(out)
    return out, folded, deduplicated


def searched_cost(graph: Graph, cost_model: CostModel) -> float:
    """``graph``'s cost in the form the search priced it (conv biases split off), so it compares with the
    search's ``cost_before`` whatever form the graph is in now."""
    canonical = graph.copy()
    split_conv_bias(canonical)
    return cost_model.graph_cost(canonical)


def merge_rules(rules: list[Rule]) -> list[Rule]:
    """The merge substitutions among ``rules``: ops side by side in the source (or on the outputs of one
    split), one op on concatenated weights followed by a split in the target (matmul+matmul,
    conv2d+conv2d(+relu), and split+bias_add+bias_add, which moves merged biases before the split).
    (Kept here, not in graphopt.rules: that module's source is part of the library's cache key.)"""
    out = []
    for r in rules:
        ops = r.name.split(":", 1)[-1]  # generated rules are named "r0742:matmul+matmul->concat+matmul+split"
        if "->" not in ops:
            continue
        src, dst = ops.split("->", 1)
        if "concat" not in src and "concat" in dst and "split" in dst:
            out.append(r)
    return out


def merged_alternative(original: Graph, searched: Graph, rules: list[Rule], cost_model: CostModel, margin: float,
                       runs: int, alpha: float, budget: int, time_limit: float) -> tuple[Graph | None, dict[str, Any]]:
    """The graph with every parallel group the merge rules reach merged (searched under
    :class:`~graphopt.cost.kernel_count.KernelCountCost` from ``searched``, the search's input), if it runs faster than
    ``original`` end to end by ``margin``; else ``None``.  The dict says what was tried and measured."""
    res = search(searched, merge_rules(rules), KernelCountCost(), alpha, budget, time_limit)
    if not any(res.applied.values()):
        return None, {}
    merged = finish(res.graph)[0]
    check = check_end_to_end(original, merged, cost_model, res.applied, True, margin, runs)
    info = {"applied": res.applied, "e2e_check": check.status, "e2e_ms_before": check.ms_before,
            "e2e_ms_after": check.ms_after, "e2e_backend": check.backend}
    return (merged if check.status == "measured" and check.kept == "optimized" else None), info


def library() -> list[Rule]:
    """The shipped verified library, or a one-line error saying how to build it."""
    if not LIBRARY_PATH.exists():
        raise UserError(f"rule library {LIBRARY_PATH} is missing: run `graphopt rules generate` to build it")
    rules = load_rules()
    if not rules:
        raise UserError(f"rule library {LIBRARY_PATH} holds no verified rule: rebuild it with `graphopt rules generate`")
    return rules


def optimize(model: onnx.ModelProto | str | os.PathLike, output: str | os.PathLike | None = None,
             target: str = "llvm", alpha: float = 1.05, budget: int = 1000, time_limit: float = 60.0,
             cost: str | CostModel = "measured", input_shapes: InputShapes | None = None,
             rules: list[Rule] | None = None, seed: int = 0, progress: bool = False,
             tolerance: float = TOLERANCE, backend: str = "tvm", threads: int = 1, e2e_check: bool = True,
             e2e_margin: float = E2E_MARGIN, e2e_runs: int = E2E_RUNS) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Optimize ``model``; returns the optimized ONNX model and the stage report (see module docstring).

    When the end-to-end check rejects the search's graph, the input model itself is returned (and written),
    ``applied`` is empty and ``cost_after`` equals ``cost_before``; ``candidate_applied`` and
    ``candidate_cost_after`` still say what the search had found."""
    start = time.perf_counter()
    if target.split(":")[0] not in TARGETS:
        raise UserError(f"unknown --target {target!r}: use one of {', '.join(TARGETS)}")
    if alpha < 1.0:
        raise UserError(f"--alpha {alpha} is below 1.0: use 1.0 (greedy) or more (1.05 as in TASO)")
    if budget < 1:
        raise UserError(f"--budget {budget} must be at least 1")
    check_margin(e2e_margin)
    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    graph = import_onnx(proto, input_shapes)
    nodes_before = len(graph.nodes)
    original = graph.copy()
    split_conv_bias(graph)
    cost_model = make_cost_model(cost, target, backend, threads) if isinstance(cost, str) else cost
    rules = library() if rules is None else rules
    result: SearchResult = search(graph, rules, cost_model, alpha, budget, time_limit, progress)
    best, folded, deduplicated = finish(result.graph)
    cost_before = cost_model.graph_cost(graph)
    candidate_cost = searched_cost(best, cost_model)
    check = check_end_to_end(original, best, cost_model, result.applied, e2e_check, e2e_margin, e2e_runs)
    merged, merge_info = None, {}
    if e2e_check and (check.kept == "original" or not any(result.applied.values())):
        merged, merge_info = merged_alternative(original, graph, rules, cost_model, e2e_margin, e2e_runs, alpha,
                                                budget, time_limit)
    if merged is not None:
        check = E2ECheck("merged", "measured", e2e_margin, merge_info["e2e_ms_before"], merge_info["e2e_ms_after"],
                         merge_info["e2e_backend"])
        optimized, cost_after, applied, nodes_after = (export_onnx(merged), searched_cost(merged, cost_model),
                                                       merge_info["applied"], len(merged.nodes))
    elif check.kept == "optimized":
        optimized, cost_after, applied, nodes_after = export_onnx(best), candidate_cost, result.applied, len(best.nodes)
    else:
        optimized, cost_after, applied, nodes_after = proto, cost_before, {}, nodes_before
    feeds = random_inputs(graph, seed)
    err = max_abs_err(run_ort(proto, feeds), run_ort(optimized, feeds))
    if output is not None:
        write_bytes_atomic(output, optimized.SerializeToString())
    report = {
        "cost_before": cost_before,
        "cost_after": cost_after,
        "applied": applied,
        **check.report(),
        "candidate_applied": result.applied,
        "candidate_cost_after": candidate_cost,
        "graphs_explored": result.graphs_explored,
        "seconds": time.perf_counter() - start,
        "search_seconds": result.seconds,
        "stopped_by": result.stopped_by,
        "max_abs_err": err,
        "outputs_equal": err <= tolerance,
        "nodes_before": nodes_before,
        "nodes_after": nodes_after,
        "folded_nodes": folded,
        "deduplicated_nodes": deduplicated,
        "cost_model": cost_model.name,
        "root_candidates": result.root_candidates,
        "merge_all": merge_info,
        "rules": len(rules),
    }
    return optimized, report
