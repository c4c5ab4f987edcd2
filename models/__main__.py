"""``python -m models list`` / ``python -m models build NAME -o FILE [--seed S]`` / ``python -m models corpus`` /
``python -m models export NAME --exporter E --size S -o FILE`` (real exporter output, :mod:`models.exported`)."""
from __future__ import annotations

import argparse

from graphopt.errors import ArgumentParser, cli_entry, seed
from graphopt.fileio import check_output_file, write_bytes_atomic, write_text_atomic
from models.registry import MODELS, build, get_model


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m models", description="Build the benchmark ONNX models")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the model names with a one-line description")
    b = sub.add_parser("build", help="build one model and save it as ONNX")
    b.add_argument("name", help="model name (see list)")
    b.add_argument("-o", "--output", required=True, help="output .onnx file")
    b.add_argument("--seed", type=seed, default=0, help="seed for the random weights")
    sub.add_parser("corpus", help="print the exported-model corpus: names, exporters, description")
    e = sub.add_parser("export", help="export one corpus model with torch (needs torch, torchvision, transformers); "
                                      "writes FILE, and FILE.json with the --input-shape it needs (+ FILE.npz "
                                      "with valid sample inputs when random ones are not)")
    e.add_argument("name", help="corpus model name (see corpus)")
    e.add_argument("--exporter", default="torchscript", help="torchscript | dynamo | opset9 (default torchscript)")
    e.add_argument("--size", default="small", help="small | full (default small)")
    e.add_argument("-o", "--output", required=True, help="output .onnx file")
    return p


def _export(args: argparse.Namespace) -> int:
    """Export one corpus model; FILE.json beside it records the --input-shape (and FILE.npz the inputs) it needs."""
    import io
    import json
    import time

    import numpy as np

    from models.exported import build_exported, get_spec

    get_spec(args.name)  # fail on a bad name before torch spends a minute
    out = check_output_file(args.output, "-o")
    t0 = time.perf_counter()
    m = build_exported(args.name, args.size, args.exporter)
    seconds = time.perf_counter() - t0
    write_bytes_atomic(out, m.model.SerializeToString())
    meta = {"model": m.name, "size": m.size, "exporter": m.exporter, "opset": m.opset, "export_s": round(seconds, 2),
            "input_shapes": {k: list(v) for k, v in m.input_shapes.items()}, "shape_args": m.shape_args(),
            "nodes": len(m.model.graph.node), "inputs": None}
    if m.sample_inputs is not None:
        npz = out.with_suffix(".npz")
        buf = io.BytesIO()
        np.savez(buf, **m.sample_inputs)
        write_bytes_atomic(npz, buf.getvalue())
        meta["inputs"] = npz.name
    write_text_atomic(out.with_name(out.name + ".json"), json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out} ({meta['nodes']} nodes, opset {m.opset}, {out.stat().st_size / 1e6:.1f} MB, "
          f"{seconds:.1f} s){' ' + ' '.join(m.shape_args()) if m.shape_args() else ''}")
    return 0


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        width = max(len(n) for n in MODELS)
        for spec in MODELS.values():
            print(f"{spec.name:<{width}}  {spec.description}")
        return 0
    if args.command == "corpus":
        from models.exported import CORPUS

        width = max(len(n) for n in CORPUS)
        for c in CORPUS.values():
            print(f"{c.name:<{width}}  {','.join(c.exporters):<27} {c.description}")
        return 0
    if args.command == "export":
        return _export(args)
    get_model(args.name)  # fail on a bad name before creating anything
    out = check_output_file(args.output, "-o")
    model = build(args.name, args.seed)
    write_bytes_atomic(out, model.SerializeToString())
    print(f"wrote {out} ({len(model.graph.node)} nodes, {out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
