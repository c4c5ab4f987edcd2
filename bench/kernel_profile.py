"""Per-kernel profiles of shipped builds, checked against their measured latency (issue 43).

    python bench/kernel_profile.py DIR [DIR ...] --out bench/results

For each optimize-model folder: ``run-model DIR --profile`` (pipeline.pricing.layer_profile), its JSON and picture
written as ``profile_<model>.json`` / ``.png``, and one line: the kernels' times summed against the model
timed whole (issue 43 asks for within 10%), the share of kernel time whose calls name their ONNX nodes,
and onnxruntime's nodes summed on the same file.  The CPU (and its caches) is recorded in the JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from graphopt.fileio import write_text_atomic
from kerneltune.targets.host import host_model_name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", metavar="DIR", help="optimize-model -o folders")
    p.add_argument("--out", default="bench/results", help="folder for profile_<model>.json/.png")
    p.add_argument("--repeat", type=int, default=20, help="runs timed per profile")
    args = p.parse_args(argv)
    from pipeline import cli

    out = Path(args.out)
    for d in args.dirs:
        name = Path(json.loads((Path(d) / "report.json").read_text())["model"]).stem
        data, png = out / f"profile_{name}.json", out / f"profile_{name}.png"
        cli.run_model_main([d, "--profile", "--repeat", str(args.repeat), "--json", str(data),
                            "--profile-plot", str(png)])
        result = json.loads(data.read_text())
        prof = result["profile"]
        result["cpu"] = host_model_name()
        result["kernels_over_latency"] = prof["kernels_ms"] / prof["latency_ms"]
        write_text_atomic(data, json.dumps(result, indent=2) + "\n")
        print(f"{name}: kernels {prof['kernels_ms']:.2f} ms vs the model whole {prof['latency_ms']:.2f} ms "
              f"({result['kernels_over_latency']:.3f}x); {prof['traced']:.1%} of kernel time named by ONNX nodes; "
              f"onnxruntime's nodes {prof['ort_ms']:.2f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
