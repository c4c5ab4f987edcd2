"""``tune-kernels`` end to end on a tiny matmul with the real measurer: JSON output, records, resume,
one-line user errors, and a config that fails to build not stopping the tuning."""
from __future__ import annotations

import json

import pytest

from pipeline.cli import tune_kernels_main as main

TINY = ["--op", "matmul", "--shape", "32,64,32", "--target", "llvm", "--threads", "1", "--workers", "1",
        "--no-progress"]


@pytest.mark.parametrize("argv, message", [
    (["--op", "gemm", "--shape", "1,2,3"], "unknown op 'gemm'"),
    (["--op", "matmul", "--shape", "128,768"], "bad shape '128,768' for matmul"),
    (["--op", "conv2d", "--shape", "1,x,3"], "bad shape"),
    (["--op", "matmul", "--shape", "4,4,4", "--searcher", "anneal"], "unknown searcher 'anneal'"),
    (["--op", "matmul", "--shape", "4,4,4", "--target", "tpu"], "unknown target 'tpu'"),
    (["--op", "matmul", "--shape", "4,4,4", "--stride", "2"], "apply to conv2d only"),
    (["--op", "matmul", "--shape", "4,4,4", "--trials", "0"], "--trials must be positive"),
    (["--shape", "4,4,4"], "--op is required"),
])
def test_user_errors_are_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_tunes_writes_json_and_resumes(tmp_path, capsys):
    records, out = tmp_path / "r.jsonl", tmp_path / "out.json"
    argv = TINY + ["--searcher", "opevo", "--trials", "6", "--seed", "1", "--records", str(records),
                   "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    assert {"best_gflops", "best_ms", "best_config", "trials", "numpy_gflops"} <= set(res)
    assert res["trials"] == 6 and res["best_gflops"] > 0 and res["numpy_gflops"] > 0
    assert res["best_ms"] == pytest.approx(2 * 32 * 64 * 32 / (res["best_gflops"] * 1e9) * 1e3)
    assert set(res["best_config"]) >= {"tile_i", "tile_j", "tile_k"}
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert len(lines) == 6 and {ln["task"] for ln in lines} == {res["task"]}
    # same command again: everything is in the records, nothing is measured, same answer
    assert main(argv) == 0
    again = json.loads(out.read_text())
    assert again["measured_now"] == 0 and again["best_config"] == res["best_config"]
    assert len(records.read_text().splitlines()) == 6


def test_config_failing_to_build_does_not_stop_tuning():
    from kerneltune import templates
    from kerneltune.measure import Measurer
    from kerneltune.searchers import make_searcher
    from kerneltune.task import make_task
    from kerneltune.tune import TaskRecords, tune
    from kerneltune.targets.host import llvm_target

    task = make_task("matmul", "32,64,32")
    target = llvm_target(1)
    space = templates.space_for(task, target)
    bad = tuple((v[0] * 2,) + v[1:] if isinstance(v, tuple) else v for v in templates.default_config(task, target))
    calls = []

    with Measurer(target, workers=1) as m:
        def measure(configs):   # the first config of the first batch is replaced by one the template rejects
            calls.append(configs)
            sent = [bad] + list(configs[1:]) if len(calls) == 1 else configs
            return m.measure(task, sent)

        res = tune(space, make_searcher("random", space, 0, batch_size=3), measure, 6,
                   TaskRecords(task.key, str(target)), progress=False)
    assert res.trials == 6 and res.failures >= 1 and res.best_gflops > 0
    assert len(calls) == 2


def test_numpy_baseline_gets_the_threads_and_the_cores_before_any_worker(monkeypatch, capsys):
    """The baseline is timed with --threads BLAS threads, before the measurer (its worker processes) starts."""
    from fake_measurer import FakeMeasurer

    from kerneltune import baseline, cli, measure

    events: list = []

    class Recording(FakeMeasurer):
        def __init__(self, target, rpc=None, **kw):
            super().__init__(target, rpc)
            events.append("measurer")

        def close(self):
            pass

    def recorded(m, k, n, threads, **kw):
        events.append(("baseline", threads))
        return baseline.numpy_baseline(m, k, n, threads, min_seconds=0.05, repeat=3)

    monkeypatch.setattr(measure, "Measurer", Recording)
    monkeypatch.setattr(cli, "numpy_baseline", recorded)
    assert main(TINY + ["--trials", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert events[:2] == [("baseline", 1), "measurer"] and events.count("measurer") == 1
    assert res["numpy_threads"] == 1 and res["numpy_gflops"] > 0
