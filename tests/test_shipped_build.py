"""Tuning never ships a slower model: every task's default is measured and recorded first and kept unless
a tuned config beats it (also after a resume), and optimize-model times the tuned build against the
default build end to end and ships the faster one, deterministically on a rerun (the verdict is recorded).
Fake measurers stand for the kernel timings; the builds and the model check are real (bert-tiny)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("TVM_NUM_THREADS", "2")

from graphopt.timing import SIGN_LEVEL, Timing, compare, replay, sign_test_p  # noqa: E402
from fake_measurer import FakeMeasurer as BaseFake  # noqa: E402
from kerneltune.records import RecordLog  # noqa: E402

BERT_TINY = Path(__file__).resolve().parents[1] / "models" / "bert_tiny.onnx"


class Interrupted(BaseException):
    """A kill, in-process."""


class Fake(BaseFake):
    """Default config 1 ms; other configs ``lo``..``lo + 1`` ms, a fixed function of the config."""

    lo = 1.5  # > 1: every tuned config is slower than the default
    calls = 0
    stop_after = None

    def seen(self, task, configs):
        Fake.calls += 1
        if Fake.stop_after is not None and Fake.calls >= Fake.stop_after:
            raise Interrupted()


@pytest.fixture
def fake(monkeypatch):
    import pipeline.tuning as tuning

    real = tuning.tune_model
    monkeypatch.setattr(tuning, "tune_model", lambda *a, **k: real(*a, **k, measure_factory=Fake))
    Fake.lo, Fake.calls, Fake.stop_after = 1.5, 0, None
    yield Fake


def optimize(out: Path, trials: int = 24):
    from pipeline.context import BuildContext, TuneOptions
    from pipeline.optimize_model import optimize_model

    return optimize_model(str(BERT_TINY), str(out), BuildContext.create(
        threads=2, skip_graph=True, tuning=TuneOptions(trials, "matmul", searcher="opevo", progress=False))).report


def tuned_schedules(report) -> dict[str, str]:
    return {t["name"]: t["schedule"] for t in report["tasks"] if t["kind"] == "matmul"}


def test_defaults_are_kept_when_every_tuned_config_is_slower_also_after_a_resume(tmp_path, fake):
    fake.stop_after = 6  # killed in the middle of the scheduled rounds
    with pytest.raises(Interrupted):
        optimize(tmp_path)
    fake.stop_after = None
    report = optimize(tmp_path)
    tune = report["stages"]["tune"]
    assert tune["trials"] == 24 and tune["measured_now"] < 24  # the killed run's trials were resumed
    assert set(tuned_schedules(report).values()) == {"template"}  # every task kept its default schedule
    assert tune["e2e"]["kept"] == "default" and tune["e2e"]["status"].startswith("skipped: no tuned config")
    for t in tune["tasks"]:
        assert t["default_ms"] == pytest.approx(1.0) and t["best_ms"] == pytest.approx(1.0)
    # The defaults are trials like any other: each task's first record is its default config, measured once.
    recs = RecordLog(tmp_path / "records.jsonl").load()
    firsts = {}
    for r in recs:
        firsts.setdefault(r.task, r)
    assert all(r.latency_s == pytest.approx(1e-3) for r in firsts.values())
    assert len({(r.task, json.dumps(r.config, sort_keys=True)) for r in recs}) == len(recs) == 24


def fake_timer(tuned_ms: float, calls: list):
    from graphopt.timing import time_blocks

    def timer(runners, runs, warmup=3, **kw):
        if set(runners) != {"baseline", "candidate"}:  # report.json's latency of the shipped build: real
            return time_blocks(runners, runs, warmup, **kw)
        calls.append(list(runners))
        for run in runners.values():  # the builds really run (they must not crash); the times are made up
            run()
        return {"baseline": Timing(1.0, 0.9), "candidate": Timing(tuned_ms, tuned_ms * 0.9)}
    return timer


def test_tuned_build_that_loses_end_to_end_ships_the_default_and_a_rerun_keeps_the_verdict(
        tmp_path, fake, monkeypatch, capsys):
    import graphopt.timing as timing
    from graphopt import verdicts
    from pipeline.cli import optimize_model_main

    monkeypatch.setattr(verdicts, "store_path", lambda: tmp_path / "verdicts.json")  # no verdict of another test
    fake.lo = 0.4  # many tuned configs beat the defaults per kernel ...
    calls: list = []
    monkeypatch.setattr(timing, "time_blocks", fake_timer(1.1, calls))  # ... but the model got slower
    argv = [str(BERT_TINY), "--skip-graph", "--threads", "2", "--trials", "24", "--kernels", "matmul",
            "-o", str(tmp_path), "--no-progress"]
    assert optimize_model_main(argv) == 0
    assert "note: tuning lost: the tuned build was slower end to end" in capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    e2e = report["stages"]["tune"]["e2e"]
    assert e2e["kept"] == "default" and e2e["status"] == "measured" and e2e["ratios"] == [1.1] * 3
    assert set(tuned_schedules(report).values()) == {"template"}
    assert calls == [["baseline", "candidate"], ["candidate", "baseline"], ["baseline", "candidate"]]
    # The same command again: the tuning is all in the records and the verdict too; even a timer that would
    # now favour the tuned build is not consulted, so the artifact is the same.
    calls.clear()
    monkeypatch.setattr(timing, "time_blocks", fake_timer(0.5, calls))
    assert optimize_model_main(argv) == 0
    again = json.loads((tmp_path / "report.json").read_text())
    assert calls == [] and again["stages"]["tune"]["e2e"]["status"] == "recorded"
    assert again["stages"]["tune"]["e2e"]["kept"] == "default" and tuned_schedules(again) == tuned_schedules(report)
    assert again["stages"]["tune"]["measured_now"] == 0
    # Blocks recorded under the old every-block rule (undecided on 6 faster blocks of 7: the default shipped)
    # are judged again by today's sign test: the tuned build ships, still without timing.
    path = verdicts.store_path()
    stored = json.loads(path.read_text())
    (key,) = [k for k in stored if k.startswith("tuning|")]
    stored[key] = [1.0, 0.9, 0.986, 0.945, 0.941, 0.818, 0.913, 0.899, 0.853]
    path.write_text(json.dumps(stored))
    verdicts._store.cache_clear()  # the process's store reads the file again
    assert optimize_model_main(argv) == 0
    third = json.loads((tmp_path / "report.json").read_text())
    e2e = third["stages"]["tune"]["e2e"]
    assert calls == [] and e2e["status"] == "recorded" and e2e["kept"] == "tuned"
    assert "tuned" in set(tuned_schedules(third).values())


def test_tuned_build_timed_for_real_ships_by_the_verdict(tmp_path, fake):
    fake.lo = 0.4
    report = optimize(tmp_path, trials=16)
    e2e = report["stages"]["tune"]["e2e"]
    assert e2e["status"] == "measured" and 3 <= len(e2e["ratios"]) <= 7 and e2e["tuned_ms"] > 0 < e2e["default_ms"]
    shipped = set(tuned_schedules(report).values())
    assert ("tuned" in shipped) == (e2e["kept"] == "tuned")
    fast = sum(r <= 1 - e2e["margin"] for r in e2e["ratios"])
    assert (e2e["kept"] == "tuned") == (sign_test_p(fast, len(e2e["ratios"])) <= SIGN_LEVEL)
    assert report["stages"]["compile"]["max_abs_err"] <= 1e-4  # the shipped build was the one checked


@pytest.mark.parametrize("ratios, faster, blocks", [
    ((0.97, 0.95, 0.96), True, 3),                     # faster by the margin in every block
    ((0.97, 1.05, 0.97, 0.96, 0.95, 0.97, 0.97), True, 6),   # one disturbed block: more blocks, then 5 of 6
    ((0.97, 1.05, 0.97, 0.96, 1.05, 0.97, 1.05), False, 7),  # 4 of 7: undecided, the baseline stays
    ((1.00, 0.99, 1.01), False, 3),                    # within the margin: the baseline stays
    ((1.10, 1.03, 0.90), False, 3),
])
def test_compare_decides_by_a_sign_test_on_blocks_against_the_margin(ratios, faster, blocks):
    it = iter(ratios)

    def timer(runners, runs, warmup):
        r = next(it)
        return {"baseline": Timing(2.0, 2.0), "candidate": Timing(2.0 * r, 2.0 * r)}

    d = compare(lambda: None, lambda: None, 0.02, timer=timer)
    assert d.faster == faster and d.comparison.ratios == pytest.approx(ratios[:blocks])
    # judged again from the recorded blocks (a rerun), the verdict is the same
    assert replay(d.comparison.ratios, 0.02)[0] == faster == replay(ratios, 0.02)[0]


def test_a_served_build_tuned_faster_at_its_representative_size_but_slower_at_another_ships_the_default(
        tmp_path, fake, monkeypatch, capsys):
    """Tuning measures kernels at the representative size (40 of 2..40); the tuned build, faster there, is
    timed again at the other sizes the build is checked at (2, 21), the default as the candidate, and loses at
    21: the default ships, the note names the size, and a rerun replays every verdict without timing."""
    import onnx

    import graphopt.timing as timing
    from graphopt import verdicts
    from pipeline.cli import optimize_model_main
    from test_served import _attention_model

    monkeypatch.setattr(verdicts, "store_path", lambda: tmp_path / "verdicts.json")
    fake.lo = 0.4
    ratios = [0.9] * 3 + [1.0] * 3 + [0.9] * 3  # representative: tuned faster; 2: a tie; 21: the default faster
    calls: list = []

    def timer(runners, runs, warmup=3, **kw):
        if set(runners) != {"baseline", "candidate"}:
            return timing.time_blocks(runners, runs, warmup, **kw)
        r = ratios[len(calls)]
        calls.append(list(runners))
        for run in runners.values():  # the builds really run at that size; the times are made up
            run()
        return {"baseline": Timing(1.0, 0.9), "candidate": Timing(r, r * 0.9)}

    monkeypatch.setattr(timing, "time_blocks", timer)
    path = tmp_path / "attention.onnx"
    onnx.save(_attention_model(), str(path))
    argv = [str(path), "--skip-graph", "--threads", "1", "--dim", "batch=1", "--dim", "sequence=2:40",
            "--trials", "16", "--kernels", "matmul", "-o", str(tmp_path / "out"), "--no-progress"]
    assert optimize_model_main(argv) == 0
    assert "tuning lost at sequence=21: the tuned build was slower there" in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    e2e = report["stages"]["tune"]["e2e"]
    assert e2e["kept"] == "default" and e2e["status"] == "measured" and e2e["ratios"] == [0.9] * 3
    assert [(s["sizes"], s["default_faster"], s["ratios"]) for s in e2e["sizes"]] == [
        ({"sequence": 2}, False, [1.0] * 3), ({"sequence": 21}, True, [0.9] * 3)]
    assert set(tuned_schedules(report).values()) == {"template"}
    assert len(calls) == 9
    calls.clear()
    assert optimize_model_main(argv) == 0
    again = json.loads((tmp_path / "out" / "report.json").read_text())["stages"]["tune"]["e2e"]
    assert calls == [] and again["kept"] == "default" and [s["status"] for s in again["sizes"]] == ["recorded"] * 2
    assert "- at sequence=21: default build" in (tmp_path / "out" / "report.md").read_text()
