"""``tune-kernels MODEL --list``: the model's fused kernels as tuning tasks, with the indices ``--kernels``
takes.  Plugged into kerneltune's CLI (which owns the single-operator mode) as :data:`MODEL_MODE`.
"""
from __future__ import annotations

import argparse

from graphopt.errors import UserError
from graphopt.onnx_io import parse_input_shapes
from graphopt.validate import check_model, check_threads
from kerneltune.cli import ModelMode
from kerneltune.opkinds import KINDS as OP_KINDS
from kerneltune.targets import check_name, default_threads, parse_target, set_num_threads
from pipeline.layout_modes import LAYOUT_HELP, LAYOUTS


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("model", nargs="?", help="ONNX model: work on its fused kernels instead of one --op")
    g.add_argument("--list", action="store_true", help="with MODEL: list its tasks (index, kind, calls per "
                                                       "inference, MFLOP per call, what each computes) and exit")
    g.add_argument("--input-shape", action="append", metavar="NAME=D1,D2,...",
                   help="with MODEL: fix a dynamic input's shape (repeatable)")
    g.add_argument("--layout", default="auto", choices=LAYOUTS, help=f"with MODEL: {LAYOUT_HELP}")


def run_model(args: argparse.Namespace) -> int:
    """The model mode of ``tune-kernels``; returns the exit code."""
    if not args.list:
        raise UserError("with a MODEL, tune-kernels lists its tasks: add --list (tune them with "
                        "`optimize-model MODEL --trials N --kernels SEL -o DIR`)")
    if args.op:
        raise UserError("give either a MODEL or --op, not both")
    check_name(args.target)
    model = check_model(args.model, parse_input_shapes(args.input_shape))  # a model we would refuse is not listed
    threads = check_threads(args.threads) or default_threads()
    set_num_threads(threads)  # before TVM's pool starts: the layout stage times kernels with it
    # Deferred: TVM loads (seconds) only after the cheap checks, and never for tune-kernels --help.
    from pipeline.layout_search import partition_model
    from pipeline.partition import format_tasks
    from pipeline.relax_import import import_model

    imported = import_model(model.proto, model.input_shapes)
    part = partition_model(imported.mod, parse_target(args.target, threads), args.layout)
    print(format_tasks(part.tasks))
    tunable = [t for t in part.tasks if t.task is not None]
    print(f"{len(part.tasks)} tasks, {len(tunable)} tunable ({' / '.join(OP_KINDS)}), "
          f"{part.total_flops() / 1e9:.3f} GFLOP per run")
    return 0


MODEL_MODE = ModelMode(add_model_arguments, lambda args: bool(args.model), run_model)
