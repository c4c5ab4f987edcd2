"""Tail latency on a busy server: p50/p99 of our built model and of onnxruntime, quiet and with 1 and 2 busy
processes (pure-Python spin loops, one core each) on this machine.

Why: servers share cores.  TVM's thread pool gives task i of every parallel loop to worker i and waits for
all of them; with every core contended, bert_tiny's p99 was 264 ms against onnxruntime's 6.2 ms (42x).  The
shipped model.so carries its own launcher (:mod:`pipeline.cpu_pool`); ``ours_tvm_pool`` runs the same library
on TVM's pool, to show the difference.

Each model is built once (``optimize-model --skip-graph --skip-tune`` into a temporary folder); each engine
then runs in a fresh subprocess per load level (its thread pool starts under the load, as a server's would),
``--runs`` timed runs after the warm-up, every run timed on its own (:func:`graphopt.timing.latency`).  The engines alternate per level,
ours first.  ``--env KEY=VALUE`` (repeatable) sets the environment of our engine's process, to compare pool
settings (e.g. ``--env TVM_BIND_THREADS=1 --env TVM_THREAD_POOL_SPIN_COUNT=300000``, TVM's defaults).

    python bench/contention.py [--models bert_tiny,mobilenet_v2] [--runs 200] [--threads 2] \
        [--json bench/results/contention.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphopt.fileio import write_text_atomic  # noqa: E402
from pipeline.cpu_pool import POOL_VARIABLE  # noqa: E402

LOADS = (0, 1, 2)
# ours: the shipped model.so with its own parallel launcher (pipeline.cpu_pool); ours_tvm_pool: the same
# library on TVM's runtime pool (OPTIMIZE_MODEL_POOL=tvm), what every build shipped before it
ENGINES = ("ours", "ours_tvm_pool", "onnxruntime")
BUSY = "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    pass\n"


def model_file(name: str, work: Path) -> tuple[Path, list[str]]:
    """The ONNX file of ``name`` (the bundled bert_tiny, or a corpus export at full size) and its shape args."""
    if name == "bert_tiny":
        return ROOT / "models" / "bert_tiny.onnx", []
    out = work / f"{name}.onnx"
    subprocess.run([sys.executable, "-m", "models", "export", name, "--exporter", "dynamo", "--size", "full",
                    "-o", str(out)], check=True, cwd=ROOT)
    meta = json.loads(out.with_name(out.name + ".json").read_text())
    return out, list(meta.get("shape_args", []))


def child(engine: str, folder: str, onnx_path: str, threads: int, runs: int) -> None:
    """Run in a subprocess: the latency distribution of ``runs`` single inferences of one engine, timed by
    the project's per-call timer (:func:`graphopt.timing.latency`, what run-model reports), as JSON."""
    import pipeline
    from graphopt.feeds import ort_session
    from graphopt.timing import latency

    model = pipeline.load(folder, threads=threads)
    feeds = model.random_feeds(0)  # seeded: both engines get the same inputs
    if engine.startswith("ours"):
        result = model.latency(feeds, runs)
    else:
        sess = ort_session(onnx_path, threads)
        result = latency(lambda: sess.run(None, feeds), runs)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(result).items()}))


@contextlib.contextmanager
def busy(n: int, seconds: float):
    procs = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=seconds)]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def measure(engine: str, folder: Path, onnx_path: Path, threads: int, runs: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", engine, str(folder), str(onnx_path),
                          "--threads", str(threads), "--runs", str(runs)], capture_output=True, text=True,
                         env={**os.environ, **(env if engine.startswith("ours") else {}),
                              **({POOL_VARIABLE: "tvm"} if engine == "ours_tvm_pool" else {})}, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert_tiny,mobilenet_v2")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for our engine's process")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "contention.json"))
    p.add_argument("--child", nargs=3, metavar=("ENGINE", "FOLDER", "ONNX"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child, args.threads, args.runs)
        return 0
    from kerneltune.targets.host import host_cpu, host_model_name

    env = dict(kv.split("=", 1) for kv in args.env)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            onnx_path, shape_args = model_file(name, work)
            folder = work / f"{name}-built"
            subprocess.run(["optimize-model", str(onnx_path), "--target", "llvm", "--skip-graph", "--skip-tune",
                            "-o", str(folder), "-q", *shape_args], check=True)
            row = {"model": name, "levels": {}}
            for n in LOADS:
                level = {}
                with busy(n, 600):
                    for engine in ENGINES:
                        level[engine] = measure(engine, folder, onnx_path, args.threads, args.runs, env)
                level["p99_ratio"] = round(level["ours"]["p99_ms"] / level["onnxruntime"]["p99_ms"], 3)
                row["levels"][f"busy{n}"] = level
                print(f"{name:14s} busy={n}  " + "  | ".join(
                    f"{e} p50 {level[e]['p50_ms']:8.3f} p99 {level[e]['p99_ms']:8.3f}" for e in ENGINES)
                    + f"  | p99 ratio {level['p99_ratio']:.2f}", flush=True)
            rows.append(row)
    out = {"cpu": host_model_name(), "mcpu": host_cpu(), "threads": args.threads, "cores": os.cpu_count(),
           "env": env, "busy_processes": list(LOADS), "rows": rows}
    write_text_atomic(Path(args.json), json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
