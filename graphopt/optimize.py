"""The graph-optimization stage: import -> substitution search -> constant folding -> export -> check.

Convolution biases are split off before the search (``Conv(x,w,b)`` -> ``Conv(x,w)`` + bias add, the form the
rules are written in) and fused back afterwards, so the exported model keeps ONNX's usual spelling.

Only the verified rule library (:func:`graphopt.rules.load_rules`) is used by default; every result is
checked by running the input and the output model in onnxruntime on the same seeded random inputs, so a
wrong rewrite shows up as ``outputs_equal: false`` rather than as a silently different model.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import onnx

from graphopt.cost import CostModel, make_cost_model
from graphopt.errors import UserError
from graphopt.feeds import max_abs_err, random_inputs, run_ort
from graphopt.onnx_io import InputShapes, export_onnx, import_onnx, load_model
from graphopt.rewrite import eliminate_common_subexpressions, fold_constants, fuse_conv_bias, split_conv_bias
from graphopt.rules import LIBRARY_PATH, Rule, load_rules
from graphopt.search import SearchResult, search

TOLERANCE = 1e-4
TARGETS = ("llvm", "cuda", "rocm")


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
             tolerance: float = TOLERANCE, backend: str = "tvm", threads: int = 1) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Optimize ``model``; returns the optimized ONNX model and the stage report (see module docstring)."""
    start = time.perf_counter()
    if target.split(":")[0] not in TARGETS:
        raise UserError(f"unknown --target {target!r}: use one of {', '.join(TARGETS)}")
    if alpha < 1.0:
        raise UserError(f"--alpha {alpha} is below 1.0: use 1.0 (greedy) or more (1.05 as in TASO)")
    if budget < 1:
        raise UserError(f"--budget {budget} must be at least 1")
    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    graph = import_onnx(proto, input_shapes)
    nodes_before = len(graph.nodes)
    split_conv_bias(graph)
    cost_model = make_cost_model(cost, target, backend, threads) if isinstance(cost, str) else cost
    rules = library() if rules is None else rules
    result: SearchResult = search(graph, rules, cost_model, alpha, budget, time_limit, progress)
    best = result.graph.copy()
    folded = fold_constants(best)
    deduplicated = eliminate_common_subexpressions(best)
    fuse_conv_bias(best)
    optimized = export_onnx(best)
    cost_before = cost_model.graph_cost(graph)
    canonical = best.copy()
    split_conv_bias(canonical)  # priced in the form the search saw, like cost_before
    cost_after = cost_model.graph_cost(canonical)
    feeds = random_inputs(graph, seed)
    err = max_abs_err(run_ort(proto, feeds), run_ort(optimized, feeds))
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        onnx.save(optimized, str(output))
    report = {
        "cost_before": cost_before,
        "cost_after": cost_after,
        "applied": result.applied,
        "graphs_explored": result.graphs_explored,
        "seconds": time.perf_counter() - start,
        "search_seconds": result.seconds,
        "stopped_by": result.stopped_by,
        "max_abs_err": err,
        "outputs_equal": err <= tolerance,
        "nodes_before": nodes_before,
        "nodes_after": len(best.nodes),
        "folded_nodes": folded,
        "deduplicated_nodes": deduplicated,
        "cost_model": cost_model.name,
        "root_candidates": result.root_candidates,
        "rules": len(rules),
    }
    return optimized, report
