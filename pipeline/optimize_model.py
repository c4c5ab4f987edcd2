"""``optimize-model``: graph stage -> Relax import -> partition -> tuning -> compile -> check -> write DIR.

Each stage is timed into report.json.  The graph stage is :func:`graphopt.stage.optimize_graph`
(TASO-style substitutions, measured cost timed with TVM); with ``--skip-graph`` the model is imported and
exported through the graph IR unchanged, so DIR/optimized.onnx is the graph the library was compiled from - at the input's
symbolic sizes where the input has them (the stage's folded shape arithmetic computed again, and checked at
a second size in onnxruntime; :mod:`graphopt.dynamic`), while model.so is built for the fixed sizes.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from graphopt import rlimits
from graphopt.dims import sizes_text
from graphopt.compare import Comparison, compare_runs
from graphopt.errors import UserError
from graphopt.feeds import feed_sets, run_ort_sets
from graphopt.fileio import (check_output_dir, check_output_file, display_path, lock_output_dir, write_bytes_atomic,
                             write_text_atomic)
from graphopt.ir import Graph
from graphopt.timing import GAP_S
from graphopt.onnx_io import external_data_name, save_model
from graphopt.specialize import specialize_model
from pipeline.artifact import deployment, tensor_specs
from pipeline.context import BuildContext
from pipeline.frontend import BRANCH_BLOCKERS
from pipeline.quantize import FP32, checked_model
from pipeline.report import build_facts, report_markdown

log = logging.getLogger(__name__)


# An unnamed -o: a folder named after the model in the current folder (models/bert_tiny.onnx -> ./bert_tiny.optimized).
OUTPUT_SUFFIX = ".optimized"


def default_output_dir(model_path: str) -> Path:
    """Where a build goes without ``-o``: ``MODEL.optimized`` in the current folder, so the headline command
    needs no option beyond the target, and two models built in one folder do not overwrite each other."""
    return Path(Path(model_path).stem + OUTPUT_SUFFIX)


# Every file a build writes in DIR.  A new build drops an older one's, also those it does not write itself (a
# weights file, a GPU code object, a tuning plot); records.jsonl, the tuning history, and the user's files stay.
BUILD_FILES = ("optimized.onnx", external_data_name("optimized.onnx"), "model.so", "model.hsaco", "report.json",
               "report.md", "tuning.png")


@dataclass
class OptimizeResult:
    out_dir: Path
    report: dict[str, Any]


def optimize_model(model_path: str, out_dir: str, ctx: BuildContext) -> OptimizeResult:
    """Run the pipeline; write DIR/optimized.onnx, model.so, report.json (+ records.jsonl, tuning.png,
    report.md when tuning).  ``ctx`` holds the options (:class:`pipeline.context.BuildContext`: the target,
    threads, seed, ``--inputs`` sample inputs for the checks, the conv layouts of :mod:`pipeline.layout.search`,
    the graph stage's and the tuning options).

    Every input problem is found before TVM loads (seconds): the target's spelling (read when ``ctx`` was
    made), the output paths, the model (:func:`graphopt.validate.check_model`; with ``--precision int8`` the
    fp32 model, then onnxruntime's int8 model of it: :func:`pipeline.quantize.checked_model`) and the control
    inputs whose value the build needs (:func:`graphopt.specialize.specialize_model`: the build is specialized on their
    ``inputs`` values, and report.json's signature records them); then DIR is locked (another run into it is
    refused).  The artifacts are written only after the compiled model matched onnxruntime, into a new folder
    that takes DIR's place in one step (:func:`graphopt.fileio.lock_output_dir`): a run killed at any moment
    leaves the previous build or this one."""
    tuning = ctx.tuning
    out = check_output_dir(out_dir, "-o")
    records = Path(tuning.records) if tuning.records else out / "records.jsonl"
    ctx = ctx.with_records(records)
    if tuning.enabled:  # a records path we cannot write, or one another tuner holds
        check_output_file(records, "--records")
        ctx.records.check_free()
    # --precision int8: the input quantized by onnxruntime, checked, and every stage below works on it
    model, precision = checked_model(model_path, ctx)
    ctx = ctx.with_model(model.samples)
    source, specialized = specialize_model(model, BRANCH_BLOCKERS)  # the model as compiled
    check_output_dir(out, "-o", need_bytes=output_bytes(model.proto))
    weights = model.proto.ByteSize()  # model.so and optimized.onnx each hold them
    refusal = rlimits.shortfall(rlimits.BUILD_ADDRESS_SPACE + weights, file_bytes=weights)
    if refusal:
        raise UserError(refusal)
    with lock_output_dir(out, "-o") as folder:  # one writer per folder until the end, also on an error
        # Deferred: these load TVM (seconds), after every cheap check above has passed.
        from pipeline.chain import ChainRequest, restored_sizes, run_chain
        from pipeline.compile import check_outputs
        from pipeline.pricing.profile import task_times
        from pipeline.symbolic import Served, input_ranges
        from pipeline.tuning import NO_TEMPLATE, NOT_SELECTED, plot_tuning, shipped_title, tuning_run

        original = model.proto
        spec = ctx.spec
        run = tuning_run(ctx) if tuning.enabled else None  # a target that cannot be tuned here: refused now
        if tuning.enabled and tuning.rpc and not _has_records(records):  # fail in seconds, not after the graph
            from kerneltune.runner import check_device  # stage; a resume checks when it first needs the device

            check_device(tuning.rpc)
        served = Served.of(original, model.input_shapes, model.ranges)  # --dim NAME=LO:HI (pipeline.symbolic)
        built = run_chain(ctx, ChainRequest(source, model.input_shapes,
                                            built_values=specialized.values if specialized else None,
                                            served=served, original=original, tuning=run))
        log, staged, compiled = built.log, built.staged, built.compiled
        choice, tune_result = built.choice, built.tuning
        optimized, imported, part = staged.model, built.lowered.imported, built.lowered.part
        shipped, dynamic, dynamic_s = built.shipped, built.dynamic, built.dynamic_s
        facts: dict[str, Any] = {"schedules": compiled.schedules}
        if spec.can_run:
            # The reference is onnxruntime on the *original* model, so graph rewrites are checked too.
            check = check_outputs(compiled, imported.graph, original, ctx.seed, samples=ctx.samples)
            facts.update(check.to_dict(), checked="compiled model vs onnxruntime")
            if not check.ok:
                raise UserError(f"the compiled model differs from onnxruntime: {check.reason()}; nothing was written - "
                                f"{mismatch_hint(check)}")
        else:
            # The kernels cannot run here; onnxruntime can still check the graph the library was compiled from.
            check = check_graph(original, optimized, imported.graph, ctx)
            facts.update(check.to_dict(), checked="graph only (optimized.onnx vs the input in onnxruntime)",
                         not_run=spec.note)
            if not check.ok:
                raise UserError(f"the optimized graph differs from the input model in onnxruntime: {check.reason()}; "
                                "nothing was written - rerun with --skip-graph")
        if served is not None and spec.can_run:
            facts["served"] = check_served(compiled, original, model.input_shapes, served, ctx.seed)
        log.add("compile", compiled.build_s, **facts)
        t0 = time.perf_counter()
        pool = int(ctx.threads or spec.threads or 1)
        latency = (end_to_end_latency(compiled, imported.graph, original, pool, ctx)
                   if spec.can_run else {"measured": False, "reason": spec.note})
        if latency["measured"]:
            log.add("latency", time.perf_counter() - t0, compiled_ms=latency["compiled_ms"],
                    onnxruntime_ms=latency["onnxruntime_ms"])
        in_model = (task_times(compiled, imported, part.tasks, seed=ctx.seed, samples=ctx.samples)
                    if spec.can_run and not spec.is_gpu else {})
        if dynamic is None:
            shipped, dynamic, dynamic_s = restored_sizes(ctx, original, staged)
        log.add("dynamic_shapes", dynamic_s, optimized_onnx=dynamic.form, restored_nodes=dynamic.restored_nodes)

        with folder.replace(BUILD_FILES) as new:  # DIR's contents change in one step, once all is written
            files = {"optimized": "optimized.onnx", "library": "model.so", "report_md": "report.md"}
            if len(save_model(shipped, new / "optimized.onnx")) > 1:  # over 2 GB: its weights in a file beside it
                files["weights"] = external_data_name("optimized.onnx")
            lib = compiled.export(new / "model.so")
            if lib.with_suffix(".hsaco").exists():
                files["code_object"] = lib.with_suffix(".hsaco").name
            if tune_result is not None:
                if records.resolve() != (out / "records.jsonl").resolve() and records.exists():
                    write_bytes_atomic(new / "records.jsonl", records.read_bytes())
                tuned_ids = {t.index for t in tune_result.tasks}
                plot_tuning(tune_result, new / "tuning.png",
                            [(t.index, t.name, NO_TEMPLATE if t.task is None else NOT_SELECTED)
                             for t in part.tasks if t.index not in tuned_ids], shipped_title(choice))
                files.update(records="records.jsonl", tuning_plot="tuning.png")
            report = {
                **build_facts(),  # schema version, time, versions, CPU: pipeline/report_schema.json
                "model": display_path(model_path), "target": spec.kind, "target_request": ctx.target.text,
                "target_detail": str(spec.target),
                "threads": spec.threads,
                "inputs": display_path(ctx.inputs) if ctx.inputs else None,
                "dims": ctx.dims,  # --dim: the symbolic dimensions fixed by name ({} when none)
                "deploy": deployment(spec, tensor_specs([i for i in imported.graph.inputs
                                                         if i.name not in imported.graph.initializers],
                                                        specialized.values if specialized else None,
                                                        input_ranges(original, served) if served else None),
                                     tensor_specs(imported.graph.outputs), new),
                "served": served.to_json() | {"checked": facts.get("served")} if served else None,
                "specialized": specialized.to_json() if specialized else None,
                "opset_upgrade": model.upgrade.to_json() if model.upgrade else None,  # compiled at a newer opset
                "precision": precision.to_json() if precision else FP32,
                "latency": latency,
                "dynamic_shapes": dynamic.to_json(),
                "stages": log.stages, "tasks": [t.summary() | {"schedule": compiled.schedules.get(t.name),
                                                               "ms": in_model.get(t.index)} for t in part.tasks],
                "call_sites": [site.to_json() for site in part.sites],
                "files": files,
            }
            write_text_atomic(new / "report.md", report_markdown(report))
            write_text_atomic(new / "report.json", json.dumps(report, indent=2) + "\n")
        return OptimizeResult(out, report)


# Input sets per size a served build is checked at besides its representative size (which takes the main
# check's sets): what changes from size to size is the code path (tails, masks), not what random values test.
# Three sets at each of GPT-2's other sizes (2, 257, 512 tokens) took 23 of its served build's 139 s.
SERVED_CHECK_SETS = 1


def check_served(compiled: Any, original: onnx.ModelProto, shapes: dict, served: Any, seed: int) -> list[dict]:
    """The build of a range checked against onnxruntime at the range's other sizes
    (:meth:`pipeline.symbolic.Served.check_sizes`; the representative size is the main check's), each on
    :data:`SERVED_CHECK_SETS` seeded random input sets: a one-line UserError at the first size where it differs
    or onnxruntime fails."""
    from pipeline.compile import check_outputs

    out = []
    for sizes in served.check_sizes():
        at = sizes_text(sizes)
        try:
            graph = served.graph_at(original, shapes, sizes)
            check = check_outputs(compiled, graph, original, seed, count=SERVED_CHECK_SETS)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime's or the VM's failure at that size, in one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise UserError(f"the model does not run at {at} ({type(exc).__name__}: {first}); nothing was written - "
                            "narrow the --dim range to sizes the model takes") from None
        if not check.ok:
            raise UserError(f"the compiled model differs from onnxruntime at {at}: {check.reason()}; nothing was "
                            "written - build for fixed sizes (--dim NAME=N) and report it")
        out.append({"sizes": sizes, "max_abs_err": check.max_abs_err, "ok": True})
    return out


def _has_records(path: Path) -> bool:
    """A records file with content: this run resumes (or rebuilds from) an earlier one."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def output_bytes(model: onnx.ModelProto) -> int:
    """Room DIR needs: optimized.onnx and model.so each hold the weights; 64 MB for code, records, plots."""
    return 2 * model.ByteSize() + 64 * 2**20


def check_graph(original: onnx.ModelProto, optimized: onnx.ModelProto, graph: Graph, ctx: BuildContext) -> Comparison:
    """optimized vs original, both in onnxruntime, on the check inputs (for targets that cannot run here)."""
    sets = feed_sets(graph, ctx.seed, ctx.samples)
    return compare_runs(list(zip(run_ort_sets(original, sets), run_ort_sets(optimized, sets))))


def mismatch_hint(check: Comparison) -> str:
    """What the user can do about a compiled model that does not match onnxruntime."""
    if check.nan_mismatch or check.inf_mismatch:
        return ("onnxruntime's result has NaN or Inf where the compiled one has numbers or the reverse (TVM's "
                "max/min/relu kernels do not propagate NaN the way onnxruntime does): keep the model's values "
                "finite, e.g. clamp the inputs of Log/Sqrt/Div")
    return "rerun with --skip-graph / --skip-tune to isolate the stage, and report it"


LATENCY_RUNS = 15  # timed calls per engine for report.json's end-to-end latency (3 blocks of 5)
LATENCY_ROUNDS = 3
LATENCY_GAP_S = GAP_S  # idle before each engine's block (graphopt.timing.GAP_S: the other engine's workers stop)


def _round_ms(x: float) -> float:
    """Five significant digits: a fixed number of decimals made a 0.02 ms model's figures (and the speed-up
    read off them) coarse."""
    return float(f"{x:.5g}")


def end_to_end_latency(compiled: Any, graph: Graph, original: onnx.ModelProto, threads: int,
                       ctx: BuildContext) -> dict[str, Any]:
    """Milliseconds per inference of the shipped build and of onnxruntime on the input model, same inputs
    and threads, timed together by the project's whole-model timer (:func:`graphopt.timing.time_blocks`:
    alternating blocks with idle gaps, the median); fewer runs than bench-model, which is for comparisons."""
    from graphopt.feeds import ort_session, sample_feeds
    from graphopt.timing import time_blocks
    from pipeline.compile import model_runner

    feeds = sample_feeds(graph, ctx.samples, ctx.seed)
    try:  # the build is checked and complete: a figure for the report must not cost it
        sess = ort_session(original, threads)
        names = {i.name for i in sess.get_inputs()}
        ort_feeds = {k: v for k, v in feeds.items() if k in names}
        runners = {"compiled": model_runner(compiled, feeds), "onnxruntime": lambda: sess.run(None, ort_feeds)}
        times = time_blocks(runners, LATENCY_RUNS, rounds=LATENCY_ROUNDS, gap_s=LATENCY_GAP_S)
    except Exception as exc:  # noqa: BLE001 - reported in report.json instead
        log.warning("warning: the end-to-end latency was not measured (%s: %s)", type(exc).__name__,
                    str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "")
        return {"measured": False, "reason": f"timing failed: {type(exc).__name__}"}
    c, o = times["compiled"], times["onnxruntime"]
    return {"measured": True, "compiled_ms": _round_ms(c.median_ms), "onnxruntime_ms": _round_ms(o.median_ms),
            "compiled_min_ms": _round_ms(c.min_ms), "onnxruntime_min_ms": _round_ms(o.min_ms),
            "time_ratio": round(c.median_ms / o.median_ms, 3) if o.median_ms > 0 else None, "runs": LATENCY_RUNS,
            "threads": threads, "timer": "median of alternating blocks (graphopt.timing.time_blocks)",
            # slower by the median and by the best run alike: a noisy neighbour alone does not say it
            "slower_than_onnxruntime": c.median_ms > o.median_ms and c.min_ms > o.min_ms}
