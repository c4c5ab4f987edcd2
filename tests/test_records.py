"""Records and the tuning loop: durable appends, tolerant loading, resume without re-measuring, SIGKILL
survival, and failures that do not stop tuning (synthetic measurers, no TVM)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

from kerneltune.records import Record, RecordLog
from kerneltune.searchers import make_searcher
from kerneltune.space import FactorKnob, SearchSpace
from kerneltune.tune import TaskRecords, tune

SPACE = SearchSpace([FactorKnob("i", 64, 3), FactorKnob("k", 32, 2)])


@dataclass
class Result:
    gflops: float
    latency_s: float | None
    error: str | None = None


def synthetic(configs):
    return [Result(float(c[0][-1] * c[1][-1]), 1.0 / (c[0][-1] * c[1][-1])) for c in configs]


def test_append_load_roundtrip_and_filter(tmp_path):
    path = tmp_path / "r.jsonl"
    with RecordLog(path) as log:
        log.append([Record(task="t1", target="llvm", config={"i": [4, 4, 4]}, gflops=10.0, latency_s=0.1, error=None,
                           time=1.0, extra={"build_s": 0.5}),
                    Record(task="t2", target="llvm", config={"i": [64, 1, 1]}, gflops=0.0, latency_s=None,
                           error="build failed: x", time=2.0)])
    recs = RecordLog(path).load()
    assert [r.task for r in recs] == ["t1", "t2"] and recs[0].extra == {"build_s": 0.5}
    assert recs[1].error == "build failed: x"
    assert [r.task for r in RecordLog(path).load(task="t2", target="llvm")] == ["t2"]
    assert RecordLog(path).load(target="cuda") == []


def test_corrupt_trailing_line_is_skipped_and_isolated(tmp_path, caplog):
    path = tmp_path / "r.jsonl"
    RecordLog(path).append([Record("t", "llvm", {"i": [1]}, 1.0, 1.0)])
    with open(path, "ab") as fh:
        fh.write(b'{"task": "t", "target": "llvm", "conf')   # a write cut short by a kill
    with caplog.at_level(logging.WARNING):
        assert len(RecordLog(path).load()) == 1
    assert "line 2 is not a valid tuning record" in caplog.text
    with RecordLog(path) as log:
        log.append([Record("t", "llvm", {"i": [2]}, 2.0, 0.5)])
    assert [r.config for r in RecordLog(path).load()] == [{"i": [1]}, {"i": [2]}]


def test_resume_measures_only_new_configs(tmp_path):
    path = tmp_path / "r.jsonl"
    measured = []

    def measure(configs):
        measured.extend(configs)
        return synthetic(configs)

    def go(trials):
        with RecordLog(path) as log:
            return tune(SPACE, make_searcher("opevo", SPACE, 0), measure, trials, TaskRecords("t", "llvm", log),
                        progress=False)

    first = go(20)
    assert first.measured_now == 20 and len(measured) == 20
    second = go(40)
    assert second.trials == 40 and second.measured_now == 20
    assert len(measured) == len(set(measured)) == 40      # nothing measured twice
    assert second.best_gflops >= first.best_gflops
    assert go(40).measured_now == 0 and len(measured) == 40
    assert len(RecordLog(path).load()) == 40


def test_failures_do_not_stop_tuning(tmp_path):
    """Per-config failures become fitness 0 with their reason; a measurer that raises loses only its batch."""
    calls = {"n": 0}

    def flaky(configs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("worker pool died")
        return [Result(0.0, None, "build failed: too many registers") if c[1][-1] == 32 else r
                for c, r in zip(configs, synthetic(configs))]

    path = tmp_path / "r.jsonl"
    with RecordLog(path) as log:
        res = tune(SPACE, make_searcher("random", SPACE, 0), flaky, 40, TaskRecords("t", "llvm", log), progress=False)
    assert res.trials == 40 and res.best_gflops > 0 and res.failures >= 8
    recs = RecordLog(path).load()
    assert len(recs) == 40
    assert sum("worker pool died" in (r.error or "") for r in recs) == 8
    assert all(r.gflops == 0 and r.latency_s is None for r in recs if r.error)


def test_measurer_that_always_raises_is_reported():
    def broken(configs):
        raise ValueError("no such target")

    with pytest.raises(ValueError, match="no such target"):
        tune(SPACE, make_searcher("random", SPACE, 0), broken, 40, TaskRecords("t", "llvm"), progress=False)


SLOW_TUNER = textwrap.dedent("""
    import sys, time
    from dataclasses import dataclass
    from kerneltune.records import RecordLog
    from kerneltune.searchers import make_searcher
    from kerneltune.space import FactorKnob, SearchSpace
    from kerneltune.tune import TaskRecords, tune

    @dataclass
    class R:
        gflops: float
        latency_s: float
        error: str = None

    space = SearchSpace([FactorKnob("i", 64, 3), FactorKnob("k", 32, 2)])
    def measure(configs):
        time.sleep(float(sys.argv[3]))
        return [R(float(c[0][-1] * c[1][-1]), 1.0) for c in configs]
    with RecordLog(sys.argv[1]) as log:
        res = tune(space, make_searcher("opevo", space, 0), measure, int(sys.argv[2]), TaskRecords("t", "llvm", log),
                   progress=False)
    print(res.measured_now)
""")


def test_sigkill_loses_at_most_the_inflight_batch(tmp_path):
    path = tmp_path / "r.jsonl"
    script = tmp_path / "slow_tuner.py"
    script.write_text(SLOW_TUNER)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, str(script), str(path), "60", "0.15"], env=env)
    deadline = time.time() + 60
    while time.time() < deadline and (not path.exists() or path.read_bytes().count(b"\n") < 16):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = path.read_bytes()
    n_before = before.count(b"\n")
    assert 16 <= n_before < 60, "the run was not killed mid-way"
    assert n_before % 8 == 0 or not before.endswith(b"\n")   # whole batches, or one cut inside a line
    out = subprocess.run([sys.executable, str(script), str(path), "60", "0"], env=env, capture_output=True,
                         text=True, check=True)
    after = path.read_bytes()
    assert after.startswith(before.rsplit(b"\n", 1)[0])       # nothing written before the kill was lost
    recs = RecordLog(path).load()
    configs = [json.dumps(r.config, sort_keys=True) for r in recs]
    assert len(configs) == len(set(configs)) == 60              # no duplicates, budget completed
    kept = sum(1 for line in before.split(b"\n") if line.strip().endswith(b"}"))
    assert int(out.stdout.strip()) == 60 - kept                  # only the missing trials were measured


def test_resume_only_takes_records_of_the_same_timing(tmp_path):
    """Warm-cache and cold-cache latencies are not comparable: a cold run must not resume warm records."""
    path = tmp_path / "r.jsonl"
    with RecordLog(path) as log:
        tune(SPACE, make_searcher("random", SPACE, 0), synthetic, 6, TaskRecords("t", "llvm", log, "warm"),
             progress=False)
    with RecordLog(path) as log:
        cold = tune(SPACE, make_searcher("random", SPACE, 1), synthetic, 4, TaskRecords("t", "llvm", log, "cold"),
                    progress=False)
    assert cold.measured_now == 4
    recs = RecordLog(path).load()
    assert [r.timing for r in recs] == ["warm"] * 6 + ["cold"] * 4
    assert len(RecordLog(path).load(task="t", timing="cold")) == 4
    with RecordLog(path) as log:
        again = tune(SPACE, make_searcher("random", SPACE, 1), synthetic, 4, TaskRecords("t", "llvm", log, "cold"),
                     progress=False)
    assert again.measured_now == 0 and again.trials == 4


def test_bad_and_forged_records_are_skipped_and_never_become_best(tmp_path, caplog):
    """A records file is input: wrong types, impossible values and forged speeds are warned about and never
    believed; the configs they name are measured for real."""
    space = SearchSpace([FactorKnob("i", 4, 2), FactorKnob("k", 2, 2)])   # 3 x 2 = 6 configs
    flops, ceiling = 2e6, 1000.0
    configs = [space.from_dict({"i": list(i), "k": list(k)}) for i in ((1, 4), (2, 2), (4, 1)) for k in ((1, 2), (2, 1))]
    path = tmp_path / "r.jsonl"
    lines = [
        {"gflops": None, "latency_s": 1e-3},             # null
        {"gflops": "fast", "latency_s": 1e-3},           # a string
        {"gflops": -5.0, "latency_s": 1e-3},             # negative
        {"gflops": 50.0, "latency_s": 1e-3},             # 2e6 FLOPs in 1 ms is 2 GFLOP/s, not 50
        {"gflops": 1e6, "latency_s": 2e-9},              # consistent, but above the target's ceiling
        {"gflops": 5.0, "latency_s": None},              # a result without a latency
    ]
    path.write_text("".join(json.dumps({"task": "t", "target": "llvm", "config": space.as_dict(c), "error": None,
                                        "timing": "warm", **d}) + "\n" for c, d in zip(configs, lines)))
    measured = []

    def measure(cs):
        measured.extend(cs)
        return [Result(flops / 1e-2 / 1e9, 1e-2) for _ in cs]   # 0.2 GFLOP/s: slow, but real

    with caplog.at_level(logging.WARNING):
        with RecordLog(path) as log:
            res = tune(space, make_searcher("random", space, 0), measure, 6,
                       TaskRecords("t", "llvm", log, flops=flops, ceiling=ceiling), progress=False)
    assert sorted(measured) == sorted(configs)                   # nothing stored was believed
    assert res.best_gflops == pytest.approx(0.2) and res.measured_now == 6
    assert caplog.text.count("is not a valid tuning record") == 4  # null, string, negative, no latency
    assert "disagrees with the task's" in caplog.text and "above the target's ceiling" in caplog.text


def test_gflops_ceiling_catches_a_forged_speed_on_this_host():
    from kerneltune.targets.host import llvm_target
    from kerneltune.targets.registry import gflops_ceiling

    ceiling = gflops_ceiling(llvm_target(2))
    assert 200 < ceiling < 1e6   # above any real 2-core fp32 kernel, far below a forged 1e6


HOLDER = textwrap.dedent("""
    import sys, time
    from kerneltune.records import RecordLog
    log = RecordLog(sys.argv[1])
    log.acquire()
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def test_one_tuner_per_records_file(tmp_path, capsys):
    """A second writer waits a bounded time, then refuses with one line naming the file and the holder."""
    from graphopt.errors import UserError

    path = tmp_path / "r.jsonl"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "60"], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(UserError) as err:
            RecordLog(path).acquire(wait_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 5
        msg = str(err.value)
        assert str(path) in msg and f"PID {holder.pid}" in msg and "\n" not in msg
        with pytest.raises(UserError, match="in use by another tuner"):
            with RecordLog(path) as log:
                tune(SPACE, make_searcher("random", SPACE, 0), synthetic, 4, TaskRecords("t", "llvm", log),
                     progress=False)
        # optimize-model refuses before any work (no graph stage, no output directory), in one line.
        from pathlib import Path

        from pipeline.cli import optimize_model_main

        bert = Path(__file__).resolve().parents[1] / "models" / "bert_tiny.onnx"
        rc = optimize_model_main([str(bert), "--trials", "8", "--records", str(path), "-o", str(tmp_path / "o")])
        assert rc == 2 and not (tmp_path / "o").exists()
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"in use by another tuner (PID {holder.pid})" in err
    finally:
        holder.kill()
        holder.wait()
    # A holder that finishes within the wait lets the second one go on.
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "0.5"], env=env, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "locked"
    with RecordLog(path) as log:
        log.acquire(wait_s=30)
        log.append([Record("t", "llvm", {"i": [1, 1, 64]}, 1.0, 1.0)])
    holder.wait()
    assert len(RecordLog(path).load()) == 1
