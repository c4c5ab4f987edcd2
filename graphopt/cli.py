"""``graphopt`` command line: sub-commands for each graph-level job.

Each sub-command's implementation lives in its own module; this file only wires argparse to them.  The
console script itself is composed in :mod:`pipeline.cli` (``graphopt_main``): it hands in the engines the
measured cost model may time with (:class:`Components`), because the default one, TVM, lives above graphopt.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from graphopt.cost.factory import COST_KINDS, make_cost_model
from graphopt.cost.runners import GraphRunner
from graphopt.dims import DIM_HELP, shape_request
from graphopt.errors import ArgumentParser, UserError, seed
from graphopt.fileio import check_output_file, write_text_atomic
from graphopt.caches import add_cache_parser
from graphopt.library import add_rules_parser
from graphopt.onnx_io import save_model
from graphopt.roundtrip import roundtrip
from graphopt.stage import E2E_MARGIN, E2E_RUNS, PATIENCE, TIME_LIMIT, GraphStageOptions, optimize_onnx
from graphopt.limits import check_threads
from graphopt.validate import ModelInput, check_model


class RunnerFactory(Protocol):
    """An engine for the measured cost model: its runner for ``threads`` threads and the ``--target`` text
    (an engine that compiles, as TVM does, builds for that target, ``-mcpu``/``-mattr`` included)."""

    def __call__(self, threads: int, target: str = "llvm") -> GraphRunner: ...


@dataclass(frozen=True)
class Components:
    """What the composition root plugs into this CLI."""

    runners: Mapping[str, RunnerFactory]  # --backend NAME -> its runner factory; first: default
    target_kinds: Sequence[str]  # the --target values, for its help
    check_target: Callable[[str], str]  # --target -> target kind; a UserError for an unknown one


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--json", help="also write the result as JSON to this file")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random check inputs")
    p.add_argument("--input-shape", action="append", metavar="NAME=D1,D2,...",
                   help="fix a dynamic input's shape (repeatable; needed where a dimension has no name, else --dim)")
    p.add_argument("--dim", action="append", metavar="NAME=N", help=DIM_HELP)
    p.add_argument("--inputs", metavar="FILE.npz", help="sample inputs (numpy.savez(FILE, name=array, ...)) for the "
                                                        "output check; their shapes fix the input shapes")


def _checked_model(args: argparse.Namespace) -> ModelInput:
    """The output paths, then the model: every input problem before any work."""
    if args.json:
        check_output_file(args.json, "--json")
    if getattr(args, "output", None):
        check_output_file(args.output, "-o")
    return check_model(args.model, shape_request(args.input_shape, args.dim), args.inputs)


def _add_roundtrip(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("roundtrip", help="import -> IR -> export, run both in onnxruntime and compare")
    _add_model_arguments(p)
    p.set_defaults(run=_run_roundtrip)


def _run_roundtrip(args: argparse.Namespace) -> int:
    model = _checked_model(args)
    result = roundtrip(model.proto, model.input_shapes, seed=args.seed, samples=model.samples)
    text = json.dumps(result)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    if not result["outputs_equal"]:  # a verdict on the IR (exit 1, like diff), not a bad input (exit 2)
        print(f"error: the re-exported model differs from the input in onnxruntime ({result['check_failure']}); "
              "the graph IR does not carry this model - please report it", file=sys.stderr)
        return 1
    return 0


def _add_optimize(sub: argparse._SubParsersAction, components: Components) -> None:
    p = sub.add_parser("optimize", help="apply the verified substitution library with a cost-based search")
    _add_model_arguments(p)
    p.add_argument("-o", "--output", required=True, help="where to write the optimized ONNX model")
    p.add_argument("--target", default="llvm",
                   help=f"target the cost model prices for ({', '.join(components.target_kinds)})")
    p.add_argument("--alpha", type=float, default=1.05, help="keep graphs up to alpha x the best cost (1.0 = greedy)")
    p.add_argument("--budget", type=int, default=1000, help="most graphs to dequeue")
    p.add_argument("--patience", type=int, default=PATIENCE,
                   help=f"stop after this many dequeued graphs without a cheaper one (default {PATIENCE})")
    p.add_argument("--time-limit", type=float, default=TIME_LIMIT,
                   help="seconds for the whole graph stage: pricing, search, end-to-end timing, merge "
                        f"(default {TIME_LIMIT:g})")
    p.add_argument("--weights-as-inputs", action="store_true",
                   help="keep initializers the model also lists as graph inputs (the opset-9 convention) as "
                        "overridable inputs; by default they are weights the optimizer may fold and merge")
    p.add_argument("--cost", choices=COST_KINDS, default="measured",
                   help="measured: time each operator on this machine (cached); analytic: roofline estimate")
    p.add_argument("--backend", choices=list(components.runners), default=next(iter(components.runners)),
                   help="what runs the timed operators: TVM with the pipeline's schedules, or onnxruntime")
    p.add_argument("--threads", type=int, default=1, help="threads for the timed operators")
    p.add_argument("--no-e2e-check", action="store_true",
                   help="keep the search's graph without timing both whole models (with --cost analytic nothing "
                        "is timed anyway)")
    p.add_argument("--e2e-margin", type=float, default=E2E_MARGIN,
                   help="keep the optimized graph only if it runs at least this fraction faster end to end")
    p.add_argument("--e2e-runs", type=int, default=E2E_RUNS,
                   help="interleaved runs per model for the end-to-end check")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=lambda args: _run_optimize(args, components))


def _run_optimize(args: argparse.Namespace, components: Components) -> int:
    kind = components.check_target(args.target)
    options = GraphStageOptions(alpha=args.alpha, budget=args.budget, patience=args.patience,
                                time_limit=args.time_limit,
                                progress=not args.no_progress, e2e_check=not args.no_e2e_check,
                                e2e_margin=args.e2e_margin, e2e_runs=args.e2e_runs,
                                weights_as_inputs=args.weights_as_inputs)
    options.validate()
    check_threads(args.threads)
    model = _checked_model(args)
    cost = make_cost_model(args.cost, kind, components.runners[args.backend](args.threads, args.target))
    optimized, report = optimize_onnx(model.proto, cost, options, model.input_shapes, args.seed, model.samples)
    if not report["outputs_equal"]:
        raise UserError(f"the optimized graph differs from the input model in onnxruntime ({report['check_failure']}); "
                        f"nothing was written to {args.output} - keep using the input model, and report this")
    save_model(optimized, args.output)
    text = json.dumps(report)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    return 0


def build_parser(components: Components) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="graphopt", description="Graph-level optimization of ONNX models")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_roundtrip(sub)
    _add_optimize(sub, components)
    add_rules_parser(sub)
    add_cache_parser(sub)
    return parser


def main(argv: list[str] | None, components: Components) -> int:
    """Run one ``graphopt`` command (wrapped by :func:`graphopt.errors.cli_entry` in the console script)."""
    args = build_parser(components).parse_args(argv)
    return args.run(args)
