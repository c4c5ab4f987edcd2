"""``tune-kernels``: tune one operator with a searcher, record every measurement, report the best kernel.

    tune-kernels --op matmul --shape 128,768,768 --target llvm --searcher opevo --trials 64 --seed 0 \\
                 --records mm.jsonl --json mm.json

SHAPE is ``M,K,N`` for matmul (A is MxK, B is KxN), ``B,M,K,N`` for batch_matmul and ``N,C,H,W,F,KH,KW`` for
conv2d (NCHW input, F output channels).  The JSON printed (and written with ``--json``) is
``{"best_gflops", "best_ms", "best_config", "trials", "numpy_gflops", ...}``; ``numpy_gflops`` is numpy's
(OpenBLAS) matmul on the same shape with the same threads (``numpy_threads``), timed in the same run before
the tuner's workers start, for matmul measured here only (null otherwise: :mod:`kerneltune.baseline`).  The first
trial is the template's default config (the warm start every searcher gets, :func:`kerneltune.tune.tune`).
Rerunning the same command with the same ``--records`` resumes: the search runs again, finds what the
interrupted run measured in the records and measures only the rest (:mod:`kerneltune.tune`).  ``--timeout``
and ``--early-stop`` end the search before ``--trials`` are spent (:mod:`kerneltune.stopping`); the JSON's
``stop_reason`` says what ended it.

Structure: :func:`build_parser` declares the options, :func:`run_operator` does the single-operator mode.
A model mode (``tune-kernels MODEL --trials N``, ``tune-kernels MODEL --list``) belongs to the pipeline, which
owns model import: the console script is composed in :mod:`pipeline.cli` and passes it in as a
:class:`ModelMode`, leaving the single-operator path untouched.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

from graphopt.errors import ArgumentParser, UserError, seconds, seed
from graphopt.fileio import check_output_file, write_text_atomic
from graphopt.limits import TensorSize, check_memory, check_threads
from kerneltune.baseline import numpy_baseline
from kerneltune.records import RecordLog
from kerneltune.searchers import FACTOR_ONLY, SEARCHERS, check_searcher, make_searcher
from kerneltune.opkinds import KINDS, OP_KINDS, op_kind, operand_shapes, parse_shape
from kerneltune.stopping import StopReason, StopRule
from kerneltune.targets.host import default_threads, num_cores
from kerneltune.targets.parse import TARGET_HELP, build_spec, check_name
from kerneltune.targets.registry import TargetRequest, gflops_ceiling
from kerneltune.tune import TaskRecords, TaskTuner, run_task

log = logging.getLogger(__name__)

OP_TRIALS = 64  # --trials of the single-operator mode when not given (a model's run needs it given)


@dataclass(frozen=True)
class ModelMode:
    """A mode working on a whole model, plugged in by the composition root (:mod:`pipeline.cli`)."""

    add_arguments: Callable[[argparse.ArgumentParser], None]  # its options (e.g. a positional MODEL)
    selected: Callable[[argparse.Namespace], bool]  # whether the parsed options ask for it
    run: Callable[[argparse.Namespace], int]  # the mode itself; returns the exit code


def add_stop_arguments(group, what: str, retired: str) -> None:
    """``--timeout`` and ``--early-stop`` (:mod:`kerneltune.stopping`), worded for the command's ``what`` (what
    the timeout bounds) and ``retired`` (where a stopped task's trials go); tune-kernels and optimize-model."""
    group.add_argument("--timeout", type=seconds, metavar="SECONDS",
                       help=f"wall-clock bound on {what}: no new trial starts after it, the best configs measured "
                            "so far are used (default: none)")
    group.add_argument("--early-stop", type=int, metavar="N",
                       help="a task stops after N trials in a row without beating its best by more than 1%% "
                            f"(timing noise); {retired} (default: off)")


def build_parser(model_mode: ModelMode | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tune-kernels", description="Tune a tensor operator's schedule, or a model's fused "
                       "kernels (tune-kernels MODEL --trials N), with OpEvo or a baseline searcher.")
    if model_mode is not None:
        model_mode.add_arguments(p)
    op = p.add_argument_group("single operator")
    op.add_argument("--op", help=f"operator: {', '.join(KINDS)}")
    op.add_argument("--shape", help=" | ".join(f"{k.shape} ({k.name})" for k in OP_KINDS.values()))
    op.add_argument("--transpose-a", action="store_true", help="matmuls: A is stored transposed")
    op.add_argument("--transpose-b", action="store_true", help="matmuls: B is stored transposed")
    op.add_argument("--stride", type=int, help="conv2d stride (default 1)")
    op.add_argument("--pad", type=int, help="conv2d padding (default 0)")
    op.add_argument("--groups", type=int, help="conv2d groups (default 1)")
    tune = p.add_argument_group("tuning")
    tune.add_argument("--target", default="llvm", help=f"{TARGET_HELP} (default llvm)")
    tune.add_argument("--searcher", default="opevo", help=f"{' | '.join(sorted(SEARCHERS))} (default opevo)")
    tune.add_argument("--trials", type=int, metavar="N",
                      help=f"configs to measure in total, the first the template's default: with --op default "
                           f"{OP_TRIALS}; with MODEL required (no default: spread over the selected tasks, it "
                           "decides how long the run takes)")
    add_stop_arguments(tune, "the tuning", "with MODEL its remaining trials go to the other tasks")
    tune.add_argument("--seed", type=seed, default=0, help="searcher seed (default 0)")
    tune.add_argument("--records", metavar="FILE",
                      help="JSON-lines records file, appended to; the same command again resumes from it (with "
                           "MODEL: default MODEL-NAME.records.jsonl here, the format optimize-model --records reads)")
    tune.add_argument("--json", metavar="FILE", help="also write the result JSON to this file (with MODEL: each "
                                                     "task's default and best time and config, and why tuning "
                                                     "stopped)")
    tune.add_argument("--threads", type=int, help="CPU threads for the kernels (default: all this process may use)")
    tune.add_argument("--rpc", help="measure on a remote device: TRACKER_HOST:PORT:KEY")
    tune.add_argument("--workers", type=int, help="parallel build processes (default: cores, at most 4)")
    tune.add_argument("--cache-flush", action="store_true",
                      help="time each call with the operands other than the first flushed from the CPU caches, as "
                           "a weight is inside a model (optimize-model tunes this way; default: warm caches, "
                           "comparable with numpy's repeated calls)")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_operator_args(args: argparse.Namespace) -> TargetRequest:
    """Every mistake that needs no TVM is caught here, before seconds of imports; returns ``--target`` read."""
    if not args.op:
        raise UserError(f"--op is required: one of {', '.join(KINDS)}")
    kind = op_kind(args.op)
    if not args.shape:
        raise UserError("--shape is required (" + ", ".join(f"{k.shape} for {k.name}" for k in OP_KINDS.values())
                        + ")")
    dims = parse_shape(args.op, args.shape)
    check_searcher(args.searcher)
    if args.trials is None:
        args.trials = OP_TRIALS
    if args.trials <= 0:
        raise UserError("--trials must be positive")
    stop_rule(args)
    shapes = operand_shapes(args.op, dims, args.stride or 1, args.pad or 0, args.groups or 1)
    # Extents beyond memory are refused here: the templates enumerate each axis's divisors.
    check_memory([TensorSize(name, shape, "float32", "input") for name, shape in shapes.items()],
                 hint="give a smaller --shape")
    check_threads(args.threads)
    check_threads(args.workers, "--workers")
    check_output_paths(args)
    for names, given in ((("transpose_a", "transpose_b"), args.transpose_a or args.transpose_b),
                         (("stride", "pad", "groups"), any(getattr(args, n) is not None for n in ("stride", "pad", "groups")))):
        if given and not set(names) <= set(kind.options):
            takers = [k.name for k in OP_KINDS.values() if set(names) <= set(k.options)]
            raise UserError(f"{'/'.join('--' + n.replace('_', '-') for n in names)} apply to {' and '.join(takers)} only")
    return check_name(args.target)


def stop_rule(args: argparse.Namespace) -> StopRule:
    """``--timeout`` and ``--early-stop`` as a checked :class:`~kerneltune.stopping.StopRule` (one line for a
    value no run can take)."""
    return StopRule(args.timeout, args.early_stop).validate()


def check_output_paths(args: argparse.Namespace) -> None:
    """--records and --json are writable files, checked before any tuning."""
    if args.records:
        check_output_file(args.records, "--records")
    if args.json:
        check_output_file(args.json, "--json")


def run_operator(args: argparse.Namespace) -> dict[str, Any]:
    """Tune one operator; returns the result dict (also printed / written by :func:`main`)."""
    request = _check_operator_args(args)
    # Deferred: these load TVM (seconds); --help and every argument check above run without it.
    from kerneltune import templates
    from kerneltune.measure import Measurer
    from kerneltune.task import make_task

    task = make_task(args.op, args.shape, args.transpose_a, args.transpose_b, args.stride or 1, args.pad or 0,
                     args.groups or 1)
    spec = build_spec(request, args.threads)
    if not spec.can_run and not args.rpc:
        raise UserError(f"cannot measure on {args.target} here ({spec.note}); pass --rpc HOST:PORT:KEY of a "
                        "TVM RPC tracker with that device")
    if args.rpc:
        from kerneltune.runner import check_device

        check_device(args.rpc)  # an unreachable device: one line now, not a run of failed trials
    space = templates.space_for(task, spec.target)
    default = templates.default_config(task, spec.target)
    fixed = None
    if args.searcher in FACTOR_ONLY and not space.factor_only:
        fixed = default
        others = [k.name for k in space.knobs if type(k).__name__ != "FactorKnob"]
        log.warning("note: %s searches factor knobs only; %s stay at the default config", args.searcher, others)
    searcher = make_searcher(args.searcher, space, args.seed, fixed=fixed)
    # numpy's matmul with the kernel's threads, timed now: no tuner worker runs yet (the measurer starts at
    # the first batch).  Not with --rpc: the kernels run on another machine than numpy would.
    threads = num_cores(spec.target, default=0) or default_threads()
    baseline = (numpy_baseline(task.dims["M"], task.dims["K"], task.dims["N"], threads)
                if task.kind == "matmul" and not args.rpc else None)
    np_gflops = baseline.gflops if baseline else None
    target_key = str(spec.target)
    cache_flush = args.cache_flush and spec.target.kind.name == "llvm"  # a CPU-cache flush; GPUs ignore it
    records = RecordLog(args.records) if args.records else None
    measurer: list[Measurer] = []   # started on the first batch: a finished, resumed run spawns no workers

    def measure(configs):
        if not measurer:
            measurer.append(Measurer(spec.target, rpc=args.rpc, workers=args.workers, cache_flush=cache_flush))
        return measurer[0].measure(task, configs)

    stop = stop_rule(args)
    try:
        tuner = TaskTuner(space, searcher, measure, TaskRecords(task.key, target_key, records,
                                                                "cold" if cache_flush else "warm", task.flops,
                                                                gflops_ceiling(spec.target)), stop=stop)
        res = run_task(tuner, args.trials, warm_start=default, deadline=stop.deadline(),
                       progress=not args.no_progress, desc=task.name)
    finally:
        for m in measurer:
            m.close()
        if records is not None:
            records.close()
    return {
        "best_gflops": res.best_gflops,
        "best_ms": res.best_latency_s * 1e3 if res.best_latency_s else None,
        "best_config": space.as_dict(res.best_config) if res.best_config is not None else None,
        "trials": res.trials,
        "numpy_gflops": np_gflops,
        "numpy_threads": baseline.threads if baseline else None,
        "speedup_vs_numpy": res.best_gflops / np_gflops if np_gflops else None,
        "task": task.key,
        "target": target_key,
        "searcher": args.searcher,
        "seed": args.seed,
        "measured_now": res.measured_now,
        "failures": res.failures,
        "default_ms": res.warm_start_latency_s * 1e3 if res.warm_start_latency_s else None,
        "stop_reason": res.stop_reason.value,
        "timeout_s": args.timeout,
        "early_stop": args.early_stop,
    }


def main(argv: list[str] | None, model_mode: ModelMode | None = None) -> int:
    """Run ``tune-kernels`` (wrapped by :func:`graphopt.errors.cli_entry` in the console script)."""
    args = build_parser(model_mode).parse_args(argv)
    if model_mode is not None and model_mode.selected(args):
        return model_mode.run(args)
    if getattr(args, "kernels", None):
        raise UserError(f"--kernels {args.kernels} picks tasks of a MODEL: tune-kernels MODEL --kernels SEL "
                        "--trials N (an --op is one task)")
    result = run_operator(args)
    text = json.dumps(result, indent=2, default=list)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    if result["stop_reason"] != StopReason.BUDGET.value:
        log.warning("note: tuning stopped after %d of %d trials: %s", result["trials"], args.trials,
                    StopReason(result["stop_reason"]).phrase)
    if result["best_config"] is None:
        print("error: no config built and ran correctly; the records say why each one failed", file=sys.stderr)
        return 1
    return 0
