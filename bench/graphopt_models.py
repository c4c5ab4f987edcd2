"""Benchmark the graph stage on the model set: cost and measured end-to-end latency before/after.

Per model: build it (``models`` registry), run the graph stage (:func:`graphopt.stage.optimize_onnx`, the
function ``graphopt optimize`` and the pipeline run: verified library, cost-based search, end-to-end check),
then time the input and the optimized model end to end with the same engine - onnxruntime (CPU EP) and,
with ``--tvm``, TVM through the pipeline's compile (template/dlight default schedules, no tuning).  Runs of
the two models are interleaved so machine noise hits both alike; medians are reported.

    python bench/graphopt_models.py --models bert-base resnext50 inception-block nasrnn --tvm \
        --json bench/results/graphopt_models.json --png bench/results/graphopt_models.png
    python bench/graphopt_models.py --models vgg.onnx resnet50.onnx ... --tvm --no-merged   # real exports

The TVM builds are what ``optimize-model --skip-tune`` builds (``--layout``, default ``auto``, then default
schedules), so a rewrite is judged on the code that ships.

Where the graph stage hands back something else than the merge-everything graph (BERT's Q/K/V, ResNeXt's
conv1 + downsample kept apart), the bench also builds that graph (``merged``: the library's merge rules
searched under ``KernelCountCost``, no end-to-end check) and times it with the same engines in the same
interleaved runs, so the JSON shows what merging would have cost end to end, not only what the per-operator
model predicted.

Prints one JSON document (also written to ``--json``) and draws a bar chart of the speedups.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from graphopt.cost.factory import COST_KINDS, make_cost_model
from graphopt.fileio import save_figure, write_text_atomic
from graphopt.stage import TIME_LIMIT
from graphopt.timing import time_blocks
from kerneltune.targets.host import host_model_name
from kerneltune.targets.threads import set_num_threads, tvm_num_threads
from pipeline.cli import GRAPHOPT_COMPONENTS
from pipeline.layout.modes import LAYOUTS

DEFAULT_MODELS = ["bert-base", "resnext50", "inception-block", "nasrnn"]


def _interleaved(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median milliseconds per model, from the project's one whole-model timer."""
    return {k: t.median_ms for k, t in time_blocks(fns, runs).items()}


def ort_latency(models: dict[str, Any], feeds, threads: int, runs: int) -> dict[str, float]:
    from graphopt.feeds import ort_session

    sessions = {k: ort_session(m, threads) for k, m in models.items()}
    fns = {}
    for k, s in sessions.items():
        names = {i.name for i in s.get_inputs()}
        f = {n: v for n, v in feeds.items() if n in names}
        fns[k] = (lambda s=s, f=f: s.run(None, f))
    return _interleaved(fns, runs)


def tvm_latency(models: dict[str, Any], feeds, threads: int, runs: int, layout: str = "auto") -> dict[str, Any]:
    """Compile the models as optimize-model --skip-graph --skip-tune builds each (the one chain: the ``layout``
    stage, default schedules held to the sanity floor) and time them on the Relax VM."""
    from kerneltune.targets.registry import device_for
    from pipeline.chain import ChainRequest, run_chain
    from pipeline.compile import to_device
    from pipeline.context import BuildContext

    ctx = BuildContext.create("llvm", threads=threads, layout=layout, skip_graph=True)
    dev = device_for(ctx.spec)
    fns, build_s = {}, {}
    for k, m in models.items():
        t = time.perf_counter()
        compiled = run_chain(ctx, ChainRequest(m)).compiled
        build_s[k] = time.perf_counter() - t
        main = compiled.vm()["main"]
        args = to_device(feeds, compiled.input_names, dev)
        fns[k] = (lambda main=main, args=args: (main(*args), dev.sync()))
    out: dict[str, Any] = _interleaved(fns, runs)
    out["build_s"] = build_s
    return out


def _cost_model(args: argparse.Namespace):
    """The cost model the graph stage runs with here: ``--cost``, timed by ``--backend`` (the engines the
    ``graphopt`` command offers)."""
    return make_cost_model(args.cost, "llvm", GRAPHOPT_COMPONENTS.runners[args.backend](args.threads))


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from graphopt.cost.kernel_count import KernelCountCost
    from graphopt.feeds import random_inputs
    from graphopt.onnx_io import import_onnx
    from graphopt.rules import merge_rules, verified_library
    from graphopt.stage import GraphStageOptions, optimize_onnx, searched_cost
    from models.registry import build

    if name.endswith(".onnx"):  # a real export: legalized for TVM first, as optimize-model does
        from graphopt.onnx_io import export_onnx, load_model
        from pipeline.frontend import legalize_for_tvm

        sidecar = Path(name + ".json")  # `python -m models export` writes the input shapes beside the model
        shapes = json.loads(sidecar.read_text()).get("input_shapes") if sidecar.exists() else None
        proto = export_onnx(legalize_for_tvm(import_onnx(load_model(name), shapes or None,
                                                         require_static=True)).graph)
        name = Path(name).stem
    else:
        proto = build(name, args.seed)
    cost = _cost_model(args)
    optimized, report = optimize_onnx(proto, cost, GraphStageOptions(alpha=args.alpha, budget=args.budget,
                                                                    time_limit=args.time_limit),
                                      seed=args.seed)
    row: dict[str, Any] = {"model": name, **report}
    models = {"before": proto, "after": optimized}
    if args.merged:
        merged, mrep = optimize_onnx(proto, KernelCountCost(), GraphStageOptions(
            budget=args.budget, time_limit=args.time_limit, rules=merge_rules(verified_library()), e2e_check=False),
            seed=args.seed)
        if any(mrep["applied"].values()) and mrep["applied"] != report["applied"]:
            models["merged"] = merged
            # priced in the form the search prices (conv biases split), so it compares with cost_before
            row["merged"] = {"applied": mrep["applied"], "max_abs_err": mrep["max_abs_err"],
                             "cost_after": searched_cost(import_onnx(merged), cost), "nodes_after": mrep["nodes_after"]}
    feeds = random_inputs(import_onnx(proto), args.seed)
    row["ort_ms"] = ort_latency(models, feeds, args.threads, args.runs)
    row["ort_speedup"] = row["ort_ms"]["before"] / row["ort_ms"]["after"]
    if "merged" in models:
        row["merged"]["ort_speedup"] = row["ort_ms"]["before"] / row["ort_ms"]["merged"]
    if args.tvm:
        try:
            row["tvm_ms"] = tvm_latency(models, feeds, args.threads, args.runs, args.layout)
            row["tvm_speedup"] = row["tvm_ms"]["before"] / row["tvm_ms"]["after"]
            if "merged" in models:
                row["merged"]["tvm_speedup"] = row["tvm_ms"]["before"] / row["tvm_ms"]["merged"]
        except Exception as exc:  # noqa: BLE001 - report the failure for this model, keep benchmarking
            row["tvm_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    row["cost_speedup"] = report["cost_before"] / report["cost_after"] if report["cost_after"] else None
    return row


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{**r, "m_ort": (r.get("merged") or {}).get("ort_speedup"),
             "m_tvm": (r.get("merged") or {}).get("tvm_speedup")} for r in rows]
    series = [("cost model", "cost_speedup"), ("onnxruntime", "ort_speedup"), ("TVM default", "tvm_speedup"),
              ("merge all: onnxruntime", "m_ort"), ("merge all: TVM default", "m_tvm")]
    series = [s for s in series if any(r.get(s[1]) for r in rows)]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(rows), 3.6))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r.get(key) or 0 for r in rows], width, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(rows))], [r["model"] for r in rows])
    ax.set_ylabel("speedup after graph stage (x)")
    ax.set_title("graphopt: before / after, end to end")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                   help="registry names (python -m models list) or ONNX files (real exports)")
    p.add_argument("--cost", choices=COST_KINDS, default="measured")
    p.add_argument("--backend", choices=list(GRAPHOPT_COMPONENTS.runners), default="tvm",
                   help="what the measured cost model times")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--budget", type=int, default=1000)
    p.add_argument("--time-limit", type=float, default=TIME_LIMIT)
    p.add_argument("--layout", choices=LAYOUTS, default="auto", help="the layout stage of the TVM builds timed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tvm", action="store_true", help="also compile and time both models with TVM")
    p.add_argument("--no-merged", dest="merged", action="store_false",
                   help="skip the merge-everything counterfactual")
    p.add_argument("--json", default="bench/results/graphopt_models.json")
    p.add_argument("--png", default="bench/results/graphopt_models.png")
    args = p.parse_args(argv)
    set_num_threads(tvm_num_threads(args.threads))
    rows = []
    for name in args.models:
        row = bench_model(name, args)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    doc = {"threads": args.threads, "cpu": host_model_name(), "cost": args.cost, "backend": args.backend,
           "runs": args.runs, "time_limit": args.time_limit, "layout": args.layout, "models": rows}
    text = json.dumps(doc, indent=2)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.json, text + "\n")
    plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
