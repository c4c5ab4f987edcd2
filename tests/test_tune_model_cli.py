"""``tune-kernels MODEL --trials N`` (issue 43): a model's tasks tuned by optimize-model's own tuning stage, each
task's default and best time and config printed, the records written in the format optimize-model reads (it
measures nothing again), ``--timeout`` and ``--early-stop`` reported, and every wrong option one line, exit 2.
A tiny MLP (two matmul tasks) and a fake measurer (a latency that is a fixed function of the config, with
the real measurer's cold-cache timing), so no kernel is compiled for tuning."""
from __future__ import annotations

import json
import time

import onnx
import pytest

from fake_measurer import FakeMeasurer
from kerneltune import tune_tasks
from pipeline.cli import optimize_model_main, tune_kernels_main as main
from test_outputs import mlp

FAST = ["--threads", "1", "--no-progress"]


class ColdFake(FakeMeasurer):
    """Records its trials as the real measurer does on a CPU (cold caches), so optimize-model resumes them."""

    timing = "cold"


class SlowFake(ColdFake):
    def seen(self, task, configs):
        time.sleep(0.05)


class NoMeasuring(ColdFake):
    def seen(self, task, configs):
        raise AssertionError(f"measured {len(configs)} configs of {task.name}: the records should have held them")


@pytest.fixture
def model(tmp_path, monkeypatch):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), str(path))
    monkeypatch.setattr(tune_tasks, "_lazy_measurer", ColdFake)
    monkeypatch.chdir(tmp_path)  # the default records file goes here
    return path


def test_tunes_the_selected_task_prints_default_best_and_config_and_optimize_model_reuses_it(model, tmp_path,
                                                                                              capsys, monkeypatch):
    records, out = tmp_path / "r.jsonl", tmp_path / "t.json"
    assert main([str(model), "--kernels", "0", "--trials", "4", "--records", str(records), "--json", str(out),
                 *FAST]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out.read_text())
    (task,) = res["tasks"]
    assert task["index"] == 0 and task["trials"] == 4 and task["best_ms"] <= task["default_ms"] == 1.0
    assert lines[0].startswith(f"task 0 {task['name']} (matmul, x1): default 1 ms -> best {task['best_ms']:.4g} ms")
    assert ("tile_i=" in lines[0]) == (task["config"] is not None)
    assert lines[1].startswith("4 trials (4 measured now) in ") and "stopped: the --trials budget was spent" in lines[1]
    assert lines[2].startswith(f"records: {records}")
    assert res["stop_reason"] == "budget" and res["trials"] == 4
    assert len(records.read_text().splitlines()) == 4
    # optimize-model with the same selection, budget and seed finds every trial in the records
    monkeypatch.setattr(tune_tasks, "_lazy_measurer", NoMeasuring)
    built = tmp_path / "built"
    assert optimize_model_main([str(model), "--skip-graph", "--kernels", "0", "--trials", "4", "--records",
                                str(records), "-o", str(built), *FAST]) == 0
    tune = json.loads((built / "report.json").read_text())["stages"]["tune"]
    assert tune["measured_now"] == 0 and tune["stop_reason"] == "budget"
    assert [(t["index"], t["best_ms"]) for t in tune["tasks"]] == [(0, task["best_ms"])]


def test_without_kernels_every_tunable_task_is_tuned_into_the_default_records_file(model, capsys):
    assert main([str(model), "--trials", "16", *FAST]) == 0
    out = capsys.readouterr().out
    assert out.startswith("task 0 ") and "\ntask 1 " in out
    assert len(open("mlp.records.jsonl").read().splitlines()) == 16


def test_the_timeout_stops_it_and_says_so(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tune_tasks, "_lazy_measurer", SlowFake)
    out = tmp_path / "t.json"
    assert main([str(model), "--trials", "100000", "--timeout", "0.3", "--json", str(out), *FAST]) == 0
    res = json.loads(out.read_text())
    assert res["stop_reason"] == "timeout" and res["timeout_s"] == 0.3 and 2 <= res["trials"] < 100000
    captured = capsys.readouterr()
    assert "stopped: the --timeout stopped it" in captured.out
    assert "note: tuning stopped at the --timeout of 0.3 s after " in captured.err


def test_early_stop_is_reported_per_task(model, tmp_path, capsys, monkeypatch):
    class Flat(ColdFake):
        def latency(self, task, config, default):
            return 1e-3

    monkeypatch.setattr(tune_tasks, "_lazy_measurer", Flat)
    out = tmp_path / "t.json"
    assert main([str(model), "--trials", "1000", "--early-stop", "4", "--json", str(out), *FAST]) == 0
    res = json.loads(out.read_text())
    assert res["stop_reason"] == "early_stop" and res["early_stopped"] == [0, 1] and res["trials"] < 1000
    assert all(t["early_stopped"] and t["config"] is None for t in res["tasks"])
    out_lines = capsys.readouterr().out.splitlines()
    assert "stopped improving" in out_lines[0] and "default config kept" in out_lines[0]


@pytest.mark.parametrize("argv, words", [
    ([], ("--trials is not given", "--list")),
    (["--kernels", "0"], ("--kernels 0 picks the kernels to tune", "--trials is not given")),
    (["--trials", "0"], ("--trials 0", "positive")),
    (["--trials", "8", "--timeout", "0"], ("--timeout", "positive number of seconds")),
    (["--trials", "8", "--timeout", "-5"], ("--timeout",)),
    (["--trials", "8", "--early-stop", "0"], ("--early-stop 0", "positive number of trials")),
    (["--trials", "8", "--early-stop", "-2"], ("--early-stop -2",)),
    (["--trials", "8", "--searcher", "anneal"], ("unknown searcher 'anneal'",)),
    (["--trials", "8", "--kernels", "9"], ("--kernels 9", "only 2 tasks")),
    (["--list", "--trials", "8"], ("--list does not tune", "--trials")),
    (["--trials", "8", "--workers", "2"], ("--workers applies to --op only",)),
])
def test_model_mode_mistakes_are_one_line_exit_2(model, argv, words, capsys):
    assert main([str(model), *argv, *FAST]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and err.count("\n") == 1, err
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("argv, words", [
    (["--op", "matmul", "--shape", "4,4,4", "--timeout", "0"], ("--timeout",)),
    (["--op", "matmul", "--shape", "4,4,4", "--early-stop", "0"], ("--early-stop 0",)),
    (["--op", "matmul", "--shape", "4,4,4", "--kernels", "0"], ("--kernels 0 picks tasks of a MODEL",)),
])
def test_op_mode_refuses_bad_stop_values(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), err


@pytest.mark.parametrize("argv, words", [
    (["--trials", "8", "--timeout", "0"], ("--timeout",)),
    (["--trials", "8", "--early-stop", "0"], ("--early-stop 0", "positive number of trials")),
    (["--timeout", "60"], ("--timeout 60 ends kernel tuning early, but --trials is 0",)),
    (["--trials", "8", "--skip-tune", "--early-stop", "5"], ("--early-stop 5", "--skip-tune is given")),
])
def test_optimize_model_refuses_bad_stop_values(model, tmp_path, argv, words, capsys):
    assert optimize_model_main([str(model), "-o", str(tmp_path / "o"), *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), err


def test_the_api_takes_the_stop_options_and_refuses_bad_ones(model):
    from graphopt.errors import UserError
    from pipeline.api import check_arguments

    check_arguments({"tuning_timeout": 30, "early_stop": 16})
    check_arguments({"tuning_timeout": None, "early_stop": None})
    for name, value in (("tuning_timeout", 0), ("tuning_timeout", True), ("early_stop", 0), ("early_stop", 2.5)):
        with pytest.raises(UserError, match=f"{name}="):
            check_arguments({name: value})
