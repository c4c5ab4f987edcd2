"""What a user sees from bench-model and run-model (issue 43): a shipped build timed as shipped, one ratio
convention (ours / the peer's time), throughput and a duration mode, every peer that did not run named with
the reason, and one-line errors before any timing.

The folder is test_deploy's small MLP build (a few seconds); the rebuild case compiles that MLP's default
build once."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphopt.timing import latency, time_blocks
from pipeline.cli import bench_model_main, run_model_main
from pipeline.report import time_ratio
from tests.test_deploy import mlp, mlp_built, one_line_error  # noqa: F401 - mlp_built: the shared folder fixture

LOOSE = (0.5, 1.01)  # throughput x mean latency: 1 but for the timer's own overhead between calls


def _bench(folder: Path, tmp_path: Path, *extra: str) -> dict:
    js = tmp_path / "b.json"
    assert bench_model_main([str(folder), "--threads", "1", "--json", str(js), *extra]) == 0
    return json.loads(js.read_text())


def test_bench_model_dir_times_the_shipped_build_in_one_ratio_convention(mlp_built, tmp_path, capsys):
    data = _bench(mlp_built, tmp_path, "--runs", "2")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"bench-model times {mlp_built}/model.so as shipped")
    assert data["shipped"] == str(mlp_built) and data["shipped_ms"] > 0 and data["ort_ms"] > 0
    assert data["tvm_ms"] is None and data["graphopt_ms"] is None  # nothing rebuilt
    assert data["warmup"] == 3 and data["duration"] is None and data["latency"]["shipped"]["runs"] == 2
    assert data["checks"]["shipped"]["ok"] and data["max_abs_err"] <= 1e-4
    assert ("openvino" in data["skipped"]) != (data["openvino_ms"] is not None)  # timed, or named with why
    # ours / onnxruntime's, a time ratio, in the JSON and in the words of report.md
    ratio = data["shipped_ms"] / data["ort_ms"]
    assert data["ratios"]["shipped"] == pytest.approx(ratio)
    assert "x onnxruntime's time" in out[2]  # the table's column
    assert out[-1].startswith(f"model.so as shipped: {time_ratio(data['shipped_ms'], data['ort_ms'])}")
    report = json.loads((mlp_built / "report.json").read_text())["latency"]
    md = (mlp_built / "report.md").read_text()
    assert f"ours: {report['compiled_ms'] / report['onnxruntime_ms']:.2f}x onnxruntime's time" in md


def test_duration_mode_gives_runs_and_a_throughput_matching_the_latency(mlp_built, tmp_path, capsys):
    js = tmp_path / "r.json"
    t0 = time.perf_counter()
    assert run_model_main([str(mlp_built), "--duration", "0.3", "--warmup", "2", "--json", str(js)]) == 0
    assert time.perf_counter() - t0 < 20
    res = json.loads(js.read_text())
    assert res["runs"] >= 1 and res["warmup"] == 2 and res["duration"] == 0.3 and res["shipped"] == str(mlp_built)
    assert 0.3 <= res["timed_s"] < 1.0 and LOOSE[0] < res["throughput"] * res["mean_ms"] / 1e3 < LOOSE[1]
    line = capsys.readouterr().out
    assert "inferences/s" in line and "after 2 warm-up" in line and "p99" in line
    data = _bench(mlp_built, tmp_path, "--duration", "0.2")
    lat = data["latency"]["shipped"]
    assert data["duration"] == 0.2 and lat["runs"] >= 1
    assert LOOSE[0] < data["throughput"]["shipped"] * lat["mean_ms"] / 1e3 < LOOSE[1]


def test_openvino_missing_is_named_with_the_fix(mlp_built, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino raises ImportError
    data = _bench(mlp_built, tmp_path, "--runs", "1")
    assert data["skipped"] == {"openvino": "not installed (pip install openvino)"} and data["openvino_ms"] is None
    assert any(ln.startswith("OpenVINO (CPU, f32)") and ln.endswith("skipped: not installed (pip install openvino)")
               for ln in capsys.readouterr().out.splitlines())


def test_openvino_disagreeing_is_named_with_its_error():
    pytest.importorskip("openvino")
    from graphopt.feeds import run_ort
    from pipeline.benchmark import openvino_peer

    feeds = {"x": np.ones((2, 16), np.float32)}
    wrong = [o + 1.0 for o in run_ort(mlp(), feeds)]
    peer = openvino_peer(mlp(), 1, [feeds], [wrong], feeds)
    assert peer.runner is None and peer.skipped.startswith("outputs differ from onnxruntime's (max abs err 1")


def test_onnxruntime_failing_is_named_and_model_so_still_timed(mlp_built, tmp_path, capsys, monkeypatch):
    import pipeline.bench_shipped as shipped

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for op X")

    monkeypatch.setattr(shipped, "ort_session", broken)
    data = _bench(mlp_built, tmp_path, "--runs", "1")
    assert data["skipped"]["ort"].startswith("could not run optimized.onnx (RuntimeError: no kernel for op X)")
    assert data["skipped"]["openvino"].startswith("not compared") and data["shipped_ms"] > 0
    assert data["ort_ms"] is None and data["ratios"]["shipped"] is None


def test_bench_model_rebuild_says_so_first(tmp_path, capsys):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), str(path))
    data = _bench(path, tmp_path, "--runs", "1", "--skip-graph")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"bench-model rebuilds {path}; to time a shipped build give its -o folder"
    assert data["shipped"] == "rebuilt" and data["tvm_ms"] > 0 and data["shipped_ms"] is None
    assert out[-1].startswith(f"TVM default schedules: {time_ratio(data['tvm_ms'], data['ort_ms'])}")


@pytest.mark.parametrize("extra, words", [
    (["--trials", "5"], "--trials applies to a rebuild"),
    (["--runs", "3", "--duration", "1"], "--runs 3 and --duration 1 both given"),
    (["--warmup", "-1"], "--warmup -1"),
    (["--duration", "0"], "--duration"),
    (["--json", "{dir}/model.so/x.json"], "--json"),  # under a file: no folder can be made there
    (["--plot", "{dir}/chart.txt"], "--plot"),
])
def test_bench_model_dir_refuses_wrong_options_in_one_line(mlp_built, extra, words, capsys):
    assert bench_model_main([str(mlp_built), *(e.format(dir=mlp_built) for e in extra)]) == 2
    assert words in one_line_error(capsys)


def test_bench_model_dir_refuses_an_incomplete_folder(mlp_built, tmp_path, capsys):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "model.so").write_bytes((mlp_built / "model.so").read_bytes())
    assert bench_model_main([str(partial)]) == 2
    assert "report.json" in one_line_error(capsys)
    assert run_model_main([str(mlp_built), "--repeat", "2", "--duration", "1"]) == 2
    assert "drop one" in one_line_error(capsys)


def test_the_timer_runs_for_a_duration_and_counts_the_throughput():
    calls = []
    times = time_blocks({"a": lambda: (calls.append(1), time.sleep(0.002))}, runs=1, warmup=0, rounds=2,
                        sleep=lambda s: None, duration_s=0.05)
    lat = times["a"].latency
    assert len(calls) == lat.runs >= 2 and len(times["a"].blocks_ms) == 2 and 0.05 <= lat.timed_s < 0.5
    assert LOOSE[0] < lat.throughput * lat.mean_ms / 1e3 < LOOSE[1]
    one = latency(lambda: time.sleep(0.001), runs=4, warmup=1)
    assert one.runs == 4 and one.p50_ms <= one.p90_ms <= one.p99_ms
    assert lat.p90_ms == pytest.approx(float(np.percentile(times["a"].samples_ms, 90)))  # numpy's percentiles
