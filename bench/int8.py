"""int8 against onnxruntime's and OpenVINO's int8 on the same quantized file, and against fp32, in one run.

For each model (the corpus builders in ``models/``: real architectures, seeded weights), quantized with
onnxruntime's own tools as users do (conv nets: ``quantize_static``, QDQ, per-channel s8 weights, u8
activations, calibrated on 4 seeded images; transformers: ``quantize_dynamic``, s8 weights):

* onnxruntime fp32 and int8, OpenVINO int8 (f32 hint, latency mode, same threads; when installed:
  ``pip install optimize-model[bench]``), on the quantized file;
* our untuned int8 build and our untuned fp32 build (``--skip-graph``), for each ``--mcpu`` given
  (default: this CPU, then ``x86-64-v3``: AVX2 without VNNI).

All engines of one model are timed in one :func:`graphopt.timing.time_blocks` call (alternating blocks),
so the ratios come from one run.  Writes JSON and a PNG; the CPU, its caches and whether it has VNNI are
recorded.  Run it alone: two cores shared with anything else move the medians.  Under
``bench/isa_mask.py`` (with ``--mcpu x86-64-v3``) every engine runs as on an AVX2 CPU without VNNI, and the
JSON says so.

    python bench/int8.py --models resnet50,bert-base --out bench/results/int8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline.quantize import DYNAMIC, STATIC, FeedReader, quantize  # noqa: E402 - the tool's own recipe
from isa_mask import held_isa  # noqa: E402 - this folder's ISA mask
from kerneltune.targets.host import cpu_flags  # noqa: E402
# our builders (models.registry) and real exports (models.exported, torch's dynamo exporter; torchvision
# and transformers models need those packages): the quantization recipe onnxruntime documents for each
METHODS = {"resnet50": STATIC, "resnext50": STATIC, "inception-block": STATIC, "bert-base": DYNAMIC,
           "bert-tiny": DYNAMIC, "mlp": DYNAMIC,
           "tv:resnet": STATIC, "tv:mobilenet_v2": STATIC, "tv:resnext": STATIC, "tv:googlenet": STATIC,
           "tv:bert": DYNAMIC}


def load(name: str) -> tuple[onnx.ModelProto, dict]:
    """The fp32 model and its --input-shape values (``tv:NAME``: the corpus export at full size)."""
    if name.startswith("tv:"):
        from models.exported import build_exported

        exported = build_exported(name[3:], "full", "dynamo")
        return exported.model, exported.input_shapes
    from models.registry import build

    return build(name), {}


def cpu_description() -> dict:
    """The CPU's name, caches and VNNI flags (from lscpu and /proc/cpuinfo)."""
    info = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "L1d cache", "L2 cache", "L3 cache", "CPU family", "Model"):
                info[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = cpu_flags()
    info["avx512_vnni"] = "avx512_vnni" in flags
    info["avx_vnni"] = "avx_vnni" in flags
    held = held_isa()
    if held:  # run under bench/isa_mask.py: every engine in this process saw a CPU of that ISA
        info["held_to"] = f"{held} (CPUID masked by bench/isa_mask.py)"
    return info


def bench_model(name: str, mcpus: list[str], threads: int, runs: int, work: Path) -> dict:
    from graphopt.feeds import ort_session, random_inputs, run_ort_sets
    from graphopt.onnx_io import import_onnx
    from graphopt.quant_tolerance import model_tolerance
    from graphopt.timing import time_blocks
    from pipeline.api import optimize
    from pipeline.benchmark import openvino_runner

    method = METHODS[name]
    stem = name.replace(":", "_")
    fp32 = work / f"{stem}.onnx"
    int8 = work / f"{stem}_int8.onnx"
    model, shapes = load(name)
    if shapes:
        from graphopt.onnx_io import apply_input_shapes

        apply_input_shapes(model, shapes)
    onnx.save(model, str(fp32))
    graph = import_onnx(model)
    samples = [random_inputs(graph, seed) for seed in range(4)]
    quantize(fp32, int8, method, FeedReader(samples) if method == STATIC else None, large=False)
    feeds = random_inputs(graph, 10)
    runners, built = {}, {}
    for label, path in (("onnxruntime fp32", fp32), ("onnxruntime int8", int8)):
        sess = ort_session(str(path), threads)
        names = {i.name for i in sess.get_inputs()}
        runners[label] = (lambda s, f: (lambda: s.run(None, f)))(sess, {k: v for k, v in feeds.items() if k in names})
    int8_model = onnx.load(str(int8))
    reference = run_ort_sets(int8_model, [feeds], threads)
    tolerance = model_tolerance(int8_model, [feeds], reference, threads)
    peer = openvino_runner(int8_model, threads, [feeds], reference, feeds, tolerance.tolerances if tolerance else None)
    if peer is not None:  # installed, and its outputs match onnxruntime's (bench-model's rule)
        runners["OpenVINO int8"] = peer[0]
    for mcpu in mcpus:
        target = "llvm" if mcpu == "native" else f"llvm -mcpu={mcpu}"
        for precision, path in (("int8", int8), ("fp32", fp32)):
            m = optimize(str(path), target=target, threads=threads, skip_graph=True)
            built[(mcpu, precision)] = m
            runners[f"ours {precision} ({mcpu})"] = m.runner(feeds)
    times = time_blocks(runners, runs)
    medians = {k: round(t.median_ms, 4) for k, t in times.items()}
    row = {"model": name, "method": method, "ms": medians, "min_ms": {k: round(t.min_ms, 4) for k, t in times.items()},
           "blocks_ms": {k: [round(b, 4) for b in t.blocks_ms] for k, t in times.items()}}
    ort8 = medians["onnxruntime int8"]
    row["ratios"] = {f"ours int8 ({mcpu}) / onnxruntime int8": round(medians[f"ours int8 ({mcpu})"] / ort8, 3)
                     for mcpu in mcpus}
    row["ratios"].update({f"ours int8 / ours fp32 ({mcpu})":
                          round(medians[f"ours int8 ({mcpu})"] / medians[f"ours fp32 ({mcpu})"], 3) for mcpu in mcpus})
    if "OpenVINO int8" in medians:
        row["ratios"]["OpenVINO int8 / onnxruntime int8"] = round(medians["OpenVINO int8"] / ort8, 3)
    return row


def plot(rows: list[dict], path: Path, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False)
    for ax, row in zip(axes[0], rows):
        labels = list(row["ms"])
        ax.barh(labels, [row["ms"][k] for k in labels], color=["#888" if "onnx" in k or "Open" in k else "#2a7"
                                                               for k in labels])
        ax.set_xlabel("ms per inference (median, lower is better)")
        ax.set_title(f"{row['model']} ({row['method']})")
        ax.invert_yaxis()
    fig.suptitle(cpu)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,bert-base", help=f"comma-separated: {','.join(METHODS)}")
    p.add_argument("--mcpu", default="native,x86-64-v3", help="comma-separated -mcpu values (native: this CPU)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--out", default="bench/results/int8", help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    cpu = cpu_description()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows.append(bench_model(name, args.mcpu.split(","), args.threads, args.runs, Path(tmp)))
            print(json.dumps(rows[-1], indent=1), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "threads": args.threads, "runs": args.runs,
                                                    "rows": rows}, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"), f"{cpu.get('Model name', '?')}, {args.threads} threads, "
                                        + (f"held to {cpu['held_to'].split()[0]}" if cpu.get("held_to") else
                                           f"VNNI {'yes' if cpu['avx512_vnni'] else 'no'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
