"""``python -m models list`` / ``python -m models build NAME -o FILE [--seed S]``."""
from __future__ import annotations

import argparse

from graphopt.errors import ArgumentParser, cli_entry, seed
from graphopt.fileio import check_output_file, write_bytes_atomic
from models.registry import MODELS, build, get_model


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m models", description="Build the benchmark ONNX models")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the model names with a one-line description")
    b = sub.add_parser("build", help="build one model and save it as ONNX")
    b.add_argument("name", help="model name (see list)")
    b.add_argument("-o", "--output", required=True, help="output .onnx file")
    b.add_argument("--seed", type=seed, default=0, help="seed for the random weights")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        width = max(len(n) for n in MODELS)
        for spec in MODELS.values():
            print(f"{spec.name:<{width}}  {spec.description}")
        return 0
    get_model(args.name)  # fail on a bad name before creating anything
    out = check_output_file(args.output, "-o")
    model = build(args.name, args.seed)
    write_bytes_atomic(out, model.SerializeToString())
    print(f"wrote {out} ({len(model.graph.node)} nodes, {out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
