"""``bench-model``: onnxruntime vs the TVM-compiled model, in one process.

Engines: onnxruntime, OpenVINO (when the optional package is installed: the ``[bench]`` extra), TVM with default
schedules, TVM + graphopt, TVM + graphopt + our tuning, TVM +
MetaSchedule (the last two with the same ``--trials``).  All run the same seeded inputs with the same
thread count, timed by :func:`graphopt.timing.time_blocks`: alternating blocks of back-to-back runs with
an idle gap between engines, so each engine runs as it would alone (no other engine's threads spinning
beside it) while a noisy neighbour on a shared machine still slows every engine alike; the median is the
headline and the min shows the floor.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from graphopt.compare import Comparison, compare_runs
from graphopt.quant_tolerance import model_tolerance
from graphopt.errors import UserError
from graphopt.feeds import feed_sets, ort_session, run_ort_sets, sample_feeds
from graphopt.fileio import save_figure, write_text_atomic
from graphopt.specialize import specialize_model
from graphopt.validate import ModelInput, check_model
from graphopt.timing import Timing, time_blocks
from kerneltune.targets.host import host_cpu, host_model_name
from kerneltune.targets.registry import device_for
from pipeline import metaschedule, stages, tuning
from pipeline.compile import compile_partition, model_runner, outputs_numpy, to_device
from pipeline.context import BuildContext
from pipeline.frontend import BRANCH_BLOCKERS
from pipeline.partition import partition, select_tasks
from pipeline.profile import KernelTime, profile_kernels


# Engine keys in table order, with their labels; JSON key is f"{key}_ms".
ENGINES = {
    "ort": "onnxruntime (CPU EP)",
    "openvino": "OpenVINO (CPU, f32)",
    "tvm": "TVM default schedules",
    "graphopt": "TVM + graphopt",
    "tuned": "TVM + graphopt + our tuning",
    "metaschedule": "TVM + MetaSchedule",
}


@dataclass
class BenchResult:
    model: str
    target: str
    threads: int
    runs: int
    timings: dict[str, Timing]  # engine key -> timing (only the engines that ran)
    checks: dict[str, Comparison]  # TVM engine key -> its outputs vs onnxruntime's
    trials: int = 0
    tuned_choice: tuning.BuildChoice | None = None  # which build the tuned engine is (the one optimize-model ships)
    stage_seconds: dict[str, float] | None = None  # wall time per stage of compile_engines (graph, layout...)

    @property
    def errors(self) -> dict[str, float]:
        """TVM engine key -> max abs err vs onnxruntime."""
        return {k: c.max_abs_err for k, c in self.checks.items() if k != "openvino"}

    @property
    def max_abs_err(self) -> float:
        return max(self.errors.values()) if self.errors else 0.0

    def to_json(self) -> dict:
        """Flat keys as issues 2 and 6 specify (``ort_ms``, ``tvm_ms``, ``graphopt_ms``, ``tuned_ms``,
        ``metaschedule_ms``: median ms or null when not run; ``max_abs_err`` over all TVM engines), and each
        engine's full check (``checks``: abs and rel error, tolerance, top-1 agreement)."""
        out: dict = {f"{k}_ms": (self.timings[k].median_ms if k in self.timings else None) for k in ENGINES}
        out.update({f"{k}_min_ms": t.min_ms for k, t in self.timings.items()})
        out.update(max_abs_err=self.max_abs_err, errors=self.errors, trials=self.trials, model=self.model,
                   target=self.target, threads=self.threads, runs=self.runs, cpu=host_model_name(),
                   mcpu=host_cpu(), checks={k: c.to_dict() for k, c in self.checks.items()},
                   tuned_choice=self.tuned_choice.to_json() if self.tuned_choice else None,
                   stage_seconds=self.stage_seconds)
        return out


def bench(imported, compiled: dict, ctx: BuildContext, runs: int, model_name: str = "",
          tuned_choice: tuning.BuildChoice | None = None) -> BenchResult:
    """Benchmark compiled models (engine key -> :class:`~pipeline.compile.CompiledModel`) against
    onnxruntime on the original model, all timed together (:func:`graphopt.timing.time_blocks`), with the
    context's threads, seed and sample inputs.

    Every engine is first checked against onnxruntime on the check inputs (the samples, or several seeded
    sets); a wrong engine is a UserError: the latency of a wrong build means nothing.  The timed runs use
    the samples (or the first seeded set)."""
    threads, samples, seed = ctx.threads, ctx.samples, ctx.seed
    feeds = sample_feeds(imported.graph, samples, seed)
    sets = feed_sets(imported.graph, seed, samples)
    references = run_ort_sets(imported.onnx_model, sets, threads)
    quantized = model_tolerance(imported.onnx_model, sets, references, threads)  # one quantization step
    tolerance = quantized.tolerances if quantized else None
    sess = ort_session(imported.onnx_model, threads)  # as it runs alone: blocks with idle gaps (graphopt.timing)
    ort_names = {i.name for i in sess.get_inputs()}
    ort_feeds = {k: v for k, v in feeds.items() if k in ort_names}
    engines: dict[str, Callable[[], object]] = {"ort": lambda: sess.run(None, ort_feeds)}
    checks: dict[str, Comparison] = {}
    spec = None
    on_cpu = bool(compiled) and all(cm.spec.kind == "llvm" and cm.spec.can_run for cm in compiled.values())
    peer = openvino_runner(imported.onnx_model, threads, sets, references, feeds, tolerance) if on_cpu else None
    if peer is not None:
        engines["openvino"], checks["openvino"] = peer
    for key, cm in compiled.items():
        spec = cm.spec
        dev = device_for(cm.spec)
        main = cm.vm()["main"]
        checks[key] = compare_runs([(ref, outputs_numpy(main(*to_device(f, cm.input_names, dev))))
                                    for f, ref in zip(sets, references)], tolerance)
        if not checks[key].ok:
            raise UserError(f"'{ENGINES[key]}' differs from onnxruntime: {checks[key].reason()}; no latency of a "
                            "wrong build is reported - rerun with --skip-graph to isolate the stage, and report it")
        engines[key] = model_runner(cm, feeds)
    times = time_blocks(engines, runs)
    return BenchResult(model_name, spec.kind if spec else "", threads, runs, times, checks, ctx.tuning.trials,
                       tuned_choice)


def openvino_runner(model, threads: int, sets: list, references: list, feeds: dict, tolerance=None):
    """OpenVINO's CPU plugin on the same model, as a user who picks it instead would run it: f32 precision,
    latency mode, the same threads (the CPU runtime to beat beside onnxruntime).  ``(runner, check)``, or None
    when the optional package is missing (``pip install optimize-model[bench]``) or the target is not the
    CPU.  Its outputs are checked against onnxruntime like ours; one that differs is reported, not timed."""
    try:
        import openvino as ov
    except ImportError:
        return None
    core = ov.Core()
    compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
                                   "INFERENCE_NUM_THREADS": int(threads)})
    request = compiled.create_infer_request()
    names = [p.get_any_name() for p in compiled.inputs]

    def run_set(f: dict):
        return [request.infer({n: f[n] for n in names})[o].copy() for o in compiled.outputs]

    check = compare_runs([(ref, run_set(f)) for f, ref in zip(sets, references)], tolerance)
    if not check.ok:
        return None
    return (lambda: request.infer({n: feeds[n] for n in names})), check


def format_profile(kernels: list[KernelTime], top: int = 15) -> str:
    whole = sum(k.ms for k in kernels) or 1.0
    lines = [f"{'ms/run':>9} {'share':>6} {'calls':>5}  kernel"]
    for k in kernels[:top]:
        lines.append(f"{k.ms:>9.3f} {k.ms / whole:>6.1%} {k.calls:>5}  {k.name}")
    return "\n".join(lines)


def format_table(res: BenchResult) -> str:
    rows = [(ENGINES[k], res.timings[k], res.errors.get(k)) for k in ENGINES if k in res.timings]
    width = max(len(r[0]) for r in rows)
    ort = res.timings["ort"].median_ms
    lines = [f"{res.model}  target={res.target}  threads={res.threads}  runs={res.runs}"
             + (f"  trials={res.trials}" if res.trials else ""),
             f"{'engine':<{width}}  {'median ms':>10}  {'min ms':>10}  {'vs ORT':>7}  {'max abs err':>11}"]
    for name, t, err in rows:
        lines.append(f"{name:<{width}}  {t.median_ms:>10.3f}  {t.min_ms:>10.3f}  {t.median_ms / ort:>6.2f}x  "
                     f"{'-' if err is None else f'{err:.3g}':>11}")
    if res.tuned_choice and res.tuned_choice.note:
        lines.append(f"'{ENGINES['tuned']}' is the build optimize-model ships: {res.tuned_choice.note}")
    return "\n".join(lines)


def write_json(res: BenchResult, path: str | os.PathLike) -> None:
    write_text_atomic(path, json.dumps(res.to_json(), indent=2) + "\n")


def plot(res: BenchResult, path: str | os.PathLike) -> None:
    """Bar chart of median latency (error bar down to the min) per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ENGINES if k in res.timings]
    med = [res.timings[k].median_ms for k in keys]
    low = [res.timings[k].median_ms - res.timings[k].min_ms for k in keys]
    fig, ax = plt.subplots(figsize=(1.8 * len(keys) + 2, 3.8))
    colors = ["#888888", "#3a7bd5", "#6cb36c", "#e08a2c", "#a05cc0"]
    ax.bar(range(len(keys)), med, yerr=[low, [0] * len(keys)], color=colors[:len(keys)], capsize=4)
    ax.set_xticks(range(len(keys)), [ENGINES[k].replace(" + ", "\n+ ") for k in keys], fontsize=7)
    ax.set_ylabel("latency, ms (median; bar to min)")
    ax.set_title(f"{res.model}, {res.target}, {res.threads} threads" + (f", {res.trials} trials" if res.trials else ""))
    for i, v in enumerate(med):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


@dataclass
class BenchOptions:
    """bench-model's own options; the rest (target, threads, seed, layout, --skip-graph, tuning) is the build
    context's."""

    skip_metaschedule: bool = False
    work_dir: str | None = None  # records of both tuners; resumable (default: a temporary directory)


def compile_engines(model: ModelInput | str, ctx: BuildContext, opts: BenchOptions):
    """(imported original, {engine key: CompiledModel}, tuned build choice or None, seconds per stage) for
    every TVM variant the options ask for: ``ctx.tuning.trials`` > 0 adds the tuned and MetaSchedule engines,
    each with this budget; ``ctx.skip_graph`` drops the graphopt engine; our engines get ``ctx.layout``'s conv
    layouts (:mod:`pipeline.layout.search`), MetaSchedule the model as imported.

    The tuned engine is the build ``optimize-model`` would ship (:func:`pipeline.tuning.pick_build`): the
    tuned schedules if they are faster end to end, else the default schedules - a benchmark of the product
    reports what the user gets, and the choice (with its timings) says whether tuning won.

    The TVM default build is compiled once and reused; the graph-optimized model is partitioned once and
    serves both the graphopt engine and (with its tuned configs) the tuned engine.  ``model`` is a checked
    model (:func:`graphopt.validate.check_model`) or a path, checked here; every engine compiles it specialized
    on the control inputs whose value a build needs, as optimize-model does (:mod:`graphopt.specialize`).
    The stages are :mod:`pipeline.stages`'; the graph stage prices for the context's target as given (its
    ``-mcpu``/``-mattr`` too), as optimize-model's does.
    """
    if not isinstance(model, ModelInput):
        model = check_model(model, ctx.input_shapes)
    input_shapes = model.input_shapes
    spec = ctx.spec
    seconds: dict[str, float] = {}

    def timed(stage: str, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        seconds[stage] = round(seconds.get(stage, 0.0) + time.perf_counter() - t0, 2)
        return out

    def lower(proto, shapes=None) -> stages.Lowered:
        lowered = stages.lower(proto, spec, ctx.layout, shapes)
        for stage, s in (("import", lowered.import_s), ("layout_partition", lowered.partition_s)):
            seconds[stage] = round(seconds.get(stage, 0.0) + s, 2)
        return lowered

    proto = timed("import", specialize_model, model, BRANCH_BLOCKERS)[0]
    base = lower(proto, input_shapes)
    imported = base.imported
    untuned = lambda lowered: stages.build_untuned(lowered, ctx)[0]  # noqa: E731 - held to the sanity floor
    engines = {"tvm": timed("compile", untuned, base)}
    graph, graph_proto = base, proto
    choice = None
    if not ctx.skip_graph:
        optimized = timed("graph", stages.graph_stage, ctx, proto, input_shapes, stages.StageLog()).model
        graph, graph_proto = lower(optimized), optimized
        engines["graphopt"] = timed("compile", untuned, graph)
    if ctx.tuning.trials > 0:
        work = Path(opts.work_dir or tempfile.mkdtemp(prefix="bench-model-"))
        ctx = ctx.with_records(work / "records.jsonl")
        run = tuning.tuning_run(ctx)
        result = timed("tuning", tuning.tune_model, select_tasks(graph.part.tasks, ctx.tuning.kernels), run)
        engines["tuned"], choice = timed("tuning", tuning.pick_build,
                                         timed("compile", stages.build, graph, spec, result.best_configs), graph,
                                         ctx, result.best_configs, graph_proto.SerializeToString())
        if not opts.skip_metaschedule:  # TVM's own tuner on the model as imported (no layout stage)
            plain = partition(imported.mod)
            ms_mod = timed("metaschedule", metaschedule.tune, plain, spec, ctx.tuning.trials, work / "metaschedule",
                           ctx.seed)
            engines["metaschedule"] = timed("compile", compile_partition, imported, plain, spec, base=ms_mod)
    return imported, engines, choice, seconds
