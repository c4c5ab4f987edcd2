"""``graphopt`` command line: sub-commands for each graph-level job.

Each sub-command's implementation lives in its own module; this file only wires argparse to them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from graphopt.errors import cli_entry
from graphopt.onnx_io import parse_input_shapes


def _add_roundtrip(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("roundtrip", help="import -> IR -> export, run both in onnxruntime and compare")
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--json", help="also write the result as JSON to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-shape", action="append", metavar="NAME=D1,D2,...",
                   help="fix a dynamic input's shape (repeatable)")
    p.set_defaults(run=_run_roundtrip)


def _run_roundtrip(args: argparse.Namespace) -> int:
    from graphopt.roundtrip import roundtrip

    result = roundtrip(args.model, parse_input_shapes(args.input_shape), seed=args.seed)
    text = json.dumps(result)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0 if result["outputs_equal"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphopt", description="Graph-level optimization of ONNX models")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_roundtrip(sub)
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
