"""Building and running in a child forked from a process that built and ran a model (multiprocessing's
default start method on Linux): TVM's CPU pool belongs to the thread that used it and its workers are not
copied by fork(), so without :func:`kerneltune.targets.threads.fork_safe` the child's first parallel loop
waits forever.  Each case runs in a fresh interpreter (not pytest's process) with a deadline: a hang fails."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, multiprocessing as mp, os, sys
    import numpy as np
    import pipeline
    from models.mlp import build_mlp

    work = sys.argv[1]
    model = build_mlp(batch=8, sizes=(64, 128, 10))
    feeds = {"input": np.random.default_rng(0).standard_normal((8, 64)).astype("float32")}
    parent = pipeline.optimize(model, output=os.path.join(work, "parent"), skip_graph=True, skip_tune=True,
                               threads=2)
    want = parent.run(feeds)["output"]  # the parent's pool (TVM's, or the library's own) has run

    def child(queue, mode):
        if mode == "build":
            built = pipeline.optimize(model, output=os.path.join(work, "child"), skip_graph=True, skip_tune=True,
                                      threads=2)
        else:
            built = pipeline.load(os.path.join(work, "parent"))
        got = built.run(feeds)["output"]
        queue.put(float(np.max(np.abs(got - want))))

    out = {}
    for mode in sys.argv[2:]:
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue, mode))
        proc.start()
        proc.join(120)
        if proc.is_alive():
            proc.kill()
            out[mode] = "hung"
        else:
            out[mode] = queue.get() if proc.exitcode == 0 else f"exit {proc.exitcode}"
    print(json.dumps(out))
""")


def run_forked(tmp_path, modes: list[str], pool: str | None = None) -> dict:
    import os

    env = dict(os.environ)
    env.pop("OPTIMIZE_MODEL_POOL", None)
    if pool:
        env["OPTIMIZE_MODEL_POOL"] = pool
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *modes], capture_output=True, text=True,
                          timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork() on this platform")
def test_a_forked_child_builds_and_runs_after_the_parent_built_and_ran(tmp_path):
    got = run_forked(tmp_path, ["build", "load"])
    assert got["build"] == 0.0 and got["load"] == 0.0, got


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork() on this platform")
def test_a_forked_child_runs_on_tvms_own_pool(tmp_path):
    got = run_forked(tmp_path, ["load"], pool="tvm")
    assert got["load"] == 0.0, got
