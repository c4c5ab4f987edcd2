"""``tune-kernels MODEL --list``: the model's fused kernels as tuning tasks, with the indices ``--kernels``
takes; ``tune-kernels MODEL --records FILE --export-metaschedule DIR``: their best tuned schedules as a
MetaSchedule database (:mod:`pipeline.ms_export`).  Plugged into kerneltune's CLI (which owns the
single-operator mode) as :data:`MODEL_MODE`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from graphopt.dims import DIM_HELP, shape_request
from graphopt.errors import UserError
from graphopt.fileio import check_output_dir
from graphopt.limits import check_threads
from graphopt.validate import check_model
from kerneltune.cli import ModelMode
from kerneltune.opkinds import KINDS as OP_KINDS
from kerneltune.targets.host import default_threads
from kerneltune.targets.parse import check_name
from kerneltune.targets.threads import set_num_threads
from pipeline.context import BuildContext
from pipeline.layout.modes import LAYOUT_HELP, LAYOUTS


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("model", nargs="?", help="ONNX model: work on its fused kernels instead of one --op")
    g.add_argument("--list", action="store_true", help="with MODEL: list its tasks (index, kind, calls per "
                                                       "inference, MFLOP per call, what each computes) and exit")
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


def run_model(args: argparse.Namespace) -> int:
    """The model mode of ``tune-kernels``; returns the exit code."""
    export = args.export_metaschedule
    if export and not args.model:
        raise UserError("--export-metaschedule exports a model's tuned tasks: tune-kernels MODEL --records FILE "
                        "--export-metaschedule DIR")
    if not args.list and not export:
        raise UserError("with a MODEL, tune-kernels lists its tasks (--list) or exports their tuned schedules "
                        "(--records FILE --export-metaschedule DIR); tune them with "
                        "`optimize-model MODEL --trials N --kernels SEL -o DIR`")
    if args.op:
        raise UserError("give either a MODEL or --op, not both")
    if export:
        if not args.records:
            raise UserError("--export-metaschedule reads tuning records: add --records FILE (optimize-model writes "
                            "DIR/records.jsonl)")
        if not Path(args.records).is_file():
            raise UserError(f"--records {args.records!r} is not a file: give the records of the tuning run "
                            "(optimize-model's DIR/records.jsonl)")
        check_output_dir(export, "--export-metaschedule")
    request = check_name(args.target)
    model = check_model(args.model, shape_request(args.input_shape, args.dim))  # a model we would refuse is not listed
    threads = check_threads(args.threads) or default_threads()
    set_num_threads(threads)  # before TVM's pool starts: the layout stage times kernels with it
    ctx = BuildContext.create(request, threads=threads, layout=args.layout)
    # Deferred: TVM loads (seconds) only after the cheap checks, and never for tune-kernels --help.
    from pipeline import stages
    from pipeline.partition import format_tasks

    spec = ctx.spec
    lowered = stages.lower(model.proto, spec, ctx.layout, model.input_shapes)
    imported, part = lowered.imported, lowered.part
    if export:
        from pipeline.ms_export import export_metaschedule

        result = export_metaschedule(imported, part, spec, args.records, export)
        for outcome in result.outcomes:
            print(outcome.line())
        print(result.summary())
        return 0
    print(format_tasks(part.tasks))
    tunable = [t for t in part.tasks if t.task is not None]
    print(f"{len(part.tasks)} tasks, {len(tunable)} tunable ({' / '.join(OP_KINDS)}), "
          f"{part.total_flops() / 1e9:.3f} GFLOP per run")
    return 0


MODEL_MODE = ModelMode(add_model_arguments, lambda args: bool(args.model or args.export_metaschedule), run_model)
