"""The console scripts, all composed here: ``optimize-model``, ``run-model``, ``bench-model``, ``graphopt``,
``tune-kernels``.

This module is the composition root: the lower packages define interfaces and the pipeline plugs the
engines in (graphopt's measured cost model gets the TVM runner here, kerneltune's CLI the model mode), so no
lower package imports upward.

TVM's thread pool reads ``TVM_NUM_THREADS`` once, when it first starts, and uses one thread on this VM
otherwise; so ``--threads`` is put into the environment before anything imports the TVM runtime (all
TVM imports below are deferred into the functions for that reason, and to keep ``--help`` fast).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from graphopt import cli as graphopt_cli
from graphopt.cost.runners import GraphRunner, OrtRunner
from graphopt.dims import DIM_HELP, RANGE_HELP, parse_size_lists, shape_request, sizes_text
from graphopt.errors import ArgumentParser, UserError, cli_entry, seconds, seed
from graphopt.fileio import (FIGURE_FORMATS, check_output_dir, check_output_file, display_path, private_tempdir,
                             write_bytes_atomic, write_text_atomic)
from graphopt.stage import TIME_LIMIT
from graphopt.validate import check_model
from kerneltune import cli as kerneltune_cli
from kerneltune.scheduler import SCHEDULERS
from kerneltune.searchers import SEARCHERS
from kerneltune.targets.parse import TARGET_HELP, check_name
from kerneltune.targets.registry import KINDS
from kerneltune.targets.threads import use_threads
from pipeline.layout.modes import LAYOUT_HELP, LAYOUTS
from pipeline.model_mode import MODEL_MODE
from pipeline.context import PRECISIONS, BuildContext, TuneOptions
from pipeline.optimize_model import OUTPUT_SUFFIX, default_output_dir, optimize_model
from pipeline.quantize import PRECISION_HELP, accuracy_phrase
from pipeline.report import result_line, slower_warning

log = logging.getLogger(__name__)


def console_script(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Run as a console script (``argv`` None: the command line is the process's own), the process's
    temporary files go to a private folder removed at exit, and by the next run after a SIGKILL
    (:func:`graphopt.fileio.private_tempdir`); called in-process with an argument list (tests), the
    caller's temporary folder is left alone."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        if argv is None:
            with contextlib.suppress(OSError):  # an unwritable /tmp: the system's folder, as before
                private_tempdir()
        return main(argv)

    return wrapper


def _common(p: argparse.ArgumentParser, ranges: bool = False) -> None:
    """The model options every model command takes; ``ranges``: ``--dim NAME=LO:HI`` is taken (optimize-model:
    one build serving a range of sizes)."""
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--target", default="llvm", help=f"{TARGET_HELP} (default llvm)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for TVM and onnxruntime (default: the cores this process may use)")
    p.add_argument("--input-shape", action="append", metavar="NAME=D1,D2,...",
                   help="fix a dynamic input's shape (repeatable; needed where a dimension has no name, else --dim)")
    p.add_argument("--dim", action="append", metavar="NAME=N|LO:HI" if ranges else "NAME=N",
                   help=RANGE_HELP if ranges else DIM_HELP)
    p.add_argument("--inputs", metavar="FILE.npz", help="sample inputs (numpy.savez(FILE, name=array, ...)) used for "
                                                        "every check and timing; their shapes fix the input shapes")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random check inputs")
    p.add_argument("--layout", default="auto", choices=LAYOUTS, help=LAYOUT_HELP)


def set_threads(threads: int | None) -> int:
    """Fix the thread count for TVM's pool before it starts; returns the count used."""
    return use_threads(threads)


def build_optimize_parser() -> ArgumentParser:
    """optimize-model's options (pipeline.optimize takes each of them too: tests/test_deploy.py checks)."""
    p = ArgumentParser(prog="optimize-model", description="Optimize an ONNX model and compile it with TVM.")
    _common(p, ranges=True)
    p.add_argument("-o", "--output", metavar="DIR",
                   help="output directory: optimized.onnx, model.so, report.json, report.md (default: the model's "
                        f"name + {OUTPUT_SUFFIX} in the current folder, e.g. ./bert_tiny{OUTPUT_SUFFIX})")
    p.add_argument("--skip-graph", action="store_true", help="skip the graph substitution stage")
    p.add_argument("--time-limit", type=seconds, default=TIME_LIMIT, metavar="SECONDS",
                   help=f"bound on the whole graph stage: pricing, search, end-to-end timing (default {TIME_LIMIT:g})")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help=PRECISION_HELP)
    p.add_argument("--calibration", metavar="FILE.npz",
                   help="with --precision int8: N sample sets stacked on a new first axis (each array "
                        "[N, *input shape]), to calibrate on and measure the accuracy vs fp32 on")
    t = p.add_argument_group("kernel tuning")
    t.add_argument("--trials", type=int, default=0, help="measurements over all tasks (default 0: no tuning)")
    t.add_argument("--kernels", metavar="SEL", help="tasks to tune: indices (0,3), op kinds (matmul) or name "
                                                     "globs ('fused_matmul_add*'); see tune-kernels MODEL --list")
    t.add_argument("--scheduler", default="gradient", choices=tuple(SCHEDULERS),
                   help="how trials are spread over tasks (default gradient)")
    t.add_argument("--searcher", default="opevo", help=f"{' | '.join(SEARCHERS)} (default opevo)")
    t.add_argument("--records", metavar="FILE", help="tuning records to resume from / append to "
                                                     "(default DIR/records.jsonl)")
    t.add_argument("--rpc", metavar="HOST:PORT:KEY", help="measure on a remote device through a TVM RPC tracker")
    kerneltune_cli.add_stop_arguments(t, "kernel tuning alone (the graph stage has --time-limit)",
                                      "its remaining trials go to the other tasks")
    t.add_argument("--skip-tune", action="store_true", help="no tuning even with --trials: default schedules")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


@console_script
@cli_entry
def optimize_model_main(argv: list[str] | None = None) -> int:
    args = build_optimize_parser().parse_args(argv)
    tuning = TuneOptions(trials=args.trials, kernels=args.kernels, scheduler=args.scheduler, searcher=args.searcher,
                         records=args.records, rpc=args.rpc, skip=args.skip_tune, progress=not args.no_progress,
                         timeout=args.timeout, early_stop=args.early_stop).validate()
    threads = set_threads(args.threads)
    ctx = BuildContext.create(args.target, threads=threads, seed=args.seed, tuning=tuning, layout=args.layout,
                              skip_graph=args.skip_graph, graph_time_limit=args.time_limit,
                              input_shapes=shape_request(args.input_shape, args.dim, ranges=True), inputs=args.inputs,
                              precision=args.precision, calibration=args.calibration)
    out = args.output if args.output is not None else default_output_dir(args.model)
    res = optimize_model(args.model, out, ctx)
    comp = res.report["stages"]["compile"]
    check = f"{comp['checked']}: max abs err {comp['max_abs_err']:.3g}, max rel err {comp['max_rel_err']:.3g}"
    if comp.get("top1_agreement") is not None:
        check += f", top-1 agreement {comp['top1_agreement']:.1%}"
    if comp.get("not_run"):
        check += f"; kernels not run: {comp['not_run']}"
    if accuracy_phrase(res.report.get("precision")):
        check += f"; {accuracy_phrase(res.report['precision'])}"
    note = res.report["stages"].get("tune", {}).get("e2e", {}).get("note")
    if note:
        log.warning("note: %s", note)
    slower = slower_warning(res.report["latency"], tuned=not res.report["stages"]["tune"].get("skipped"),
                            layout=((res.report["stages"].get("partition") or {}).get("layout") or {}).get("mode"),
                            convs=any(t["kind"].startswith("conv") for t in res.report["tasks"]))
    if slower:
        log.warning("%s", slower)
    for name, value in ((res.report.get("specialized") or {}).get("values") or {}).items():
        log.warning("note: model.so is built for %s=%s only (it decides %s); run-model and pipeline.load refuse "
                    "other values", name, value, res.report["specialized"]["why"][name])
    dynamic = res.report["dynamic_shapes"]
    if dynamic["reason"]:  # the input had symbolic sizes the optimized graph could not keep
        log.warning("note: %s", dynamic["reason"])
    print(result_line(res.report, display_path(res.out_dir), check))  # last: what a user reads first
    return 0


RUNS_DEFAULT, REPEAT_DEFAULT = 30, 50  # bench-model --runs (per engine), run-model --repeat


def timing_plan(runs: int | None, duration: float | None, warmup: int, runs_flag: str, default_runs: int):
    """bench-model's and run-model's timing options as a :class:`graphopt.timing.Plan`: a number of runs or a
    duration (one of them), and the warm-up; checked before any work."""
    from graphopt.timing import Plan

    if runs is not None and duration is not None:
        raise UserError(f"{runs_flag} {runs} and --duration {duration:g} both given: time a number of runs or a "
                        "duration, drop one")
    if runs is not None and runs < 1:
        raise UserError(f"{runs_flag} {runs}: give at least 1 run")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: give 0 or more untimed warm-up calls")
    return Plan(default_runs if runs is None else runs, warmup, duration)


def _timing_options(p: argparse.ArgumentParser, runs_flag: str, runs_help: str, warmup_help: str,
                    what: str = "") -> None:
    """``--runs``/``--repeat``, ``--duration`` and ``--warmup``: bench-model's and run-model's, worded alike
    (``what``: whose time --duration bounds, e.g. "each engine")."""
    from graphopt.timing import WARMUP

    p.add_argument(runs_flag, type=int, default=None, metavar="N", help=runs_help)
    p.add_argument("--duration", type=seconds, metavar="SECONDS",
                   help=f"time {what + ' ' if what else ''}for about SECONDS instead of {runs_flag} N (a 0.1 ms model "
                        "gets many runs, a slow one few); the throughput (inferences/s) is printed beside the "
                        "latency either way")
    p.add_argument("--warmup", type=int, default=WARMUP, metavar="N", help=f"{warmup_help} (default {WARMUP})")


def _check_figure_outputs(json_path: str | None, plot_path: str | None) -> None:
    """bench-model's --json and --plot, writable and of a known figure format, before any timing."""
    if json_path:
        check_output_file(json_path, "--json")
    if plot_path:
        check_figure_path(plot_path, "--plot")


def check_figure_path(path: str, option: str) -> None:
    """A figure's output path: writable, and of a format matplotlib writes."""
    check_output_file(path, option)
    if Path(path).suffix.lstrip(".").lower() not in FIGURE_FORMATS:
        raise UserError(f"{option} {path!r}: name a .png, .pdf or .svg file")


# bench-model's options that only a rebuild uses, with their defaults: given with a folder, they are refused
REBUILD_ONLY = {"trials": 0, "kernels": None, "work_dir": None, "skip_graph": False, "skip_metaschedule": False,
                "target": "llvm", "input_shape": None, "layout": "auto"}


@console_script
@cli_entry
def bench_model_main(argv: list[str] | None = None) -> int:
    """``bench-model``: a shipped build (an optimize-model folder) or a rebuild of MODEL against onnxruntime and
    OpenVINO."""
    p = ArgumentParser(prog="bench-model", description="Latency and throughput of a TVM build against onnxruntime "
                       "(and OpenVINO when installed), same inputs and threads. Given the -o folder of "
                       "optimize-model, times its model.so as shipped; given an ONNX model, rebuilds it "
                       "(default schedules, + graphopt, + tuning, MetaSchedule) and times each build. Ratios are "
                       "ours / theirs: 0.56x onnxruntime's time is faster.")
    _common(p)
    positional = next(a for a in p._actions if a.dest == "model")  # _common's, worded for bench-model
    positional.metavar, positional.help = "DIR|MODEL", ("the -o folder of optimize-model (times its model.so as "
                                                        "shipped), or an ONNX model file (rebuilds it)")
    dim = next(a for a in p._actions if a.dest == "dim")
    dim.metavar, dim.help = "NAME=N[,N...]", (f"with MODEL: {DIM_HELP}; with DIR of a build serving a range "
                                               "(--dim NAME=LO:HI): the sizes to time it at, a table each and one "
                                               "row per size (--dim sequence=16,128,384)")
    _timing_options(p, "--runs", f"timed runs per engine (default {RUNS_DEFAULT})",
                    "untimed calls at the start of each engine's block of runs", "each engine")
    p.add_argument("--trials", type=int, default=0,
                   help="also tune (ours and MetaSchedule) with this many trials each (default 0: no tuning)")
    p.add_argument("--kernels", metavar="SEL", help="tasks our tuner works on (see optimize-model --kernels)")
    p.add_argument("--scheduler", default="gradient", choices=tuple(SCHEDULERS))
    p.add_argument("--searcher", default="opevo", help=f"{' | '.join(SEARCHERS)} (default opevo)")
    p.add_argument("--work-dir", metavar="DIR", help="tuning records of both tuners; rerunning resumes")
    p.add_argument("--skip-graph", action="store_true", help="no graphopt engine (tuning uses the original graph)")
    p.add_argument("--skip-metaschedule", action="store_true", help="no MetaSchedule engine (it is slow)")
    p.add_argument("--json", metavar="FILE", help="write ort_ms, openvino_ms, shipped_ms, tvm_ms, graphopt_ms, "
                                                  "tuned_ms, metaschedule_ms (medians), latency (percentiles per "
                                                  "engine), throughput, ratios (ours / onnxruntime's), skipped "
                                                  "(engine: why), shipped (the folder, or \"rebuilt\"), warmup, "
                                                  "duration, runs, max_abs_err, trials to FILE")
    p.add_argument("--plot", metavar="FILE.png", help=f"bar chart of the latencies ({', '.join(FIGURE_FORMATS)})")
    p.add_argument("--profile", action="store_true",
                   help="also print where the time goes: with DIR, each kernel named by the ONNX nodes it computes "
                        "beside onnxruntime's own profile of them (as run-model --profile, and in --json); with "
                        "MODEL, the time per kernel (slowest first) of the best TVM engine")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    plan = timing_plan(args.runs, args.duration, args.warmup, "--runs", RUNS_DEFAULT)
    if Path(args.model).is_dir():
        return _bench_folder(args, plan)
    return _bench_rebuild(args, plan)


def _bench_folder(args: argparse.Namespace, plan) -> int:
    """``bench-model DIR``: the shipped model.so against the peers (:mod:`pipeline.bench_shipped`)."""
    for dest, default in REBUILD_ONLY.items():
        if getattr(args, dest) != default:
            flag = "--" + dest.replace("_", "-")
            raise UserError(f"{flag} applies to a rebuild; bench-model {args.model} times the shipped build as it is: "
                            f"drop {flag}, or give the ONNX model to rebuild it")
    from pipeline.artifact import REPORT, read_report

    if not (Path(args.model) / REPORT).is_file():
        raise UserError(f"{args.model!r} is a directory without {REPORT}: give the -o folder of a complete "
                        "optimize-model build, or an ONNX model file to rebuild")
    read_report(args.model)  # a folder that is no complete build: one line, before anything loads
    _check_figure_outputs(args.json, args.plot)
    threads = set_threads(args.threads)
    from pipeline.bench_shipped import bench_shipped  # deferred: loads TVM (seconds)

    from pipeline.artifact import Model

    model = Model(args.model, read_report(args.model), threads)  # loaded once, timed at every size
    results = [bench_shipped(model, plan, threads, args.inputs, args.seed, args.profile, sizes)
               for sizes in sized_runs(args)]  # a build serving a range: --dim sequence=16,128,384, a table each
    if len(results) == 1:
        _bench_outputs(results[0], args)
    else:
        _bench_length_outputs(results, args)
    for res in results:
        if res.layers is not None:
            from pipeline.pricing.layer_profile import format_profile

            print(format_profile(res.layers))
    return 0


def _bench_length_outputs(results: list, args: argparse.Namespace) -> None:
    """bench-model DIR at several sizes: each size's table, then one row per size; --json holds every size's
    result, --plot the latency over the size."""
    from pipeline import benchmark

    for res in results:
        print(f"at {sizes_text(res.sizes)}:")
        print(benchmark.format_table(res))
    print(benchmark.format_lengths(results))
    if args.json:
        write_text_atomic(args.json, json.dumps({"lengths": [r.to_json() for r in results]}, indent=2) + "\n")
    if args.plot:
        benchmark.plot_lengths(results, args.plot)


def _bench_outputs(res, args: argparse.Namespace) -> None:
    """The table on stdout, and the --json and --plot files."""
    from pipeline import benchmark

    print(benchmark.format_table(res))
    if args.json:
        benchmark.write_json(res, args.json)
    if args.plot:
        benchmark.plot(res, args.plot)


def _bench_rebuild(args: argparse.Namespace, plan) -> int:
    """``bench-model MODEL``: every engine compiled again from MODEL, then timed together."""
    tuning = TuneOptions(args.trials, args.kernels, args.scheduler, args.searcher,
                         progress=not args.no_progress).validate()
    threads = set_threads(args.threads)
    ctx = BuildContext.create(args.target, threads=threads, seed=args.seed, tuning=tuning, layout=args.layout,
                              skip_graph=args.skip_graph)
    _check_figure_outputs(args.json, args.plot)
    if args.work_dir:
        check_output_dir(args.work_dir, "--work-dir")
    model = check_model(args.model, shape_request(args.input_shape, args.dim), args.inputs)  # before TVM loads
    ctx = ctx.with_model(model.samples)
    # the first line: a user who meant to time what optimize-model shipped learns how
    print(f"bench-model rebuilds {args.model}; to time a shipped build give its -o folder", flush=True)
    from pipeline import benchmark  # deferred: loads TVM (seconds)

    if args.trials > 0 and not args.skip_metaschedule:
        from pipeline.metaschedule import check_installed

        check_installed()

    spec = ctx.spec
    if not spec.can_run:
        raise UserError(f"cannot benchmark --target {spec.kind} here: {spec.note}")
    opts = benchmark.BenchOptions(args.skip_metaschedule, args.work_dir)
    imported, engines, choice, seconds = benchmark.compile_engines(model, ctx, opts)
    res = benchmark.bench(imported, engines, ctx, plan, os.path.basename(args.model), choice)
    res.stage_seconds = seconds
    _bench_outputs(res, args)
    if args.profile:
        best = min(engines, key=lambda k: res.timings[k].median_ms)
        print(f"kernels of '{benchmark.ENGINES[best]}':")
        print(benchmark.format_profile(benchmark.profile_kernels(engines[best], imported, seed=args.seed,
                                                                 samples=model.samples)))
    return 0


@console_script
@cli_entry
def run_model_main(argv: list[str] | None = None) -> int:
    """``run-model``: load a built folder, run it, report latency percentiles; optionally check it."""
    p = ArgumentParser(prog="run-model", description="Run a folder built by optimize-model: latency percentiles, "
                       "throughput, outputs, and a check against onnxruntime on its optimized.onnx "
                       "(bench-model DIR times it against onnxruntime and OpenVINO).")
    p.add_argument("dir", metavar="DIR", help="the -o folder of optimize-model (model.so, report.json)")
    p.add_argument("--inputs", metavar="FILE.npz", help="inputs (numpy.savez(FILE, name=array, ...)); default: "
                                                        "seeded random inputs of the compiled shapes")
    _timing_options(p, "--repeat", f"timed runs, back to back (default {REPEAT_DEFAULT})",
                    "untimed calls before the timed runs")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for TVM (default: the cores this process "
                                                             "may use; with --rpc: the device server's own)")
    p.add_argument("--rpc", metavar="HOST:PORT:KEY", help="run on the device a TVM RPC tracker hands out under KEY "
                                                          "(or HOST:PORT of an RPC server): model.so is uploaded there")
    p.add_argument("--check", action="store_true", help="compare the outputs with onnxruntime on optimized.onnx")
    p.add_argument("--outputs", metavar="FILE.npz", help="write the outputs of one run")
    p.add_argument("--json", metavar="FILE", help="write p50_ms, p90_ms, p99_ms, mean_ms, min_ms, runs, throughput "
                                                  "(inferences/s), timed_s, warmup, duration, threads, shipped "
                                                  "(the folder timed) and the check to FILE")
    p.add_argument("--profile", action="store_true",
                   help="time each kernel call and print where the time goes: per kernel its time, share, GFLOP/s "
                        "and %% of this CPU's roofline, named by the ONNX nodes of optimized.onnx it computes, then "
                        "the same pieces of the model timed by onnxruntime's own profiler (in --json too)")
    p.add_argument("--profile-plot", metavar="FILE.png", help="with --profile: a bar chart of the slowest pieces, "
                                                              "ours beside onnxruntime's")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random inputs")
    p.add_argument("--dim", action="append", metavar="NAME=N[,N...]",
                   help="a build serving a range of sizes (optimize-model --dim NAME=LO:HI): draw the random inputs "
                        "with NAME=N (default: the size it was checked and timed at); several sizes of one "
                        "dimension run one after the other, one line each (--dim sequence=16,128,384)")
    args = p.parse_args(argv)
    runs = sized_runs(args)
    plan = timing_plan(args.repeat, args.duration, args.warmup, "--repeat", REPEAT_DEFAULT)
    for option, path in (("--json", args.json), ("--outputs", args.outputs)):
        if path:
            check_output_file(path, option)
    if args.profile_plot and not args.profile:
        raise UserError("--profile-plot draws the profile: add --profile")
    if args.profile and args.rpc:
        raise UserError("--profile times each kernel call on this machine; over --rpc each call would include the "
                        "network: run run-model --profile on the device itself")
    if args.profile_plot:
        check_figure_path(args.profile_plot, "--profile-plot")
    if args.rpc:
        from kerneltune.runner import check_rpc

        check_rpc(args.rpc)
    threads = set_threads(args.threads)
    from pipeline.artifact import Model, read_report  # deferred with TVM: --help and the checks above stay fast

    model = Model(args.dir, read_report(args.dir), args.threads if args.rpc else threads, args.rpc)
    results, differ = [], None
    for sizes in runs:
        feeds = model.read_inputs(args.inputs, args.seed) if args.inputs else model.random_feeds(args.seed, sizes)
        outputs = model.run(feeds)
        stats = model.latency(feeds, plan.runs, plan.warmup, plan.duration_s)
        result = ({"sizes": sizes} if sizes else {}) | dataclasses.asdict(stats)
        at = f" at {sizes_text(sizes)}" if sizes else ""
        line = f"{args.dir}{at}: {_latency_words(stats, plan.warmup, model.threads, args.rpc)}"
        if args.check:
            comp = model.check(feeds)
            result["check"] = comp.to_dict()
            line += f"; vs onnxruntime: {'ok' if comp.ok else 'DIFFERENT'}, max abs err {comp.max_abs_err:.3g}"
            differ = differ or (None if comp.ok else f"{at}: {comp.reason()}")
        print(line, flush=True)
        if args.profile:
            result["profile"] = _profile(model, feeds, plan.runs or REPEAT_DEFAULT, args.profile_plot)
        bad = [k for k, v in outputs.items() if v.dtype.kind in "fc" and not np.isfinite(v).all()]
        if bad:
            log.warning("warning: outputs %s hold NaN or Inf", ", ".join(bad))
        results.append(result)
    if args.outputs:  # the last run's
        buf = io.BytesIO()
        np.savez(buf, **outputs)
        write_bytes_atomic(args.outputs, buf.getvalue())
    if args.json:
        head = {"dir": str(args.dir), "threads": model.threads, "rpc": args.rpc, "shipped": str(args.dir),
                "warmup": plan.warmup, "duration": plan.duration_s}
        body = results[0] if len(results) == 1 else {"runs": results}
        write_text_atomic(args.json, json.dumps(head | body, indent=2) + "\n")
    if differ:
        raise UserError(f"the outputs differ from onnxruntime on optimized.onnx{differ}")
    return 0


def _profile(model, feeds: dict, runs: int, plot: str | None) -> dict:
    """run-model --profile for one set of inputs: printed, drawn (``plot``) and returned for --json."""
    from pipeline.pricing import layer_profile

    runs = max(3, min(runs, 20))  # a profile averages a few runs; the instrument makes each slower
    profile = layer_profile.profile_shipped(model, feeds, runs)
    profile = layer_profile.with_ort(profile, model.graph_path(), feeds, model.threads or 1, runs)
    print(layer_profile.format_profile(profile), flush=True)
    if plot:
        layer_profile.plot_profile(profile, plot)
    return profile.to_json()


def sized_runs(args: argparse.Namespace) -> list[dict[str, int]]:
    """run-model's and bench-model DIR's ``--dim NAME=N[,N...]``: the sizes to run a build serving a range at,
    one dict per run (``[{}]`` without ``--dim``); refused beside ``--inputs``, which brings its own sizes."""
    if args.dim and args.inputs:
        raise UserError("--dim sizes the random inputs; --inputs gives its own: drop one")
    return parse_size_lists(args.dim)


def _latency_words(stats, warmup: int, threads: int | None, rpc: str | None) -> str:
    """run-model's figures for one size: the percentiles, the throughput, and how they were taken."""
    where = f" on {rpc}" if rpc else ""
    return (f"p50 {stats.p50_ms:.3f} ms, p90 {stats.p90_ms:.3f} ms, p99 {stats.p99_ms:.3f} ms, mean "
            f"{stats.mean_ms:.3f} ms, {stats.throughput:.1f} inferences/s ({stats.runs} runs in {stats.timed_s:.2f} s "
            f"after {warmup} warm-up, {threads} threads{where})")


def _tvm_runner(threads: int, target: str = "llvm") -> GraphRunner:
    """``graphopt optimize --backend tvm``'s runner: it builds for ``--target`` as parsed (``-mcpu``/``-mattr``
    included), its spec made from that request when first needed, as optimize-model's BuildContext makes
    its own."""
    # Deferred: importing the TVM runner loads TVM (seconds); `graphopt rules ...` and --help never need it.
    from pipeline.pricing.graph_runner import TvmRunner
    from pipeline.stages import compile_graph, compile_model, kernel_times

    return TvmRunner(compile_graph, threads, price_kernels=kernel_times, compile_model=compile_model,
                     request=check_name(target))


def _ort_runner(threads: int, target: str = "llvm") -> GraphRunner:
    """onnxruntime's runner: it runs on this CPU whatever ``--target`` names."""
    return OrtRunner(threads)


GRAPHOPT_COMPONENTS = graphopt_cli.Components(
    runners={"tvm": _tvm_runner, "ort": _ort_runner},
    target_kinds=KINDS,
    check_target=lambda name: check_name(name).cost_kind,
)


@console_script
@cli_entry
def graphopt_main(argv: list[str] | None = None) -> int:
    """``graphopt``: graphopt's own CLI with the TVM engine plugged into its measured cost model."""
    return graphopt_cli.main(argv, GRAPHOPT_COMPONENTS)


@console_script
@cli_entry
def tune_kernels_main(argv: list[str] | None = None) -> int:
    """``tune-kernels``: kerneltune's single-operator CLI plus the pipeline's model mode (``MODEL --list``)."""
    return kerneltune_cli.main(argv, MODEL_MODE)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(optimize_model_main())
