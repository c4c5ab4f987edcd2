"""One build serving every length (``--dim batch=1 --dim sequence=LO:HI``) against onnxruntime, OpenVINO and
our build of each length alone, in one run per length.

For each model (torch's dynamo export of a transformers model, symbolic ``batch`` and ``sequence``,
``models.exported``):

* **served**: one untuned build, ``dims={"batch": 1, "sequence": (LO, HI)}`` (:mod:`pipeline.symbolic`), built
  once and run at every length;
* **static**: an untuned build of each length alone (``dims={"batch": 1, "sequence": L}``), the same options;
* onnxruntime and OpenVINO (f32 hint, latency mode, same threads; when installed) on the same file, which
  serves any length.

Each length's engines are timed in one :func:`graphopt.timing.time_blocks` call (alternating blocks), so the
ratios come from one run; the served build's outputs are checked against onnxruntime at every length first.
Build times are recorded: each build is ``optimize-model`` run in a process of its own, writing its files
(model.so, optimized.onnx), as a user runs it.  With ``--trials N`` the same served build tuned with N trials (the build
optimize-model ships: the tuned one only where it is not slower at any checked size) is one more engine.
With ``--memory``, the peak resident memory of a fresh process running the served build at the range's top
against one running a build of that length alone.  Writes JSON and a PNG (latency
over length); the CPU and its caches are recorded.  Run it alone: two cores shared with anything else move
the medians.

    python bench/dynamic.py --models bert --lengths 8,77,128,384 --out bench/results/dynamic
    python bench/dynamic.py --models minilm,bert,gpt2 --trials 500 --out bench/results/dynamic_tuned
    python bench/dynamic.py --models bert --lengths "" --memory --out bench/results/dynamic_memory
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graphopt.errors import UserError  # noqa: E402
from graphopt.fileio import save_figure, write_text_atomic  # noqa: E402
from int8 import cpu_description  # noqa: E402 - this folder's CPU description (lscpu)


def build(path: Path, out: Path, sequence: str, threads: int, graph: bool, extra: tuple[str, ...] = ()):
    """``optimize-model`` run as a user runs it, in a process of its own, and its folder loaded; with the
    seconds the command took.  Built in this process, the first build would pay for TVM's import and the
    caches every later one finds warm (BERT-base served: 66.9 s first, against 42.1 for a static build
    after it; 67.7 against 53.4 each in a fresh process)."""
    from pipeline.api import load

    cmd = [sys.executable, "-m", "pipeline.cli", str(path), "-o", str(out), "--threads", str(threads),
           "--dim", "batch=1", "--dim", f"sequence={sequence}", *([] if graph else ["--skip-graph"]), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise (UserError if proc.returncode == 2 else RuntimeError)(f"optimize-model exited {proc.returncode}: {last}")
    return load(out, threads=threads), seconds


def bench_model(name: str, lengths: list[int], span: tuple[int, int], threads: int, runs: int, graph: bool,
                work: Path, memory: bool = False, trials: int = 0) -> dict:
    from graphopt.compare import compare_outputs
    from graphopt.feeds import ort_session, random_inputs, run_ort
    from graphopt.onnx_io import import_onnx
    from graphopt.timing import time_blocks
    from models.exported import build_exported
    from pipeline.benchmark import openvino_runner

    exported = build_exported(name, "full", "dynamo")
    path = work / f"{name}.onnx"
    onnx.save(exported.model, str(path), save_as_external_data=exported.model.ByteSize() > 2**31)
    model = onnx.load(str(path))
    served_range = f"{span[0]}:{span[1]}"
    served, seconds = build(path, work / f"{name}.served", served_range, threads, graph)
    row = {"model": name, "range": list(span), "served_build_s": round(seconds, 1),
           "representative": served.report["served"]["representative"], "lengths": {}}
    tuned = None
    if trials:  # the same served build tuned: the build optimize-model ships (pick_build, every checked size)
        tuned, seconds = build(path, work / f"{name}.tuned", served_range, threads, graph,
                               ("--trials", str(trials), "--records", str(work / f"{name}.records.jsonl")))
        tune = tuned.report["stages"]["tune"]
        row["tuned"] = {"trials": trials, "build_s": round(seconds, 1), "tune_s": tune["time_s"],
                        "kernel_ms_before": tune["kernel_ms_before"], "kernel_ms_after": tune["kernel_ms_after"],
                        "e2e": tune["e2e"]}
        print(name, "tuned:", json.dumps(row["tuned"]), flush=True)
    sess = ort_session(str(path), threads)
    for length in lengths:
        shapes = {i.name: tuple(1 if d.dim_param == "batch" else length if d.dim_param == "sequence" else d.dim_value
                                for d in i.type.tensor_type.shape.dim) for i in model.graph.input}
        feeds = random_inputs(import_onnx(model, shapes), length)
        reference = run_ort(model, feeds, threads)
        check = compare_outputs(reference, list(served.run(feeds).values()))
        # the static build writes its files as the served one does (model.so, optimized.onnx): the build times
        # compared are of the same job
        static, static_s = build(path, work / f"{name}.static{length}", str(length), threads, graph)
        runners = {"served": served.runner(feeds), "static": static.runner(feeds),
                   "onnxruntime": (lambda f: (lambda: sess.run(None, f)))(feeds)}
        if tuned is not None:
            runners["tuned"] = tuned.runner(feeds)
        peer = openvino_runner(model, threads, [feeds], [reference], feeds)
        if peer is not None:
            runners["OpenVINO"] = peer[0]
        times = time_blocks(runners, runs)
        ms = {k: round(t.median_ms, 4) for k, t in times.items()}
        row["lengths"][length] = {
            "ms": ms, "min_ms": {k: round(t.min_ms, 4) for k, t in times.items()},
            "served / onnxruntime": round(ms["served"] / ms["onnxruntime"], 3),
            "served / static": round(ms["served"] / ms["static"], 3),
            **({"tuned / served": round(ms["tuned"] / ms["served"], 3),
                "tuned check": compare_outputs(reference, list(tuned.run(feeds).values())).ok} if tuned else {}),
            "static_build_s": round(static_s, 1), "check": {"ok": check.ok, "max_abs_err": check.max_abs_err}}
        print(name, length, json.dumps(row["lengths"][length]), flush=True)
        del static
        shutil.rmtree(work / f"{name}.static{length}")
    if memory:  # peak memory at the range's top: the served build against a build of that length alone
        build(path, work / f"{name}.top", str(span[1]), threads, graph)  # its files are what is measured
        row["peak_rss_mb_at_top"] = {label: peak_rss_mb(work / f"{name}.{label}", span[1], threads)
                                     for label in ("served", "top")}
        print(name, "peak RSS at", span[1], row["peak_rss_mb_at_top"], flush=True)
    return row


def peak_rss_mb(folder: Path, length: int, threads: int) -> dict[str, float]:
    """The peak resident memory of a fresh process loading ``folder`` (TVM's load_module: the weights, and its
    transient copies of them), and the peak during one run at ``length`` alone (the peak is reset after the
    load, ``/proc/self/clear_refs`` 5: the resident weights plus what the run allocates; zero token inputs:
    every input of these models is int64 ids or a mask)."""
    # Model loads model.so on its first run: _load() first, so "loaded" holds the library and its weights.
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child of this (large) process
    # reported this process's peak.
    code = ("import sys, numpy as np; from pipeline.api import load; m = load(sys.argv[1], int(sys.argv[3])); "
            "hwm = lambda: next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')); "
            "n = int(sys.argv[2]); feeds = {t.name: np.zeros((1, n), t.dtype) for t in m.inputs}; m._load(); "
            "before = hwm(); open('/proc/self/clear_refs', 'w').write('5'); m.run(feeds); print(before, hwm())")
    out = subprocess.run([sys.executable, "-c", code, str(folder), str(length), str(threads)], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    before, after = (int(v) / 1024 for v in out.stdout.strip().splitlines()[-1].split())
    return {"load_peak_mb": round(before, 1), "run_peak_mb": round(after, 1)}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("lengths")]
    if not rows:
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False)
    for ax, row in zip(axes[0], rows):
        lengths = sorted(row["lengths"], key=int)
        engines = list(row["lengths"][lengths[0]]["ms"])
        for engine in engines:
            ax.plot([int(n) for n in lengths], [row["lengths"][n]["ms"].get(engine) for n in lengths], marker="o",
                    label=engine + (f" (one build, {row['range'][0]}..{row['range'][1]})"
                                    if engine == "served" else ""))
        ax.set_xlabel("sequence length")
        ax.set_ylabel("ms per inference (median, lower is better)")
        ax.set_title(row["model"])
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bert", help="comma-separated corpus names (models.exported), e.g. bert,gpt2")
    p.add_argument("--lengths", default="8,77,128,384", help="comma-separated lengths, none named at build time "
                                                             "(empty with --memory: the memory figure only)")
    p.add_argument("--range", default="2:512", help="LO:HI the served build is built for")
    p.add_argument("--graph", action="store_true", help="run the graph stage in every build (default: skipped)")
    p.add_argument("--memory", action="store_true", help="also the peak memory at the range's top: the served "
                                                          "build against a build of that length alone")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--trials", type=int, default=0, help="also the served build tuned with this many trials "
                                                         "(the build optimize-model ships), timed at every length")
    p.add_argument("--out", default="bench/results/dynamic", help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    lo, hi = (int(v) for v in args.range.split(":"))
    cpu = cpu_description()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = (f"{cpu.get('Model name', '?')} (L2 {cpu.get('L2 cache', '?')}), {args.threads} threads, "
             + (f"tuned: {args.trials} trials" if args.trials else "untuned"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                rows.append(bench_model(name, [int(n) for n in args.lengths.split(",") if n], (lo, hi), args.threads,
                                        args.runs, args.graph, Path(tmp), args.memory, args.trials))
            except UserError as exc:  # a model the served build refuses: recorded, the others still run
                print(name, "refused:", exc, flush=True)
                rows.append({"model": name, "range": [lo, hi], "refused": str(exc)})
            # after every model: a run cut short keeps the models it finished
            write_text_atomic(out.with_suffix(".json"), json.dumps(
                {"cpu": cpu, "threads": args.threads, "runs": args.runs, "graph_stage": args.graph,
                 "trials": args.trials, "rows": rows}, indent=2) + "\n")
            plot(rows, out.with_suffix(".png"), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
