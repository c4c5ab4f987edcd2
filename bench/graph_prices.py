"""How well each graph price ranks candidate graphs by their measured end-to-end time (issue 27, item 1).

Per model (an exported corpus file, ``python -m models export NAME``): the graph stage's input (legalized
for TVM, as :func:`pipeline.stages.graph_stage` sees it) and ``--candidates`` distinct graphs made from it by
1-3 random rewrites of the verified library or 1-6 of its merge rules alone (seeded; each a graph the
search could reach), each finished as the stage finishes a result (:func:`graphopt.stage.finish`).  Every graph
is priced three ways:

* ``op_sum``: the search's own price, the sum of one-operator timings with element-wise epilogues taken as
  fused (:class:`graphopt.cost.measured.MeasuredCost` with the pipeline's TVM runner);
* ``kernels``: the fusion-aware price, the fused kernels the pipeline builds for the graph, each timed alone
  (:mod:`pipeline.pricing.kernel_price`);
* ``e2e``: the whole graph compiled by the pipeline (the heuristic blocked conv layouts, default schedules,
  :func:`pipeline.stages.compile_model`) and timed end to end,
  all graphs of a model interleaved (:meth:`MeasuredCost.time_models`), in two blocks of opposite order.

The JSON gives every graph's three numbers and, per model and over all graphs (each price and time taken
relative to its model's input graph), the Spearman rank correlation of each price with ``e2e``; the PNG
plots both prices against the measured time.

    python bench/graph_prices.py /work/corpus/resnet_dynamo.onnx /work/corpus/bert_dynamo.onnx ... \
        --candidates 11 --json bench/results/xeon/graph_prices.json --png bench/results/xeon/graph_prices.png
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np

from graphopt.cost.factory import make_cost_model
from graphopt.fileio import save_figure, write_text_atomic
from graphopt.onnx_io import import_onnx, load_model
from graphopt.rewrite import RewriteError
from graphopt.rules import merge_rules, verified_library
from graphopt.search import Searcher
from graphopt.cleanup import split_conv_bias
from graphopt.stage import finish
from kerneltune.targets.host import host_model_name
from kerneltune.targets.parse import parse_target
from kerneltune.targets.threads import set_num_threads
from pipeline.frontend import legalize_for_tvm
from pipeline.pricing.graph_runner import TvmRunner
from pipeline.stages import compile_graph, compile_model, kernel_times


def ranks(x: list[float]) -> np.ndarray:
    """Ranks from 0, ties averaged."""
    a = np.asarray(x, dtype=float)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(len(a))
    for v in np.unique(a):
        tie = a == v
        r[tie] = r[tie].mean()
    return r


def spearman(x: list[float], y: list[float]) -> float:
    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1]) if len(x) > 2 and rx.std() > 0 and ry.std() > 0 else float("nan")


def candidates(graph, searcher: Searcher, n: int, seed: int, steps: int, seen: set[str]):
    """``n`` distinct graphs, each 1 to ``steps`` random rule applications away from ``graph`` (search states),
    none of whose hashes is in ``seen`` (updated)."""
    rng = random.Random(seed)
    root = searcher.root(graph)
    out, attempts = [], 0
    while len(out) < n and attempts < 30 * n:
        attempts += 1
        state = root
        for _ in range(rng.randint(1, steps)):
            if not state.matches:
                break
            by_rule: dict[str, list] = {}
            for m, _ in state.matches:  # a rule first, then one of its matches: rules with many matches
                by_rule.setdefault(m.rule.name, []).append(m)  # (a pool's hundred places) do not crowd out
            ms = by_rule[sorted(by_rule)[rng.randrange(len(by_rule))]]
            match = ms[rng.randrange(len(ms))]
            try:
                state = searcher.child(state, match)
            except RewriteError:
                break
        h = state.graph.structural_hash()
        if state is root or h in seen:
            continue
        seen.add(h)
        out.append(state)
    return root, out


def model_rows(path: str, n: int, seed: int, threads: int, runs: int) -> list[dict]:
    meta_path = Path(path + ".json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    shapes = {k: tuple(v) for k, v in (meta.get("input_shapes") or {}).items()} or None
    graph = legalize_for_tvm(import_onnx(load_model(path), shapes, require_static=True)).graph
    searched = graph.copy()
    split_conv_bias(searched)  # the form the rules are written in, as the stage searches
    spec = parse_target("llvm", threads)
    cost = make_cost_model("measured", "llvm", TvmRunner(compile_graph, threads, spec, kernel_times, compile_model))
    # half the candidates from every verified rule, half from the merge rules alone (a merge changes which
    # kernels are built: the case a per-operator sum misprices), up to 6 merges deep
    seen = {searched.structural_hash()}
    root, states = candidates(searched, Searcher(verified_library(), cost), n - n // 2, seed, 3, seen)
    states += candidates(searched, Searcher(merge_rules(verified_library()), cost), n // 2, seed, 6, seen)[1]
    graphs, labels, op_sum, hashes = [graph], ["input"], [root.cost], {graph.structural_hash()}
    for s in states:  # a rewrite and its reverse finish as the input: each distinct graph once
        g = finish(s.graph)[0]
        if g.structural_hash() not in hashes:
            hashes.add(g.structural_hash())
            graphs.append(g)
            labels.append(" > ".join(s.path))
            op_sum.append(s.cost)
    kernels, price_s = [], []
    for g in graphs:
        t0 = time.perf_counter()
        kernels.append(cost.kernel_times([g])[0])
        price_s.append(round(time.perf_counter() - t0, 2))
    # two interleaved blocks, the second in reverse order, so that no graph is always timed early
    first, second = cost.time_models(graphs, runs).seconds, cost.time_models(graphs[::-1], runs).seconds[::-1]
    e2e = [(a + b) / 2 for a, b in zip(first, second)]
    cost.flush()
    name = Path(path).name
    return [{"model": name, "graph": label, "op_sum_ms": o * 1e3, "kernels_ms": k * 1e3, "e2e_ms": e * 1e3,
             "kernel_price_s": s}
            for label, o, k, e, s in zip(labels, op_sum, kernels, e2e, price_s)]


def correlations(rows: list[dict]) -> dict:
    """Spearman rank correlations with the measured time, per model and over all rows (relative to each
    model's input graph, so models of different sizes pool)."""
    out: dict = {}
    models = sorted({r["model"] for r in rows})
    pooled = {"op_sum": [], "kernels": [], "e2e": []}
    for m in models:
        rs = [r for r in rows if r["model"] == m]
        base = rs[0]
        out[m] = {p: spearman([r[f"{p}_ms"] for r in rs], [r["e2e_ms"] for r in rs]) for p in ("op_sum", "kernels")}
        out[m]["graphs"] = len(rs)
        for p in pooled:
            pooled[p] += [r[f"{p}_ms"] / base[f"{p}_ms"] for r in rs]
    out["all"] = {p: spearman(pooled[p], pooled["e2e"]) for p in ("op_sum", "kernels")}
    out["all"]["graphs"] = len(rows)
    return out


def plot(rows: list[dict], corr: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, p, title in ((axes[0], "op_sum", "sum of one-operator timings"),
                         (axes[1], "kernels", "fused kernels, each timed alone")):
        for m in sorted({r["model"] for r in rows}):
            rs = [r for r in rows if r["model"] == m]
            x = [r[f"{p}_ms"] / rs[0][f"{p}_ms"] for r in rs]
            y = [r["e2e_ms"] / rs[0]["e2e_ms"] for r in rs]
            ax.scatter(x, y, label=f"{m} (rho {corr[m][p]:.2f})", s=18)
        ax.set_xlabel(f"price / input's ({title})")
        ax.set_ylabel("measured end to end / input's")
        ax.set_title(f"{title}: rank correlation {corr['all'][p]:.2f}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, png)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="exported ONNX models (with FILE.json's input shapes)")
    p.add_argument("--candidates", type=int, default=11)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args()
    set_num_threads(args.threads)
    rows = []
    for m in args.models:
        rows += model_rows(m, args.candidates, args.seed, args.threads, args.runs)
    corr = correlations(rows)
    doc = {"cpu": host_model_name(), "threads": args.threads, "candidates_per_model": args.candidates,
           "correlation": corr, "rows": rows}
    text = json.dumps(doc, indent=1)
    print(json.dumps(corr, indent=1))
    if args.json:
        write_text_atomic(args.json, text + "\n")
    if args.png:
        plot(rows, corr, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
