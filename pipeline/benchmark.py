"""``bench-model``: onnxruntime vs the TVM-compiled model, in one process.

Engines: onnxruntime, OpenVINO (when the optional package is installed: the ``[bench]`` extra), TVM with default
schedules, TVM + graphopt, TVM + graphopt + our tuning, TVM +
MetaSchedule (the last two with the same ``--trials``); or, given an optimize-model folder, its model.so as
shipped (:mod:`pipeline.bench_shipped`).  All run the same seeded inputs with the same
thread count, timed by :func:`graphopt.timing.time_blocks`: alternating blocks of back-to-back runs with
an idle gap between engines, so each engine runs as it would alone (no other engine's threads spinning
beside it) while a noisy neighbour on a shared machine still slows every engine alike; the median is the
headline and the min shows the floor, with the tail percentiles and the throughput beside them.

A peer that could not run (OpenVINO not installed, or its outputs differ from onnxruntime's) is named with
the reason in the table and the JSON (``skipped``), never dropped silently.  Every ratio is ours / the
peer's time (:func:`pipeline.report.time_ratio`).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from graphopt.compare import Comparison, compare_runs
from graphopt.dims import sizes_text
from graphopt.quant_tolerance import model_tolerance
from graphopt.errors import UserError
from graphopt.feeds import feed_sets, ort_session, run_ort_sets, sample_feeds
from graphopt.fileio import save_figure, write_text_atomic
from graphopt.specialize import specialize_model
from graphopt.validate import ModelInput, check_model
from graphopt.timing import WARMUP, Plan, Timing, time_blocks
from kerneltune.targets.host import host_cpu, host_model_name
from kerneltune.targets.registry import device_for
from pipeline import metaschedule, tuning
from pipeline.chain import Built, ChainRequest, run_chain
from pipeline.compile import compile_partition, model_runner, outputs_numpy, to_device
from pipeline.context import BuildContext
from pipeline.frontend import BRANCH_BLOCKERS
from pipeline.partition import partition
from pipeline.pricing.profile import KernelTime
from pipeline.report import RATIO_MEANING, time_ratio


# Engine keys in table order, with their labels; JSON key is f"{key}_ms".
ENGINES = {
    "ort": "onnxruntime (CPU EP)",
    "openvino": "OpenVINO (CPU, f32)",
    "tvm": "TVM default schedules",
    "graphopt": "TVM + graphopt",
    "tuned": "TVM + graphopt + our tuning",
    "metaschedule": "TVM + MetaSchedule",
    "shipped": "model.so as shipped",
}
PEERS = ("ort", "openvino")  # the runtimes we are compared with; every other engine is ours
OPENVINO_MISSING = "not installed (pip install openvino)"
REBUILT = "rebuilt"  # BenchResult.shipped of a run that compiled its engines itself


@dataclass
class Peer:
    """A runtime we are compared with, ready to time (``runner``, with its outputs' ``check`` against
    onnxruntime), or why it could not run (``skipped``: said in the table and the JSON)."""

    runner: Callable[[], object] | None = None
    check: Comparison | None = None
    skipped: str | None = None


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
    warmup: int = WARMUP  # untimed calls at the start of every block
    duration_s: float | None = None  # --duration: seconds each engine was timed for instead of ``runs`` calls
    shipped: str = REBUILT  # the folder whose model.so was timed, or REBUILT
    skipped: dict[str, str] = field(default_factory=dict)  # engine key -> why it did not run
    heading: str = ""  # what was timed against what, in one line (printed first)
    layers: Any = None  # --profile of a shipped build: pipeline.pricing.layer_profile.LayerProfile
    sizes: dict[str, int] = field(default_factory=dict)  # a build serving a range: the sizes the inputs had

    @property
    def errors(self) -> dict[str, float]:
        """TVM engine key -> max abs err vs onnxruntime."""
        return {k: c.max_abs_err for k, c in self.checks.items() if k not in PEERS}

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
                   stage_seconds=self.stage_seconds, warmup=self.warmup, duration=self.duration_s,
                   shipped=self.shipped, skipped=dict(self.skipped),
                   throughput={k: t.latency.throughput for k, t in self.timings.items()},
                   latency={k: asdict(t.latency) for k, t in self.timings.items()},
                   ratios={k: self.ratio(k) for k in self.timings if k != "ort"})
        if self.layers is not None:
            out["profile"] = self.layers.to_json()
        if self.sizes:
            out["sizes"] = dict(self.sizes)
        return out

    def ratio(self, key: str, baseline: str = "ort") -> float | None:
        """Engine ``key``'s median over ``baseline``'s: a time ratio, below 1 faster (None: one was not timed)."""
        if key not in self.timings or baseline not in self.timings or not self.timings[baseline].median_ms:
            return None
        return self.timings[key].median_ms / self.timings[baseline].median_ms


def bench(imported, compiled: dict, ctx: BuildContext, runs: int | Plan, model_name: str = "",
          tuned_choice: tuning.BuildChoice | None = None) -> BenchResult:
    """Benchmark compiled models (engine key -> :class:`~pipeline.compile.CompiledModel`) against
    onnxruntime on the original model, all timed together (:func:`graphopt.timing.time_blocks`), with the
    context's threads, seed and sample inputs; ``runs``: the timed calls per engine, or a
    :class:`graphopt.timing.Plan` (calls or seconds, and the warm-up).

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
    peer = (openvino_peer(imported.onnx_model, threads, sets, references, feeds, tolerance) if on_cpu
            else Peer(skipped="not compared: the build is not for this CPU, where OpenVINO runs"))
    skipped = add_peer(engines, checks, "openvino", peer)
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
    plan = runs if isinstance(runs, Plan) else Plan(runs)
    times = time_plan(engines, plan)
    return BenchResult(model=model_name, target=spec.kind if spec else "", threads=threads, runs=plan.runs,
                       timings=times, checks=checks, trials=ctx.tuning.trials, tuned_choice=tuned_choice,
                       warmup=plan.warmup, duration_s=plan.duration_s, skipped=skipped)


def time_plan(runners: dict[str, Callable[[], object]], plan: Plan) -> dict[str, Timing]:
    """Every engine timed together by the project's one whole-model timer, for ``plan``'s calls or seconds."""
    return time_blocks(runners, plan.runs, plan.warmup, duration_s=plan.duration_s)


def add_peer(engines: dict, checks: dict, key: str, peer: Peer) -> dict[str, str]:
    """Put a peer that runs among the engines to time (and its check among the checks); ``{key: reason}``
    when it cannot run, for :attr:`BenchResult.skipped`."""
    if peer.skipped:
        return {key: peer.skipped}
    engines[key] = peer.runner
    if peer.check is not None:
        checks[key] = peer.check
    return {}


def openvino_peer(model, threads: int, sets: list, references: list, feeds: dict, tolerance=None) -> Peer:
    """OpenVINO's CPU plugin on the same model, as a user who picks it instead would run it: f32 precision,
    latency mode, the same threads (the CPU runtime to beat beside onnxruntime).  Its outputs are checked
    against onnxruntime like ours; one that differs is named with its error, not timed.  The optional package
    missing (``pip install optimize-model[bench]``), or OpenVINO failing on the model, is a skipped peer with
    the reason: a comparison that leaves a runtime out says so."""
    try:
        import openvino as ov
    except ImportError:
        return Peer(skipped=OPENVINO_MISSING)
    try:
        core = ov.Core()
        compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU",
                                      {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
                                       "INFERENCE_NUM_THREADS": int(threads)})
        request = compiled.create_infer_request()
        names = [p.get_any_name() for p in compiled.inputs]
        check = compare_runs([(ref, [request.infer({n: f[n] for n in names})[o].copy() for o in compiled.outputs])
                              for f, ref in zip(sets, references)], tolerance)
    except Exception as exc:  # noqa: BLE001 - OpenVINO's own failure on this model: named, the rest still runs
        return Peer(skipped=f"failed on this model ({first_line(exc)})")
    if not check.ok:
        return Peer(check=check, skipped=f"outputs differ from onnxruntime's (max abs err {check.max_abs_err:.3g}; "
                                         f"{check.reason()}): not timed")
    return Peer(lambda: request.infer({n: feeds[n] for n in names}), check)


def openvino_runner(model, threads: int, sets: list, references: list, feeds: dict, tolerance=None):
    """:func:`openvino_peer` as the bench/ scripts take it: ``(runner, check)``, or None when it cannot run."""
    peer = openvino_peer(model, threads, sets, references, feeds, tolerance)
    return None if peer.skipped else (peer.runner, peer.check)


def first_line(exc: BaseException) -> str:
    """An exception as one short line: its type and its message's first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def format_profile(kernels: list[KernelTime], top: int = 15) -> str:
    whole = sum(k.ms for k in kernels) or 1.0
    lines = [f"{'ms/run':>9} {'share':>6} {'calls':>5}  kernel"]
    for k in kernels[:top]:
        lines.append(f"{k.ms:>9.3f} {k.ms / whole:>6.1%} {k.calls:>5}  {k.name}")
    return "\n".join(lines)


RATIO_HEAD = "x onnxruntime's time"


def format_table(res: BenchResult) -> str:
    """The latency table: percentiles, throughput and the time ratio to onnxruntime per engine, every peer
    that did not run named with why, and the headline ratio of our build last (what a reader looks for)."""
    keys = [k for k in ENGINES if k in res.timings or k in res.skipped]
    width = max(len(ENGINES[k]) for k in keys)
    how = f"{res.duration_s:g} s per engine" if res.duration_s is not None else f"runs={res.runs}"
    lines = ([res.heading] if res.heading else []) + [
        f"{res.model}  target={res.target}  threads={res.threads}  {how}  warm-up {res.warmup} calls per block"
        + (f"  trials={res.trials}" if res.trials else ""),
        f"{'engine':<{width}}  {'p50 ms':>9}  {'p90 ms':>9}  {'p99 ms':>9}  {'mean ms':>9}  {'min ms':>9}  "
        f"{'runs':>5}  {'inf/s':>8}  {RATIO_HEAD:>{len(RATIO_HEAD)}}  {'max abs err':>11}"]
    for key in keys:
        lines.append(_row(res, key, width))
    if res.tuned_choice and res.tuned_choice.note:
        lines.append(f"'{ENGINES['tuned']}' is the build optimize-model ships: {res.tuned_choice.note}")
    headline = summary_line(res)
    return "\n".join(lines + ([headline] if headline else []))


def _row(res: BenchResult, key: str, width: int) -> str:
    """One engine's line: its figures, or the reason it did not run."""
    name = ENGINES[key]
    if key not in res.timings:
        return f"{name:<{width}}  skipped: {res.skipped[key]}"
    lat, err, ratio = res.timings[key].latency, res.errors.get(key), res.ratio(key)
    shown = "-" if ratio is None else f"{ratio:.2f}x"
    return (f"{name:<{width}}  {lat.p50_ms:>9.3f}  {lat.p90_ms:>9.3f}  {lat.p99_ms:>9.3f}  {lat.mean_ms:>9.3f}  "
            f"{lat.min_ms:>9.3f}  {lat.runs:>5}  {lat.throughput:>8.1f}  {shown:>{len(RATIO_HEAD)}}  "
            f"{'-' if err is None else f'{err:.3g}':>11}")


def summary_line(res: BenchResult) -> str:
    """Our headline build (the shipped one, else the one optimize-model would ship) against each peer that
    ran, as "0.56x onnxruntime's time" (:func:`pipeline.report.time_ratio`); "" when no peer ran."""
    ours = next((k for k in ("shipped", "tuned", "graphopt", "tvm") if k in res.timings), None)
    peers = [k for k in PEERS if k in res.timings]
    if ours is None or not peers:
        return ""
    med = res.timings[ours].median_ms
    ratios = ", ".join(time_ratio(med, res.timings[k].median_ms, ENGINES[k].split(" (")[0]) for k in peers)
    return f"{ENGINES[ours]}: {ratios} (median; {RATIO_MEANING})"


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
    colors = dict(zip(ENGINES, ["#888888", "#5a9fd4", "#3a7bd5", "#6cb36c", "#e08a2c", "#a05cc0", "#c0392b"]))
    ax.bar(range(len(keys)), med, yerr=[low, [0] * len(keys)], color=[colors[k] for k in keys], capsize=4)
    ax.set_xticks(range(len(keys)), [ENGINES[k].replace(" + ", "\n+ ") for k in keys], fontsize=7)
    ax.set_ylabel("latency, ms (median; bar to min)")
    ax.set_title(f"{res.model}, {res.target}, {res.threads} threads" + (f", {res.trials} trials" if res.trials else ""))
    for i, v in enumerate(med):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def format_lengths(results: list[BenchResult]) -> str:
    """bench-model DIR --dim NAME=N,N,...: one row per size, each engine's median and our time ratio to it."""
    keys = [k for k in ENGINES if any(k in r.timings for r in results)]
    head = f"{'sizes':<20}" + "".join(f"{ENGINES[k][:22]:>24}" for k in keys)
    lines = [head]
    for r in results:
        cells = []
        for k in keys:
            t = r.timings.get(k)
            ratio = r.ratio("shipped", k) if k != "shipped" else None
            cells.append(f"{'-':>24}" if t is None else
                         f"{t.median_ms:>12.3f} ms" + (f" ({ratio:.2f}x)" if ratio is not None else " " * 8))
        lines.append(f"{sizes_text(r.sizes):<20}" + "".join(cells))
    return "\n".join(lines + [f"ms: medians; (x): model.so's time over that engine's ({RATIO_MEANING})"])


def plot_lengths(results: list[BenchResult], path: str | os.PathLike) -> None:
    """Latency over the served size, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = next(iter(results[0].sizes))
    xs = [r.sizes[name] for r in results]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for k in ENGINES:
        ys = [r.timings[k].median_ms if k in r.timings else None for r in results]
        if any(y is not None for y in ys):
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=ENGINES[k])
    ax.set_xlabel(name)
    ax.set_ylabel("latency, ms (median)")
    ax.set_title(f"{results[0].model}, {results[0].threads} threads: one build, every {name}")
    ax.legend(fontsize=8)
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

    Each engine is a run of the one chain (:func:`pipeline.chain.run_chain`): without the graph stage, with
    it, and tuned, which starts from the graph-staged run's lowering instead of redoing it.  ``model`` is a
    checked model (:func:`graphopt.validate.check_model`) or a path, checked here; every engine compiles it
    specialized on the control inputs whose value a build needs, as optimize-model does
    (:mod:`graphopt.specialize`); onnxruntime runs it as given.  The graph stage prices for the context's
    target as given (its ``-mcpu``/``-mattr`` too), as optimize-model's does.
    """
    if not isinstance(model, ModelInput):
        model = check_model(model, ctx.input_shapes)
    proto = specialize_model(model, BRANCH_BLOCKERS)[0]
    seconds: dict[str, float] = {}

    def chain(variant: BuildContext, request: ChainRequest) -> Built:
        built = run_chain(variant, request)
        for stage, facts in built.log.stages.items():
            seconds[stage] = round(seconds.get(stage, 0.0) + facts["time_s"], 2)
        seconds["compile"] = round(seconds.get("compile", 0.0) + (built.compiled.build_s if built.compiled else 0), 2)
        return built

    request = ChainRequest(proto, model.input_shapes)
    base = chain(ctx.without_graph_stage(), request)
    imported = replace(base.lowered.imported, onnx_model=proto)  # onnxruntime runs the model as given
    engines = {"tvm": base.compiled}
    graph = base
    if not ctx.skip_graph:
        graph = chain(ctx, request)
        engines["graphopt"] = graph.compiled
    choice = None
    if ctx.tuning.trials > 0:
        work = Path(opts.work_dir or tempfile.mkdtemp(prefix="bench-model-"))
        tuned_ctx = ctx.with_records(work / "records.jsonl")
        tuned = chain(tuned_ctx, replace(request, tuning=tuning.tuning_run(tuned_ctx), reuse=graph))
        engines["tuned"], choice = tuned.compiled, tuned.choice
        if not opts.skip_metaschedule:  # TVM's own tuner on the model as imported (no layout stage)
            plain = partition(imported.mod)
            t0 = time.perf_counter()
            ms_mod = metaschedule.tune(plain, ctx.spec, ctx.tuning.trials, work / "metaschedule", ctx.seed)
            engines["metaschedule"] = compile_partition(imported, plain, ctx.spec, base=ms_mod)
            seconds["metaschedule"] = round(time.perf_counter() - t0, 2)
    return imported, engines, choice, seconds
