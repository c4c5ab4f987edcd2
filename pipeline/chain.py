"""The one chain every command builds through: graph stage -> Relax import -> layout -> partition -> tuning ->
build (held to the sanity floor, or the tuned build against the default end to end).

:func:`run_chain` sequences the stages of :mod:`pipeline.stages` and :mod:`pipeline.tuning` once, for
optimize-model (:mod:`pipeline.optimize_model`: then the checks and DIR), bench-model's engines
(:func:`pipeline.benchmark.compile_engines`: the same chain with no graph stage, with it, and tuned on the
graph-staged lowering, reused rather than redone), ``tune-kernels MODEL`` (up to the partition) and the bench
scripts.  A variant is a :class:`ChainRequest` (which stages, from what), not a copy of the sequence.

What a run made comes back as :class:`Built`, with the stage log report.json prints; the checks against
onnxruntime, the latency and the files are the caller's, as each command checks and writes differently.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Mapping

import numpy as np
import onnx

from graphopt.fileio import display_path
from graphopt.onnx_io import InputShapes
from pipeline import stages
from pipeline.compile import CompiledModel
from pipeline.context import BuildContext
from pipeline.partition import select_tasks
from pipeline.symbolic import Served


class Until(enum.Enum):
    """The last stage a chain runs."""

    PARTITION = "partition"  # the lowered module and its tasks (tune-kernels MODEL)
    BUILD = "build"  # a compiled model


@dataclass
class ChainRequest:
    """What one run of the chain builds, and from what."""

    model: onnx.ModelProto  # the model as compiled (specialized on the values a build needs)
    input_shapes: InputShapes | None = None
    built_values: Mapping[str, np.ndarray] | None = None  # a specialized build's values (pipeline.passes.value_guard)
    served: Served | None = None  # the dimensions kept symbolic (--dim NAME=LO:HI), with the input model:
    original: onnx.ModelProto | None = None  # served builds import it where optimized.onnx cannot stay symbolic
    tuning: Any = None  # a kerneltune TuningRun: tune the selected tasks with it (None: default schedules)
    reuse: "Built | None" = None  # a run whose graph stage and lowering this one starts from
    until: Until = Until.BUILD


@dataclass
class Built:
    """What a run of the chain made."""

    staged: stages.StagedGraph
    lowered: stages.Lowered
    log: stages.StageLog
    compiled: CompiledModel | None = None  # None: stopped at the partition
    tuning: Any = None  # pipeline.tuning's TuningResult when tuned
    choice: Any = None  # pipeline.tuning.BuildChoice: the tuned build against the default, end to end
    dynamic: Any = None  # a served build's optimized.onnx with its symbolic sizes (graphopt.dynamic)
    shipped: onnx.ModelProto | None = None  # that model, which DIR/optimized.onnx is
    dynamic_s: float = 0.0
    facts: dict[str, Any] = field(default_factory=dict)


def run_chain(ctx: BuildContext, request: ChainRequest) -> Built:
    """The stages ``request`` asks for, in order, each logged (module docstring)."""
    log = stages.StageLog()
    reuse = request.reuse
    staged = reuse.staged if reuse else stages.graph_stage(ctx, request.model, request.input_shapes, log)
    built = Built(staged, reuse.lowered if reuse else None, log)  # type: ignore[arg-type]
    if reuse is None:
        built.lowered = _lower(ctx, request, built)
        part = built.lowered.part
        log.add("partition", built.lowered.import_s + built.lowered.partition_s, tasks=len(part.tasks),
                tunable=sum(t.task is not None for t in part.tasks), gflop=round(part.total_flops() / 1e9, 4),
                layout=part.layout)
    if request.until is Until.PARTITION:
        return built
    if request.tuning is None:
        log.add("tune", 0.0, skipped=True, reason="--skip-tune" if ctx.tuning.skip else "--trials 0")
        built.compiled, floor = stages.build_untuned(built.lowered, ctx)
        log.add("sanity", floor.pop("seconds", 0.0), **floor)
    else:
        _tune(ctx, request, built)
    return built


def restored_sizes(ctx: BuildContext, original: onnx.ModelProto, staged: stages.StagedGraph):
    """(optimized.onnx with the input's symbolic sizes, what :func:`graphopt.dynamic.dynamic_model` reports, the
    seconds it took): what DIR/optimized.onnx is."""
    from graphopt.dynamic import dynamic_model

    t0 = time.perf_counter()
    shipped, dynamic = dynamic_model(original, staged.graph, staged.unfolded, ctx.seed, ctx.samples)
    return shipped, dynamic, time.perf_counter() - t0


def _lower(ctx: BuildContext, request: ChainRequest, built: Built) -> stages.Lowered:
    """The graph stage's model imported, blocked and partitioned; a served build from optimized.onnx with its
    symbolic sizes restored and checked (:func:`restored_sizes`), else from the input model."""
    from graphopt.dynamic import OPTIMIZED

    spec, staged = ctx.spec, built.staged
    if request.served is None:
        return stages.lower(staged.model, spec, ctx.layout, built_values=request.built_values)
    built.shipped, built.dynamic, built.dynamic_s = restored_sizes(ctx, request.original, staged)
    compiled_from = built.shipped if built.dynamic.form == OPTIMIZED else request.model
    return stages.lower(compiled_from, spec, None, request.input_shapes, built_values=request.built_values,
                        served=request.served)


def _tune(ctx: BuildContext, request: ChainRequest, built: Built) -> None:
    """Tuning of the selected tasks, then the build that ships: the tuned one only if it is faster end to end
    than the default build (:func:`pipeline.tuning.pick_build`), and for a served build not slower at any of
    the other sizes it is checked at."""
    from pipeline.tuning import pick_build, stop_fields, tune_model

    lowered = built.lowered
    result = tune_model(select_tasks(lowered.part.tasks, ctx.tuning.kernels), request.tuning)
    before, after = result.kernel_ms()
    built.log.add("tune", result.seconds, trials=result.trials, measured_now=result.measured_now,
                  scheduler=result.scheduler, searcher=result.searcher,
                  records=display_path(ctx.records.path) if ctx.records else None,
                  kernel_ms_before=round(before, 4), kernel_ms_after=round(after, 4), **stop_fields(result),
                  tasks=[{"index": t.index, "name": t.name, "trials": t.trials, "default_ms": t.default_ms,
                          "best_ms": t.best_ms, "weight": t.weight, "early_stopped": t.early_stopped}
                         for t in result.tasks])
    tuned = result.best_configs
    served = request.served
    others = [(sizes, partial(served.graph_at, request.original, request.input_shapes or {}, sizes))
              for sizes in served.check_sizes()] if served is not None else []
    built.compiled, built.choice = pick_build(stages.build(lowered, ctx.spec, tuned), lowered, ctx, tuned,
                                              built.staged.model.SerializeToString(), others=others)
    built.log.stages["tune"]["e2e"] = built.choice.to_json()
    built.tuning = result
