"""The stage chain, composed in one place: ONNX -> legalize -> graph stage -> Relax import -> layout ->
partition -> compile (tuning, between partition and compile, is :mod:`pipeline.tuning`).

optimize-model (:mod:`pipeline.optimize_model`), bench-model (:func:`pipeline.benchmark.compile_engines`),
``tune-kernels MODEL`` (:mod:`pipeline.model_mode`) and the graph stage's TVM runner
(:mod:`pipeline.pricing.graph_runner`, through :func:`compile_graph` and :func:`compile_model`) all build through these functions:

* :func:`graph_stage`: the model legalized for TVM (:func:`pipeline.frontend.legalize_for_tvm`), then
  graphopt's search (:func:`graphopt.stage.optimize_graph`) with the measured cost timed by TVM for the
  context's target, or the legalized graph re-exported (``--skip-graph``);
* :func:`lower`: Relax import (:func:`pipeline.relax_import.import_model`), the layout stage
  (:func:`pipeline.layout.search.partition_model`; the graph runner's operators: none, its whole models and
  kernel prices: the heuristic blocks) and the partition;
* :func:`build`: the partition compiled (:func:`pipeline.compile.compile_partition`) with tuned configs or
  default schedules; :func:`build_untuned` the default build held to the sanity floor (:mod:`pipeline.pricing.sanity`).

Each takes the build context (:class:`pipeline.context.BuildContext`) or the target spec it holds.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import onnx
import tvm

from graphopt.cost.factory import make_cost_model
from graphopt.ir import Graph
from graphopt.onnx_io import InputShapes, export_onnx, import_onnx
from graphopt.stage import GraphStageOptions, optimize_graph
from kerneltune.machine_gate import serial
from kerneltune.native_log import quiet_native_stderr
from kerneltune.targets.registry import TargetSpec
from pipeline.compile import CompiledModel, compile_partition
from pipeline.context import BuildContext
from pipeline.frontend import legalize_for_tvm
from pipeline.pricing.kernel_price import KernelPricer
from pipeline.layout.search import partition_model
from pipeline.partition import Partition, partition
from pipeline.relax_import import ImportedModel, import_model
from pipeline.symbolic import Served
from pipeline.passes.int8 import lowering_for
from pipeline.passes.value_guard import add_value_guards

log = logging.getLogger(__name__)


@dataclass
class StageLog:
    """Per-stage wall time and facts, in order, for report.json."""

    stages: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, name: str, seconds: float, **facts: Any) -> None:
        self.stages[name] = {"time_s": round(seconds, 3), **facts}
        brief = ", ".join(f"{k}={v}" for k, v in facts.items() if not isinstance(v, (list, dict)))
        log.info("%s stage: %.1f s (%s)", name, seconds, brief)  # shown with -v


@dataclass
class StagedGraph:
    """The graph stage's result: what the compiler sees (fixed sizes), and the graph its shape constants were
    folded from (for :func:`graphopt.dynamic.dynamic_model`)."""

    model: onnx.ModelProto
    graph: Graph
    unfolded: Graph


def graph_stage(ctx: BuildContext, model: onnx.ModelProto, input_shapes: InputShapes | None,
                log: StageLog) -> StagedGraph:
    """The model the compiler sees: graphopt's optimized graph (measured cost timed with TVM on the context's
    target where this machine can run it, priced analytically otherwise; the stage within
    ``ctx.graph_time_limit`` seconds), or with ``ctx.skip_graph`` the imported graph re-exported."""
    t0 = time.perf_counter()
    legal = legalize_for_tvm(import_onnx(model, input_shapes, require_static=True))
    graph = legal.graph  # what TVM lacks, rewritten first: the search sees (and optimized.onnx is) this graph
    unfolded = legal.unfolded or graph
    if legal.changed:
        log.add("legalize", time.perf_counter() - t0, lowered=legal.lowered, shape_nodes_folded=legal.folded,
                nodes=len(graph.nodes))
        t0 = time.perf_counter()
    if ctx.skip_graph:
        log.add("graph", time.perf_counter() - t0, skipped=True, nodes=len(graph.nodes))
        return StagedGraph(export_onnx(graph), graph, unfolded)
    from pipeline.pricing.graph_runner import TvmRunner

    spec = ctx.spec
    kind = ctx.target.cost_kind if spec.can_run else "not-here"  # a kind other than llvm: analytic cost
    cost = make_cost_model("measured", kind, TvmRunner(compile_graph, ctx.stage_threads, spec, kernel_times,
                                                       compile_model))
    result = optimize_graph(graph, cost, GraphStageOptions(progress=ctx.tuning.progress,
                                                           time_limit=ctx.graph_time_limit))
    facts = {"cost_before": result.cost_before, "cost_after": result.cost_after, "applied": result.applied,
             "stopped_by": result.search.stopped_by.value, "kept": result.kept,  # with the end-to-end verdict:
             "e2e_ms_before": result.check.ms_before, "e2e_ms_after": result.check.ms_after,
             "e2e_check": result.check.status, "e2e_decision": result.check.decision,
             "stop_reason": result.stop_reason, "pricing_failures": result.pricing_failures,
             "estimated_prices": result.estimated_prices, "frozen_weights": result.frozen_weights,
             "winograd": result.winograd.to_json()}
    log.add("graph", time.perf_counter() - t0, skipped=False, nodes_before=len(graph.nodes),
            nodes_after=len(result.graph.nodes), **facts)
    return StagedGraph(export_onnx(result.graph), result.graph, unfolded)


@dataclass
class Lowered:
    """A model imported into Relax and partitioned into fused tasks (after the layout stage), with the time
    each step took."""

    imported: ImportedModel
    part: Partition
    import_s: float = 0.0
    partition_s: float = 0.0  # the layout stage and the partition


def lower(model: onnx.ModelProto | str, spec: TargetSpec, layout: str | None,
          input_shapes: InputShapes | None = None, built_values: Mapping[str, np.ndarray] | None = None,
          served: Served | None = None) -> Lowered:
    """Relax import, the layout stage (``layout``: a ``--layout`` choice; None: none, the module as imported)
    and the partition into fused tasks.  ``built_values``: the inputs a specialized build takes one value of,
    asserted by the compiled code itself (:mod:`pipeline.passes.value_guard`).  ``served``: the dimensions kept
    symbolic over their ranges (:mod:`pipeline.symbolic`); the layout stage, whose blocked convs are per
    size, is not run then."""
    t0 = time.perf_counter()
    imported = import_model(model, input_shapes, served, lowering_for(spec))
    if built_values:
        imported.mod = add_value_guards(imported.mod, built_values)
    t1 = time.perf_counter()
    if served is not None:
        part = partition(imported.mod, served.at)
    else:
        part = partition(imported.mod) if layout is None else partition_model(imported.mod, spec, layout)
    return Lowered(imported, part, t1 - t0, time.perf_counter() - t1)


def build(lowered: Lowered, spec: TargetSpec, tuned: dict[str, Any] | None = None,
          base: tvm.IRModule | None = None, replaced: dict[str, Any] | None = None) -> CompiledModel:
    """The partition compiled: each task by its tuned config (``tuned``: task key -> config), else the sanity
    floor's replacement (``replaced``), else its default schedule; ``base`` a module scheduled already
    (MetaSchedule's).  The order is :func:`pipeline.schedule_sources.schedule_sources`'."""
    return compile_partition(lowered.imported, lowered.part, spec, tuned, base=base, replaced=replaced)


def build_untuned(lowered: Lowered, ctx: BuildContext) -> tuple[CompiledModel, dict[str, Any]]:
    """The partition with default schedules, held to the sanity floor (:mod:`pipeline.pricing.sanity`) where its
    kernels run here: a templated kernel far below its roofline on this CPU gets a replacement config and
    the model is rebuilt.  Returns the build and what the floor found (report.json's ``sanity`` stage)."""
    from pipeline.pricing import sanity
    from pipeline.pricing.profile import profile_kernels

    spec = ctx.spec
    compiled = build(lowered, spec)
    if spec.is_gpu or not spec.can_run or not any(t.task is not None for t in lowered.part.tasks):
        return compiled, {"checked": False}
    t0 = time.perf_counter()
    peak, bandwidth = sanity.cpu_facts(spec.target)
    profile = profile_kernels(compiled, lowered.imported, runs=1, seed=ctx.seed, samples=ctx.samples)
    rates = sanity.kernel_rates(lowered.part, profile, peak, bandwidth)
    replaced = sanity.replace_slow(lowered.part, rates, spec.target, ctx.seed)
    if replaced:
        compiled = build(lowered, spec, replaced=replaced)
    flagged = [r.to_json() for r in rates if r.flagged]
    return compiled, {"checked": True, "seconds": round(time.perf_counter() - t0, 2), "floor": sanity.FLOOR,
                      "peak_gflops": peak, "bandwidth_gbs": bandwidth, "kernels": len(rates),
                      "flagged": flagged, "replaced": len(replaced)}


def kernel_times(models: list[tuple[onnx.ModelProto, Graph]], spec: TargetSpec, confirm: bool = False) -> list[float]:
    """What the graph stage prices candidates at before it times them whole (the TVM runner's
    ``price_kernels``; each model with its legalized graph IR): the kernels :func:`compile_model` would
    build for them, each timed alone, over the kernel calls they do not all share
    (:meth:`pipeline.pricing.kernel_price.KernelPricer.compare`; ``confirm``: those timed again)."""
    pricer = KernelPricer(spec, partition_fn=lambda mod: partition_model(mod, spec, PRICE_LAYOUT),
                          partition_key=f"layout={PRICE_LAYOUT}")
    return [p.seconds for p in pricer.compare(models, retime=confirm)]


# The layouts a candidate model is priced and timed in: the heuristic blocks (no measurement, seconds), so a
# rewrite that trades convolutions for matmuls (Winograd) is judged against the blocked convs that ship, not
# the NCHW ones TVM imports (issue 24, ResNet-50 on an Intel Xeon: 1.96x onnxruntime in NCHW, 1.29x blocked).
PRICE_LAYOUT = "nchwc"


def _compile_default(model: onnx.ModelProto, spec: TargetSpec, layout: str | None) -> CompiledModel:
    with serial():  # TVM's Python side, one thread at a time (kerneltune.machine_gate)
        lowered = lower(model, spec, layout)
    with quiet_native_stderr():  # LLVM codegen warns about TOPI's pragmas ("Unknown pragma pragma_scope")
        return build(lowered, spec)


def compile_graph(model: onnx.ModelProto, spec: TargetSpec) -> CompiledModel:
    """What the graph stage times one operator as (:class:`pipeline.pricing.graph_runner.TvmRunner`): imported,
    partitioned as imported (no layout stage) and compiled with default schedules."""
    return _compile_default(model, spec, None)


def compile_model(model: onnx.ModelProto, spec: TargetSpec) -> CompiledModel:
    """What the graph stage times a whole candidate as (the end-to-end check): :func:`compile_graph` with the
    convolutions in the heuristic blocked layouts (:data:`PRICE_LAYOUT`)."""
    return _compile_default(model, spec, PRICE_LAYOUT)
