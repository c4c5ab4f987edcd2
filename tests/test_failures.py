"""Failures are not forever: config failures are final, environmental ones are recorded as such and measured
again on resume; a run whose measurements only fail environmentally is an error (one line, exit 2), and an
unreachable --rpc device is refused before any work.  Synthetic measurers, no TVM kernels."""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from graphopt.errors import UserError
from kerneltune.failures import CONFIG, ENVIRONMENT, classify, classify_batch
from kerneltune.records import RecordLog
from kerneltune.searchers import make_searcher
from kerneltune.space import FactorKnob, SearchSpace
from kerneltune.tune import ENV_FAILURE_LIMIT, TaskRecords, tune

SPACE = SearchSpace([FactorKnob("i", 64, 3), FactorKnob("k", 32, 2)])
BERT_TINY = Path(__file__).resolve().parents[1] / "models" / "bert_tiny.onnx"


@dataclass
class Result:
    gflops: float
    latency_s: float | None
    error: str | None = None


def ok(c) -> Result:
    g = float(c[0][-1] * c[1][-1])
    return Result(g, 1.0 / g)


@pytest.mark.parametrize("error, batch_ran, kind", [
    ("invalid config: tile too large", True, CONFIG),
    ("build failed: TVMError: cannot vectorize", False, CONFIG),
    ("wrong result: max err 3 (reference max 1)", True, CONFIG),
    ("run failed: ValueError: bad shape", True, CONFIG),
    ("run timeout", True, CONFIG),               # the machine worked for its neighbours: a pathological kernel
    ("run timeout", False, ENVIRONMENT),         # nothing in the batch ran: overloaded or hung
    ("build timeout", False, ENVIRONMENT),
    ("session failed: RuntimeError: Cannot request key after 5 retry", True, ENVIRONMENT),
    ("run failed: TVMError: Socket connection closed", True, ENVIRONMENT),
    ("run failed: worker died (exit code -9)", True, ENVIRONMENT),    # SIGKILL: OOM killer under load
    ("build failed: worker died (exit code -11)", True, CONFIG),      # SIGSEGV: crashed on this config
    ("measurer raised RuntimeError: worker pool died", True, ENVIRONMENT),
    (None, True, None),
])
def test_classify(error, batch_ran, kind):
    assert classify(error, batch_ran) == kind


def test_batch_rule_for_timeouts():
    assert classify_batch(["run timeout", None]) == [CONFIG, None]
    assert classify_batch(["run timeout", "run timeout"]) == [ENVIRONMENT, ENVIRONMENT]


def test_environmental_failures_are_recorded_and_measured_again_on_resume(tmp_path):
    path = tmp_path / "r.jsonl"
    flaky = {"on": True}
    measured = []

    def measure(configs):
        measured.extend(configs)
        out = []
        for c in configs:
            if c[1][-1] == 32:
                out.append(Result(0.0, None, "invalid config: k tile"))          # a config failure
            elif flaky["on"] and c[0][-1] == 4:
                out.append(Result(0.0, None, "session failed: connection reset"))   # the device hiccupped
            else:
                out.append(ok(c))
        return out

    def go():
        with RecordLog(path) as log:
            return tune(SPACE, make_searcher("random", SPACE, 0), measure, 40, TaskRecords("t", "llvm", log),
                        progress=False)

    first = go()
    recs = RecordLog(path).load()
    env = [r for r in recs if r.failure == ENVIRONMENT]
    cfg = [r for r in recs if r.failure == CONFIG]
    assert env and cfg and all(r.error.startswith("session failed") for r in env)
    flaky["on"] = False
    measured.clear()
    again = go()
    # Exactly the environmental failures were measured again (random search proposes the same configs
    # whatever it observed); the config failures stand.
    assert sorted(measured) == sorted(SPACE.from_dict(r.config) for r in env)
    assert again.trials == 40 and again.failures == len(cfg) < first.failures
    assert again.best_gflops >= first.best_gflops


def test_a_run_that_only_fails_environmentally_is_an_error(tmp_path):
    def unreachable(configs):
        return [Result(0.0, None, "session failed: RuntimeError: Cannot connect to tracker") for _ in configs]

    path = tmp_path / "r.jsonl"
    with pytest.raises(UserError, match=f"{ENV_FAILURE_LIMIT} measurements in a row failed .* rerun the same"):
        with RecordLog(path) as log:
            tune(SPACE, make_searcher("opevo", SPACE, 0), unreachable, 100, TaskRecords("t", "llvm", log),
                 progress=False)
    assert len(RecordLog(path).load()) == ENV_FAILURE_LIMIT  # it stopped at once, and recorded what it tried
    with pytest.raises(UserError, match="all 3 measurements failed"):  # fewer than the limit: the end says so
        tune(SPACE, make_searcher("opevo", SPACE, 0), unreachable, 3, TaskRecords("t", "llvm"), progress=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_rpc_tracker_fails_fast_with_one_line(tmp_path, capsys):
    from pipeline.cli import optimize_model_main

    t0 = time.perf_counter()
    rc = optimize_model_main([str(BERT_TINY), "--skip-graph", "--trials", "8", "--rpc",
                              f"127.0.0.1:{_closed_port()}:cpu", "-o", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot reach the RPC tracker at 127.0.0.1" in err
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "o").exists()
