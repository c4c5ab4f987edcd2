"""Is ``bench-model``'s figure for each engine the figure that engine gets alone?

For each ONNX model: the model is compiled with the pipeline's default schedules (no graph stage, no
tuning), then each engine is timed

* **alone**, in a fresh process that runs nothing else: onnxruntime (its own defaults, ``--threads`` intra-op
  threads, spinning on as in production) and the exported TVM library on the Relax VM (``TVM_NUM_THREADS``
  = ``--threads``); 10 warm-up runs, median of ``--runs`` per session, three sessions per process, one
  process before and one after the in-process timing; the figure is the median of the six session medians
  (``alone_best_ms``, the best of them, is what the issue that asked for this check called "alone": on a
  shared machine the best session is a floor, so it is reported beside the median, not compared to one);
* **in bench-model**: :func:`pipeline.benchmark.bench` - the same code path as ``bench-model``, which times
  every engine with :func:`graphopt.timing.time_blocks`.

The ratio in-bench / alone is printed per engine; the check passes when it is within ``--tolerance``
(5%) for both engines.  Why it exists: the old call-by-call interleaved timer put onnxruntime at 16.5 ms on
MobileNet-v2 when it ran at 5.0 ms alone (see :mod:`graphopt.timing`).

    python bench/timer_check.py resnet50.onnx mobilenet_v2.onnx [--threads 2] [--runs 50] \
        [--input-shape input_ids=1,128 ...] [--json bench/results/timer_check.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from graphopt.fileio import write_text_atomic
from graphopt.timing import latency

WARMUP = 10
SESSIONS = 3


def lone(engine: str, model: str, feeds_path: str, threads: int, runs: int) -> list[float]:
    """Each session's median ms of one engine in THIS process (called in a fresh subprocess)."""
    feeds = dict(np.load(feeds_path))
    medians = []
    for _ in range(SESSIONS):
        if engine == "ort":
            from graphopt.feeds import ort_session

            sess = ort_session(model, threads)
            names = {i.name for i in sess.get_inputs()}
            f = {k: v for k, v in feeds.items() if k in names}

            def run(sess=sess, f=f):
                return sess.run(None, f)
        else:
            import tvm
            from tvm import relax

            dev = tvm.cpu()
            vm = relax.VirtualMachine(tvm.runtime.load_module(model), dev)
            names = json.loads(Path(model + ".inputs.json").read_text())
            args = [tvm.runtime.tensor(feeds[n], dev) for n in names]

            def run(vm=vm, args=args):
                out = vm["main"](*args)
                dev.sync()
                return out
        medians.append(latency(run, runs, WARMUP).p50_ms)  # back to back, as run-model times a deployed model
    return medians


def lone_in_fresh_process(engine: str, model: str, feeds_path: str, threads: int, runs: int) -> list[float]:
    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, __file__, "--lone", engine, model, "--feeds", feeds_path,
                          "--threads", str(threads), "--runs", str(runs)],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_model(path: str, threads: int, runs: int, tolerance: float, workdir: Path, input_shapes=None) -> dict:
    from kerneltune.targets.parse import parse_target
    from graphopt.feeds import sample_feeds
    from pipeline.benchmark import bench
    import onnx

    from pipeline import stages
    from pipeline.chain import ChainRequest, Until, run_chain
    from pipeline.context import BuildContext

    spec = parse_target("llvm", threads)
    ctx = BuildContext.create("llvm", threads=threads, skip_graph=True)  # the build optimize-model --skip-graph makes
    lowered = run_chain(ctx, ChainRequest(onnx.load(path), input_shapes, until=Until.PARTITION)).lowered
    imported = lowered.imported
    compiled = stages.build(lowered, spec)
    lib = workdir / (Path(path).stem + ".so")
    compiled.export(lib)
    (workdir / (lib.name + ".inputs.json")).write_text(json.dumps(compiled.input_names))
    feeds = sample_feeds(imported.graph, None, 0)
    feeds_path = str(workdir / (Path(path).stem + ".npz"))
    np.savez(feeds_path, **feeds)

    def alone() -> dict[str, list[float]]:
        return {"ort": lone_in_fresh_process("ort", path, feeds_path, threads, runs),
                "tvm": lone_in_fresh_process("tvm", str(lib), feeds_path, threads, runs)}

    before = alone()
    res = bench(imported, {"tvm": compiled}, BuildContext.create(spec.request, threads=threads), runs, Path(path).name)
    after = alone()
    out: dict = {"load": os.getloadavg(), "alone_before_ms": before, "alone_after_ms": after, "engines": {}}
    for eng in ("ort", "tvm"):
        sessions = before[eng] + after[eng]
        a, best = statistics.median(sessions), min(sessions)
        b = res.timings[eng].median_ms
        out["engines"][eng] = {"alone_ms": round(a, 4), "alone_best_ms": round(best, 4), "bench_ms": round(b, 4),
                               "bench_min_ms": round(res.timings[eng].min_ms, 4), "ratio": round(b / a, 4),
                               "ratio_vs_best": round(b / best, 4), "ok": abs(b / a - 1) <= tolerance}
    out["ok"] = all(e["ok"] for e in out["engines"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D1,D2",
                   help="static size of a symbolic input (repeatable; applies to every model with that input)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--lone", choices=("ort", "tvm"), help=argparse.SUPPRESS)
    p.add_argument("--feeds", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lone:
        print(json.dumps(lone(args.lone, args.models[0], args.feeds, args.threads, args.runs)))
        return 0
    from graphopt.onnx_io import parse_input_shapes
    from kerneltune.targets.threads import set_num_threads

    set_num_threads(args.threads)
    shapes = parse_input_shapes(args.input_shape)
    report: dict = {"threads": args.threads, "runs": args.runs, "tolerance": args.tolerance, "models": {}}
    with tempfile.TemporaryDirectory(prefix="timer_check_") as tmp:
        for path in args.models:
            r = report["models"][Path(path).name] = check_model(path, args.threads, args.runs, args.tolerance,
                                                                Path(tmp), shapes)
            row = "  ".join(f"{e}: bench {v['bench_ms']:.3f} ms / alone {v['alone_ms']:.3f} ms = {v['ratio']:.3f}"
                            for e, v in r["engines"].items())
            print(f"{Path(path).name:28s} {row}  {'ok' if r['ok'] else 'OFF BY > ' + format(args.tolerance, '.0%')}",
                  flush=True)
    report["ok"] = all(r["ok"] for r in report["models"].values())
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
