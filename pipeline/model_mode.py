"""``tune-kernels MODEL``: a model's fused kernels as tuning tasks.  Plugged into kerneltune's CLI (which owns
the single-operator mode) as :data:`MODEL_MODE`; three things it does:

- ``tune-kernels MODEL --trials N [--kernels SEL]``: tune the tasks (every tunable one without ``--kernels``)
  with optimize-model's own tuning stage (:func:`pipeline.tuning.tune_model`: the same lowering, task
  scheduler, measurer and records), print each task's default and best kernel time and config, and append
  every trial to ``--records`` (default ``MODEL-NAME.records.jsonl`` here) in the format optimize-model reads:
  ``optimize-model MODEL --records FILE`` with the same ``--trials``, ``--kernels``, ``--seed``, ``--target``
  and ``--threads`` finds every trial there and measures nothing again (the graph stage may change some of
  the kernels; ``--skip-graph`` keeps them all).  ``--trials`` has no default here: spread over a model's
  tasks a budget decides how long the run takes, so it is asked for, as optimize-model asks for it with
  ``--kernels``.
- ``tune-kernels MODEL --list``: the tasks, with the indices ``--kernels`` takes.
- ``tune-kernels MODEL --records FILE --export-metaschedule DIR``: their best tuned schedules as a
  MetaSchedule database (:mod:`pipeline.ms_export`).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphopt.dims import DIM_HELP, shape_request
from graphopt.errors import UserError
from graphopt.fileio import check_output_dir, check_output_file, display_path, write_text_atomic
from graphopt.validate import check_model
from kerneltune.cli import ModelMode
from kerneltune.opkinds import KINDS as OP_KINDS
from kerneltune.scheduler import SCHEDULERS
from kerneltune.stopping import StopReason
from kerneltune.targets.parse import check_name
from kerneltune.targets.threads import use_threads
from pipeline.context import BuildContext, TuneOptions
from pipeline.layout.modes import LAYOUT_HELP, LAYOUTS

if TYPE_CHECKING:  # kerneltune.tune_tasks loads TVM: not before the cheap checks, never for --help
    from kerneltune.tune_tasks import TaskTuning, TuningResult

# MODEL's records without --records: models/bert_tiny.onnx -> ./bert_tiny.records.jsonl
RECORDS_SUFFIX = ".records.jsonl"
# The single-operator options, and what a MODEL's run does instead of each.
OP_ONLY = {"shape": "--shape", "transpose_a": "--transpose-a", "transpose_b": "--transpose-b", "stride": "--stride",
           "pad": "--pad", "groups": "--groups", "workers": "--workers", "cache_flush": "--cache-flush"}
TUNING_OPTIONS = {"trials": "--trials", "kernels": "--kernels", "timeout": "--timeout", "early_stop": "--early-stop",
                  "json": "--json"}


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("model", nargs="?", help="ONNX model: tune its fused kernels (--trials N, --kernels SEL) instead "
                                            "of one --op, --list them, or export their tuned schedules")
    g.add_argument("--list", action="store_true", help="with MODEL: list its tasks (index, kind, calls per "
                                                       "inference, MFLOP per call, what each computes) and exit")
    g.add_argument("--kernels", metavar="SEL",
                   help="with MODEL: the tasks to tune: indices (0,3), op kinds (matmul) or name globs "
                        "('fused_matmul_add*') as --list shows them (default: every tunable task); needs --trials")
    g.add_argument("--scheduler", default="gradient", choices=tuple(SCHEDULERS),
                   help="with MODEL: how --trials are spread over the tasks (default gradient)")
    g.add_argument("--input-shape", action="append", metavar="NAME=D1,D2,...",
                   help="with MODEL: fix a dynamic input's shape (repeatable)")
    g.add_argument("--dim", action="append", metavar="NAME=N", help=f"with MODEL: {DIM_HELP}")
    g.add_argument("--layout", default="auto", choices=LAYOUTS, help=f"with MODEL: {LAYOUT_HELP}")
    g.add_argument("--export-metaschedule", metavar="DIR",
                   help="with MODEL and --records FILE (optimize-model's DIR/records.jsonl; the MODEL, --input-shape, "
                        "--target and --threads of that run): write the best schedule of every tuned task as a "
                        "MetaSchedule JSON database (DIR/database_workload.json, database_tuning_record.json) and "
                        "DIR/model.onnx, the static graph it applies to; TVM's own MetaScheduleApplyDatabase "
                        "(meta_schedule.relax_integration.compile_relax) builds it.  Prints which tasks were "
                        "exported and why any were not")


def default_records(model: str) -> Path:
    """Where a MODEL's trials go without ``--records``: named after the model, in the current folder (as
    optimize-model's output folder is), so a second run resumes and optimize-model can be pointed at it."""
    return Path(Path(model).stem + RECORDS_SUFFIX)


def _given(args: argparse.Namespace, options: dict[str, str]) -> list[str]:
    """The flags of ``options`` on the command line (an unset option is None, an unset switch False)."""
    return [flag for name, flag in options.items()
            if getattr(args, name, None) is not None and getattr(args, name, None) is not False]


def check_mode(args: argparse.Namespace) -> str:
    """Which model mode the options ask for (``"export"``, ``"list"`` or ``"tune"``), or a one-line UserError
    for a mix no mode takes; no TVM."""
    if args.export_metaschedule and not args.model:
        raise UserError("--export-metaschedule exports a model's tuned tasks: tune-kernels MODEL --records FILE "
                        "--export-metaschedule DIR")
    if args.op:
        raise UserError("give either a MODEL or --op, not both")
    mode = "export" if args.export_metaschedule else "list" if args.list else "tune"
    if mode != "tune" and _given(args, TUNING_OPTIONS):
        option = "--export-metaschedule" if mode == "export" else "--list"
        raise UserError(f"{option} does not tune, so {' '.join(_given(args, TUNING_OPTIONS))} means nothing with "
                        f"it: drop {option} to tune, or drop the tuning options")
    op_only = _given(args, OP_ONLY)
    if op_only:
        raise UserError(f"{op_only[0]} applies to --op only: a MODEL's kernels come with their shapes and are "
                        "measured as optimize-model measures them")
    if mode == "tune" and args.trials is None:
        asked = f"--kernels {args.kernels} picks the kernels to tune, but" if args.kernels else \
            "tune-kernels MODEL tunes the model's tasks, and"
        raise UserError(f"{asked} --trials is not given: add --trials N (e.g. --trials 200, spread over the tasks), "
                        "or --list to see the tasks")
    return mode


def run_model(args: argparse.Namespace) -> int:
    """The model mode of ``tune-kernels``; returns the exit code."""
    mode = check_mode(args)
    tuning = tuning_options(args) if mode == "tune" else None
    if mode == "export":
        check_export(args)
    ctx, model = model_context(args, tuning)
    # Deferred: TVM loads (seconds) only after the cheap checks, and never for tune-kernels --help.
    from pipeline.chain import ChainRequest, Until, run_chain

    run = None
    if tuning is not None:
        from pipeline.tuning import tuning_run

        run = tuning_run(ctx)  # a target that cannot be tuned here: refused before the model is lowered
    # the model's kernels as optimize-model --skip-graph builds them: its records serve that build
    request = ChainRequest(model.proto, model.input_shapes, until=Until.PARTITION)
    lowered = run_chain(ctx.without_graph_stage(), request).lowered
    if run is not None:
        return tune_tasks_of(lowered.part, run, args)
    if mode == "export":
        from pipeline.ms_export import export_metaschedule

        result = export_metaschedule(lowered.imported, lowered.part, ctx.spec, args.records,
                                     args.export_metaschedule)
        for outcome in result.outcomes:
            print(outcome.line())
        print(result.summary())
        return 0
    from pipeline.partition import format_tasks

    part = lowered.part
    print(format_tasks(part.tasks))
    tunable = [t for t in part.tasks if t.task is not None]
    print(f"{len(part.tasks)} tasks, {len(tunable)} tunable ({' / '.join(OP_KINDS)}), "
          f"{part.total_flops() / 1e9:.3f} GFLOP per run")
    return 0


def tuning_options(args: argparse.Namespace) -> TuneOptions:
    """The tuning options of ``tune-kernels MODEL --trials N``, checked by optimize-model's one check
    (:meth:`pipeline.context.TuneOptions.validate`: --trials, --searcher, --timeout, --early-stop), and the
    output files checked writable, before any long work."""
    tuning = TuneOptions(args.trials, args.kernels, args.scheduler, args.searcher, args.records, args.rpc,
                         progress=not args.no_progress, timeout=args.timeout, early_stop=args.early_stop)
    if tuning.trials <= 0:  # optimize-model takes 0 (no tuning); asked to tune, 0 is no run at all
        raise UserError(f"--trials {tuning.trials}: give a positive budget (e.g. --trials 200)")
    tuning.validate()
    check_output_file(args.records or default_records(args.model), "--records")
    if args.json:
        check_output_file(args.json, "--json")
    return tuning


def check_export(args: argparse.Namespace) -> None:
    """``--export-metaschedule DIR`` has records to read and a folder to write."""
    if not args.records:
        raise UserError("--export-metaschedule reads tuning records: add --records FILE (optimize-model writes "
                        "DIR/records.jsonl)")
    if not Path(args.records).is_file():
        raise UserError(f"--records {args.records!r} is not a file: give the records of the tuning run "
                        "(optimize-model's DIR/records.jsonl)")
    check_output_dir(args.export_metaschedule, "--export-metaschedule")


def model_context(args: argparse.Namespace, tuning: TuneOptions | None) -> tuple[BuildContext, Any]:
    """The checked model and the build context (target, threads, layout, seed; with ``tuning``, the records
    file, checked free of another tuner); no TVM yet."""
    request = check_name(args.target)
    model = check_model(args.model, shape_request(args.input_shape, args.dim))  # a model we would refuse is not listed
    threads = use_threads(args.threads)  # before TVM's pool starts: the layout stage times kernels with it
    ctx = BuildContext.create(request, threads=threads, layout=args.layout, seed=args.seed,
                              tuning=tuning or TuneOptions())
    if tuning is not None:
        ctx = ctx.with_records(args.records or default_records(args.model))
        ctx.records.check_free()
    return ctx, model


def tune_tasks_of(part: Any, run: Any, args: argparse.Namespace) -> int:
    """Tune the ``--kernels`` tasks of ``part`` with ``run`` (optimize-model's tuning stage), print one line per
    task and a summary, write ``--json``; returns the exit code."""
    from pipeline.partition import select_tasks
    from pipeline.tuning import tune_model

    result = tune_model(select_tasks(part.tasks, args.kernels), run)
    summary = ModelTuning.of(result, display_path(run.records.path), args)
    for task in result.tasks:
        print(task_line(task))
    print("\n".join(summary.lines()))
    if args.json:
        write_text_atomic(args.json, json.dumps(summary.to_json(result), indent=2) + "\n")
    return 0


def task_line(t: TaskTuning) -> str:
    """One tuned task: its default and best kernel time, the trials it got, and the config that ships."""
    speed = f" ({t.default_ms / t.best_ms:.2f}x)" if t.default_ms and t.best_ms else ""
    config = (", ".join(f"{k}={v}" for k, v in t.config.items()) if t.config else
              "default config kept (no tuned config beat it)")
    stopped = ", stopped improving" if t.early_stopped else ""
    return (f"task {t.index} {t.name} ({t.kind}, x{t.weight}): default {_ms(t.default_ms)} -> best {_ms(t.best_ms)}"
            f"{speed} in {t.trials} trial{'' if t.trials == 1 else 's'}{stopped}; {config}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g} ms"


@dataclass
class ModelTuning:
    """What ``tune-kernels MODEL`` says about a finished run, in its last line and its ``--json``."""

    model: str
    records: str
    trials: int
    measured_now: int
    seconds: float
    stop_reason: str  # a kerneltune.stopping.StopReason value
    kernel_ms_before: float  # sum over the tuned tasks of calls x default time
    kernel_ms_after: float  # the same with each task's shipped config

    @classmethod
    def of(cls, result: TuningResult, records: str, args: argparse.Namespace) -> ModelTuning:
        before, after = result.kernel_ms()
        return cls(display_path(args.model), records, result.trials, result.measured_now, round(result.seconds, 2),
                   result.stop_reason.value, round(before, 4), round(after, 4))

    def lines(self) -> list[str]:
        """The summary: what was spent and why it stopped, the kernel time won, and how optimize-model reuses the
        records."""
        return [f"{self.trials} trials ({self.measured_now} measured now) in {self.seconds:.1f} s; stopped: "
                f"{StopReason(self.stop_reason).phrase}; tuned kernels {self.kernel_ms_before:.4g} -> "
                f"{self.kernel_ms_after:.4g} ms per inference (calls x time alone)",
                f"records: {self.records} (optimize-model {self.model} --records {self.records} with the same "
                "--trials, --kernels and --seed takes these trials from it instead of measuring them)"]

    def to_json(self, result: TuningResult) -> dict[str, Any]:
        from pipeline.tuning import stop_fields

        tasks = [{k: v for k, v in asdict(t).items() if k != "curve"} for t in result.tasks]
        return asdict(self) | stop_fields(result) | {"scheduler": result.scheduler, "searcher": result.searcher,
                                                     "tasks": tasks}


MODEL_MODE = ModelMode(add_model_arguments, lambda args: bool(args.model or args.export_metaschedule), run_model)
