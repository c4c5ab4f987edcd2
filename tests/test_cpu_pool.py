"""The parallel launcher a CPU model.so carries (pipeline.cpu_pool): the shipped library has it, loading
installs it in place of TVM's pool, and the model computes what onnxruntime does through it — with two
callers at once (one runs its loops inline), in a forked child (the workers are not copied), and with the
launcher's chunks claimed in any order.  Its effect on tail latency under load is a benchmark
(bench/contention.py), not a test."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BERT_TINY = ROOT / "models" / "bert_tiny.onnx"

CHILD = textwrap.dedent("""
    import ctypes, json, os, sys, threading
    import numpy as np
    import pipeline
    from graphopt.feeds import ort_session
    from pipeline import cpu_pool

    folder = sys.argv[1]
    model = pipeline.load(folder, threads=2)
    feeds = model.random_feeds(0)
    model.run(feeds)  # loads the library
    lib = ctypes.CDLL(os.path.join(folder, "model.so"))
    installed = (ctypes.c_void_p.in_dll(lib, cpu_pool.TVM_POINTER).value
                 == ctypes.cast(getattr(lib, cpu_pool.LAUNCH), ctypes.c_void_p).value)
    sess = ort_session(sys.argv[2], 2)
    want = sess.run(None, feeds)

    def err(outs):
        return max(float(np.max(np.abs(np.asarray(o) - w))) for o, w in zip(outs.values(), want))

    errors = [err(model.run(feeds)) for _ in range(20)]
    both = []
    def caller():
        both.extend(err(model.run(feeds)) for _ in range(20))
    threads = [threading.Thread(target=caller) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, json.dumps(err(model.run(feeds))).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = json.loads(os.read(r, 64))
    print(json.dumps({"installed": installed, "threads": model.threads, "serial": max(errors),
                      "concurrent": max(both), "n_concurrent": len(both), "forked": child}))
""")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from pipeline.context import BuildContext, TuneOptions
    from pipeline.optimize_model import optimize_model

    out = tmp_path_factory.mktemp("pool") / "bt"
    ctx = BuildContext.create("llvm", threads=2, skip_graph=True, tuning=TuneOptions(skip=True, progress=False))
    optimize_model(str(BERT_TINY), str(out), ctx)
    return out


def test_the_shipped_library_carries_the_launcher(built):
    out = subprocess.run(["nm", "-D", str(built / "model.so")], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("nm (binutils) is not installed")
    from pipeline import cpu_pool

    assert cpu_pool.LAUNCH in out.stdout and cpu_pool.TVM_POINTER in out.stdout


def test_the_launcher_is_installed_and_the_model_matches_onnxruntime_serial_concurrent_and_forked(built):
    import json

    proc = subprocess.run([sys.executable, "-c", CHILD, str(built), str(BERT_TINY)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["installed"] and got["threads"] == 2
    assert got["n_concurrent"] == 40
    for key in ("serial", "concurrent", "forked"):
        assert got[key] < 1e-4, (key, got)
