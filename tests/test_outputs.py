"""What optimize-model leaves in DIR besides model.so: report.md with units and the end-to-end latency,
optimized.onnx written with external data past protobuf's 2 GB (tested with the threshold lowered) and with
an IR version the pinned onnxruntime reads, and the tuning plot with every task on its axis.

Every model written is loaded back and run in onnxruntime against the input model or numpy."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt import onnx_io
from graphopt.feeds import run_ort
from graphopt.onnx_io import export_onnx, import_onnx, ort_max_ir_version, save_model
from pipeline.cli import run_model_main


def mlp() -> onnx.ModelProto:
    """x[2, 16] -> MatMul -> Add -> Relu -> MatMul, weights of 2 KB, 128 B and 1 KB."""
    rng = np.random.default_rng(0)
    w1, b1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((16, 32), (32,), (32, 8)))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
                           numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """mlp through optimize-model (graph stage skipped) with the external-data threshold at 1 KB: the
    path a model over 2 GB takes, on a model of 4 KB."""
    from pipeline.context import BuildContext
    from pipeline.optimize_model import optimize_model

    d = tmp_path_factory.mktemp("built")
    onnx.save(mlp(), str(d / "m.onnx"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onnx_io, "EXTERNAL_DATA_ABOVE", 1000)
        res = optimize_model(str(d / "m.onnx"), str(d / "out"), BuildContext.create(threads=1, skip_graph=True))
    return d, res


def test_optimized_onnx_over_the_limit_keeps_its_weights_beside_it(built, tmp_path, capsys):
    d, res = built
    out = res.out_dir
    data = out / "optimized.onnx.data"
    assert res.report["files"]["weights"] == "optimized.onnx.data" and data.is_file()
    assert (out / "optimized.onnx").stat().st_size < 1000 < data.stat().st_size
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no staging folder left behind
    external = onnx.load(str(out / "optimized.onnx"), load_external_data=False)
    assert {t.name for t in external.graph.initializer if t.data_location == TensorProto.EXTERNAL} >= {"w1", "w2"}
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    want = run_ort(onnx.load(str(d / "m.onnx")), {"x": x})[0]
    np.testing.assert_allclose(_session(out / "optimized.onnx").run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    # The built folder runs and checks from there (onnxruntime reads optimized.onnx with its weights file).
    np.savez(tmp_path / "in.npz", x=x)
    assert run_model_main([str(out), "--inputs", str(tmp_path / "in.npz"), "--repeat", "2", "--check"]) == 0
    assert "vs onnxruntime: ok" in capsys.readouterr().out


def test_save_model_switches_between_one_file_and_external_data(tmp_path, monkeypatch):
    model = mlp()
    before = model.SerializeToString()
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_ABOVE", 1000)
    assert save_model(model, tmp_path / "m.onnx") == [tmp_path / "m.onnx", tmp_path / "m.onnx.data"]
    assert model.SerializeToString() == before  # the caller's proto still holds its weights
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_ABOVE", 2**31 - 1)
    assert save_model(model, tmp_path / "m.onnx") == [tmp_path / "m.onnx"]
    assert not (tmp_path / "m.onnx.data").exists()  # the earlier weights file is not left to mislead
    assert onnx.load(str(tmp_path / "m.onnx")).SerializeToString() == before


def test_a_model_of_the_newest_ir_version_is_exported_for_onnxruntime(tmp_path):
    """onnx writes IR 14 by default, onnxruntime 1.31 reads up to 13: what we export, it loads."""
    model = mlp()
    model.ir_version = onnx.IR_VERSION
    with pytest.raises(Exception, match="IR version"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert ort_max_ir_version() < onnx.IR_VERSION
    exported = export_onnx(import_onnx(model))
    assert exported.ir_version == ort_max_ir_version()
    save_model(exported, tmp_path / "o.onnx")
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    want = np.maximum(x @ w["w1"] + w["b1"], 0) @ w["w2"]
    np.testing.assert_allclose(_session(tmp_path / "o.onnx").run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


def test_report_md_gives_units_and_the_end_to_end_latency(built):
    _, res = built
    lat = res.report["latency"]
    assert lat["measured"] and lat["compiled_ms"] > 0 and lat["onnxruntime_ms"] > 0
    assert lat["time_ratio"] == pytest.approx(lat["compiled_ms"] / lat["onnxruntime_ms"], rel=0.01)
    md = (res.out_dir / "report.md").read_text()
    assert f"**{lat['compiled_ms']:.4g} ms** per inference" in md and f"{lat['onnxruntime_ms']:.4g} ms" in md
    stage_rows = [ln for ln in md.splitlines() if re.match(r"\| (graph|partition|tune|compile|latency) \|", ln)]
    assert len(stage_rows) == 5
    for row in stage_rows:
        assert re.match(r"\| \w+ \| \d+\.\d\d s \|", row), row
    # Every time-valued fact carries its unit: no bare number after a *_ms*= or a cost (seconds).
    number = r"[-\d.e+]+(?![-\d.e+])"  # a whole number: no backing off to a prefix of it
    assert not re.search(rf"\b(\w+_)?(ms|cost)(_\w+)?={number}(?! ms)", md)
    assert not re.search(r"\w=|\bNone\b|\{'", md), md  # words, not key=value dumps or Python reprs
    # the one ratio convention (ours / onnxruntime's, a time ratio), worded as bench-model words it
    assert f"ours: {lat['compiled_ms'] / lat['onnxruntime_ms']:.2f}x onnxruntime's time (lower is faster" in md


def test_a_build_slower_than_onnxruntime_says_so_in_one_line(built):
    """Never silently slower: report.json says whether the shipped build lost to onnxruntime (by its median and
    its best run alike) and optimize-model prints one warning line with both figures and what to try."""
    from pipeline.report import slower_warning

    lat = built[1].report["latency"]
    slower = lat["compiled_ms"] > lat["onnxruntime_ms"] and lat["compiled_min_ms"] > lat["onnxruntime_min_ms"]
    assert lat["slower_than_onnxruntime"] is slower
    lost = {"compiled_ms": 12.5, "onnxruntime_ms": 10.0, "slower_than_onnxruntime": True}
    line = slower_warning(lost, tuned=False)
    assert line.startswith("warning: ") and "\n" not in line
    assert "12.5 ms" in line and "10.0 ms" in line and "--trials" in line and "--layout nchwc" in line
    assert "--layout auto" in slower_warning(lost, tuned=False, layout="nchwc")  # not the layout it used
    assert "--layout" not in slower_warning(lost, tuned=False, convs=False)  # no conv: no layout advice
    assert slower_warning({**lost, "slower_than_onnxruntime": False}, tuned=False) is None
    assert slower_warning({"measured": False}, tuned=True) is None


def test_report_md_says_each_stage_in_words_with_units_and_links_the_plot():
    """report.md is read by a person: no key=value dumps or Python reprs (issue 43), every time with its unit,
    each kernel's time in the shipped build and the ONNX nodes its first call computes in the kernel table, the
    tuning plot linked."""
    from pipeline.report import report_markdown

    report = {"model": "m.onnx", "target": "llvm", "latency": {"measured": False, "reason": "cross target"},
              "stages": {"graph": {"time_s": 12.3456, "skipped": False, "nodes_before": 40, "nodes_after": 37,
                                   "cost_before": 0.0123, "cost_after": 0.0101, "applied": {"fuse_add_relu": 3},
                                   "stopped_by": "converged", "kept": "optimized", "e2e_ms_before": 13.0,
                                   "e2e_ms_after": None, "e2e_check": "measured", "e2e_decision": "",
                                   "stop_reason": "complete", "pricing_failures": {}, "estimated_prices": 0,
                                   "frozen_weights": 0, "winograd": {}},
                         "partition": {"time_s": 0.5, "tasks": 2, "tunable": 1, "gflop": 2.0,
                                       "layout": {"mode": "nchw", "convs": 0, "blocked": 0, "transforms": 0,
                                                  "merged_groups": 0, "kept_nchw": {}}},
                         "tune": {"time_s": 60.0, "trials": 8, "measured_now": 8, "scheduler": "gradient",
                                  "searcher": "opevo", "records": "out/records.jsonl", "kernel_ms_before": 9.5,
                                  "kernel_ms_after": 7.25,
                                  "tasks": [{"index": 0, "name": "mm", "weight": 12, "trials": 8,
                                             "default_ms": 0.5, "best_ms": 0.25}],
                                  "e2e": {"kept": "tuned", "status": "measured", "default_ms": 13.0,
                                          "tuned_ms": 11.0}},
                         "compile": {"time_s": 1.0, "ok": True, "max_abs_err": 1e-6, "max_rel_err": 2e-6,
                                     "atol": 1e-4, "rtol": 1e-4, "top1_agreement": None, "outputs": 1,
                                     "input_sets": 3, "quantization": None, "checked": "compiled model vs onnxruntime"},
                         "mystery": {"time_s": 0.1, "thing_ms": 2.5, "flag": True, "gone": None}},
              "tasks": [{"index": 0, "kind": "matmul", "weight": 12, "flops": 1e9, "schedule": "tuned", "name": "mm",
                         "names": ["mm", "mm1"], "ms": 3.0},
                        {"index": 1, "kind": "other", "weight": 1, "flops": 0.0, "schedule": "cpu-rule",
                         "name": "reshape", "ms": None}],
              "call_sites": [{"kernel": "mm1", "nodes": ["/fc1/MatMul", "/fc1/Add", "/fc1/Relu"]},
                             {"kernel": "reshape", "nodes": []}],
              "files": {"tuning_plot": "tuning.png"}}
    md = report_markdown(report)
    assert "Not measured: cross target." in md
    assert ("| graph | 12.35 s | 40 -> 37 nodes; rewrites applied: 3 fuse_add_relu; priced 12.3 ms -> 10.1 ms "
            "(sum of measured kernels); whole model 13 ms -> -; kept the optimized graph (end-to-end check measured); "
            "search converged |") in md
    assert "| partition | 0.50 s | 2 fused kernels, 1 with a tuning template; 2 GFLOP per inference; no convs" in md
    assert "tuned kernels 9.5 ms -> 7.25 ms per inference" in md
    assert "matches on 3 input sets, 1 output; max abs err 1e-06" in md
    assert "| mystery | 0.10 s | thing: 2.5 ms; flag: yes |" in md  # a stage without a phrase, key by key
    assert "| 0 | mm | 12 | 8 | 0.5 ms | 0.25 ms |" in md
    assert "default build 13 ms, tuned build 11 ms" in md
    assert "| 0 | matmul | 12 | 1 GFLOP | tuned | 3 ms | 100.0% | `/fc1/MatMul` +2 | mm |" in md  # in the build
    assert "| 1 | other | 1 | 0 FLOP | cpu-rule | - | - | - | reshape |" in md  # not timed: not guessed
    assert "[tuning.png](tuning.png)" in md
    assert not re.search(r"\w=|\bNone\b|\bTrue\b|\{'", md), md  # no key=value, no Python repr
    untuned = {**report, "stages": {"tune": {"time_s": 0.0, "skipped": True, "reason": "--trials 0"}}, "files": {}}
    md = report_markdown(untuned)
    assert "| tune | 0.00 s | skipped (--trials 0) |" in md and "tuning.png" not in md


def test_tuning_plot_names_every_task_and_marks_the_untuned():
    import matplotlib.pyplot as plt

    from kerneltune.tune_tasks import TaskTuning, TuningResult
    from pipeline.tuning import NO_TEMPLATE, NOT_SELECTED, BuildChoice, shipped_title, task_label, tuning_figure

    long = "fused_matmul_add_gelu_" + "x" * 60
    tasks = [TaskTuning(index=0, name=long, key="k0", kind="matmul", weight=12, flops=1e9, default_ms=1.2, best_ms=0.6,
                        trials=30, curve=[(10, 0.9), (40, 0.6)]),
             TaskTuning(index=2, name="fused_batch_matmul", key="k2", kind="batch_matmul", weight=24, flops=1e8,
                        default_ms=0.3, best_ms=0.3, trials=1, curve=[]),
             TaskTuning(index=3, name="matmul11", key="k3", kind="matmul", weight=1, flops=1e8, default_ms=0.05,
                        best_ms=0.06, trials=5, curve=[]),
             TaskTuning(index=5, name="fused_conv2d", key="k5", kind="conv2d", weight=2, flops=1e8, default_ms=None,
                        best_ms=None, trials=0, curve=[])]
    result = TuningResult(best_configs={}, tasks=tasks, trials=64, objective=[(4, 30.0), (64, 20.0)],
                          scheduler="gradient", searcher="opevo", seconds=10.0)
    shipped = shipped_title(BuildChoice("default", "measured", 10.0, 10.1))
    assert shipped == ("shipped: the default build (end to end 10.100 ms tuned vs 10.000 ms default, margin 2%; "
                       "measured)")
    fig = tuning_figure(result, [(1, "fused_softmax", NO_TEMPLATE), (4, "matmul41", NOT_SELECTED)], shipped)
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == ["0: " + long[:45] + "...", "1: fused_softmax", "2: fused_batch_matmul", "3: matmul11",
                          "4: matmul41", "5: fused_conv2d"]
        assert task_label(0, long) == labels[0]
        notes = [t.get_text() for t in ax.texts]
        assert "not tuned (no template)" in notes and "not tuned (not selected by --kernels)" in notes
        assert fig._suptitle.get_text() == shipped
        assert notes.count("not measured (budget spent before it)") == 1
        # the two tasks whose default stayed are drawn as markers at calls x default latency
        points = sorted(float(line.get_xdata()[0]) for line in ax.get_lines())
        assert points == pytest.approx([1 * 0.05, 24 * 0.3])
        assert min(t.get_fontsize() for t in ax.get_yticklabels() + ax.texts) >= 9
        assert all(t.get_fontsize() >= 9 for t in ax.get_legend().get_texts())
    finally:
        plt.close(fig)



def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path):
    """Artifacts are staged with mkstemp (mode 0600); the renamed file must be readable as any new file is."""
    import os
    import stat

    from graphopt.fileio import atomic_path, write_text_atomic

    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "report.json", "{}")
        with atomic_path(tmp_path / "model.so") as tmp:
            tmp.write_bytes(b"x")
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    plain = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    assert plain == 0o644
    for name in ("report.json", "model.so"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == plain
