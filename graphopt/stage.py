"""The graph stage: substitution search -> finish -> whole-model check -> merge-everything alternative.

One function, :func:`optimize_graph`, is the stage; the ``graphopt optimize`` command, the pipeline
(``optimize-model``, ``bench-model``) and ``bench/graphopt_models.py`` all run it, so a benchmark measures
what the product ships.  :func:`optimize_onnx` is its ONNX-in, ONNX-out form with the output check.

Convolution biases are split off before the search (``Conv(x,w,b)`` -> ``Conv(x,w)`` + bias add, the form the
rules are written in) and fused back afterwards, so the exported model keeps ONNX's usual spelling.

Only the verified rule library (:func:`graphopt.rules.verified_library`) is used by default; the ONNX form
checks every result by running the input and the output model in onnxruntime on the same seeded random
inputs, so a wrong rewrite shows up as ``outputs_equal: false`` rather than as a silently different model.

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

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from graphopt.cost.base import CostModel
from graphopt.cost.kernel_count import KernelCountCost
from graphopt.errors import UserError
from graphopt.compare import compare_runs
from graphopt.feeds import feed_sets, run_ort_sets
from graphopt.ir import Graph
from graphopt.onnx_io import InputShapes, export_onnx, import_onnx, load_model
from graphopt.cleanup import eliminate_common_subexpressions, fold_constants, fuse_conv_bias, split_conv_bias
from graphopt.rules import Rule, merge_rules, verified_library
from graphopt.search import SearchResult, search

E2E_MARGIN = 0.02  # the candidate must be this much faster end to end, beyond timing noise, to be kept
E2E_RUNS = 20


@dataclass
class GraphStageOptions:
    """How the stage searches and checks (the cost model, a component, is passed beside it)."""

    alpha: float = 1.05  # keep graphs up to alpha x the best cost in the queue (1.0 = greedy; TASO: 1.05)
    budget: int = 1000  # most graphs to dequeue
    time_limit: float = 60.0  # seconds of search
    rules: list[Rule] | None = None  # None: the shipped verified library
    progress: bool = False
    e2e_check: bool = True  # time the whole input and candidate before keeping a rewrite
    e2e_margin: float = E2E_MARGIN
    e2e_runs: int = E2E_RUNS

    def validate(self) -> None:
        """One-line errors for values a user can pass on the command line."""
        if not self.alpha >= 1.0 or math.isinf(self.alpha):  # NaN fails every comparison: "not >=" catches it
            raise UserError(f"--alpha {self.alpha} must be a finite number of at least 1.0: use 1.0 (greedy) or "
                            "more (1.05 as in TASO)")
        if self.budget < 1:
            raise UserError(f"--budget {self.budget} must be at least 1")
        if not self.time_limit > 0:
            raise UserError(f"--time-limit {self.time_limit} must be a positive number of seconds")
        if self.e2e_runs < 1:
            raise UserError(f"--e2e-runs {self.e2e_runs} must be at least 1")
        check_margin(self.e2e_margin)


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


@dataclass
class GraphStageResult:
    """What the stage hands on, and the record of how it decided.

    ``graph`` is the search's graph (finished: folded, deduplicated, conv biases fused back), the
    merge-everything graph, or - when neither is measurably faster end to end - a copy of the input, with
    ``applied`` empty and ``cost_after == cost_before``; ``search`` still says what the search had found.
    """

    graph: Graph
    check: E2ECheck
    search: SearchResult
    cost_before: float  # priced as the search prices (conv biases split off)
    cost_after: float  # of ``graph``, priced the same way
    applied: dict[str, int]  # substitutions in ``graph``
    candidate_cost_after: float  # the search's best graph, finished, priced the same way
    folded_nodes: int
    deduplicated_nodes: int
    nodes_before: int
    rules: int
    cost_model: str
    merge_all: dict[str, Any] = field(default_factory=dict)  # what merged_alternative tried and measured

    @property
    def kept(self) -> str:
        return self.check.kept


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


def merged_alternative(original: Graph, searched: Graph, rules: list[Rule], cost_model: CostModel,
                       options: GraphStageOptions) -> tuple[Graph | None, dict[str, Any]]:
    """The graph with every parallel group the merge rules reach merged (searched under
    :class:`~graphopt.cost.kernel_count.KernelCountCost` from ``searched``, the search's input), if it runs
    faster than ``original`` end to end by the margin; else ``None``.  The dict says what was tried and
    measured."""
    res = search(searched, merge_rules(rules), KernelCountCost(), options.alpha, options.budget, options.time_limit)
    if not any(res.applied.values()):
        return None, {}
    merged = finish(res.graph)[0]
    check = check_end_to_end(original, merged, cost_model, res.applied, True, options.e2e_margin, options.e2e_runs)
    info = {"applied": res.applied, "e2e_check": check.status, "e2e_ms_before": check.ms_before,
            "e2e_ms_after": check.ms_after, "e2e_backend": check.backend}
    return (merged if check.status == "measured" and check.kept == "optimized" else None), info


def optimize_graph(graph: Graph, cost: CostModel, options: GraphStageOptions | None = None) -> GraphStageResult:
    """The graph stage (see module docstring): ``graph`` is not modified."""
    options = options or GraphStageOptions()
    options.validate()
    rules = verified_library() if options.rules is None else options.rules
    original = graph.copy()
    searched = graph.copy()
    split_conv_bias(searched)
    result = search(searched, rules, cost, options.alpha, options.budget, options.time_limit, options.progress)
    best, folded, deduplicated = finish(result.graph)
    cost_before = cost.graph_cost(searched)
    candidate_cost = searched_cost(best, cost)
    check = check_end_to_end(original, best, cost, result.applied, options.e2e_check, options.e2e_margin,
                             options.e2e_runs)
    merged, merge_info = None, {}
    if options.e2e_check and (check.kept == "original" or not any(result.applied.values())):
        merged, merge_info = merged_alternative(original, searched, rules, cost, options)
    if merged is not None:
        check = E2ECheck("merged", "measured", options.e2e_margin, merge_info["e2e_ms_before"],
                         merge_info["e2e_ms_after"], merge_info["e2e_backend"])
        out, cost_after, applied = merged, searched_cost(merged, cost), merge_info["applied"]
    elif check.kept == "optimized":
        out, cost_after, applied = best, candidate_cost, result.applied
    else:
        out, cost_after, applied = original, cost_before, {}
    return GraphStageResult(out, check, result, cost_before, cost_after, applied, candidate_cost, folded,
                            deduplicated, len(graph.nodes), len(rules), cost.name, merge_info)


def optimize_onnx(model: onnx.ModelProto | str | os.PathLike, cost: CostModel,
                  options: GraphStageOptions | None = None, input_shapes: InputShapes | None = None,
                  seed: int = 0, samples: dict[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """:func:`optimize_graph` on an ONNX model: the optimized model and the stage report, whose
    ``outputs_equal`` compares both models in onnxruntime on the check inputs (the samples, or several seeded
    sets; :mod:`graphopt.compare`).  When the input is handed back, that is ``model`` itself (``applied``
    empty; ``candidate_applied`` and ``candidate_cost_after`` still say what the search had found)."""
    start = time.perf_counter()
    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    graph = import_onnx(proto, input_shapes)
    res = optimize_graph(graph, cost, options)
    optimized = proto if res.kept == "original" else export_onnx(res.graph)
    sets = feed_sets(graph, seed, samples)
    check = compare_runs(list(zip(run_ort_sets(proto, sets), run_ort_sets(optimized, sets))))
    report = {
        "cost_before": res.cost_before,
        "cost_after": res.cost_after,
        "applied": res.applied,
        **res.check.report(),
        "candidate_applied": res.search.applied,
        "candidate_cost_after": res.candidate_cost_after,
        "graphs_explored": res.search.graphs_explored,
        "seconds": time.perf_counter() - start,
        "search_seconds": res.search.seconds,
        "stopped_by": res.search.stopped_by,
        **check.to_dict(),
        "outputs_equal": check.ok,
        "check_failure": check.reason(),
        "nodes_before": res.nodes_before,
        "nodes_after": len(res.graph.nodes),
        "folded_nodes": res.folded_nodes,
        "deduplicated_nodes": res.deduplicated_nodes,
        "cost_model": res.cost_model,
        "root_candidates": res.search.root_candidates,
        "merge_all": res.merge_all,
        "rules": res.rules,
    }
    return optimized, report
