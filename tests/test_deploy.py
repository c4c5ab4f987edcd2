"""What a user ships and how it runs: --target strings and JSON, cross-compiling, the built folder's
signature, run-model and the Python API (pipeline.optimize / pipeline.load).

Every run is checked against onnxruntime; the cross-compiled library is checked for its ELF machine."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pipeline
from graphopt.errors import UserError
from graphopt.feeds import run_ort
from pipeline.cli import optimize_model_main, run_model_main

ROOT = Path(__file__).resolve().parents[1]
BERT_TINY = ROOT / "models" / "bert_tiny.onnx"
EM_AARCH64 = 183  # ELF e_machine of AArch64
AARCH64 = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72"


def mlp(batch: int | str = 2) -> onnx.ModelProto:
    """x[batch, 16] -> MatMul -> Add -> Relu -> MatMul: small enough to compile in a few seconds."""
    rng = np.random.default_rng(0)
    w1, b1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((16, 32), (32,), (32, 8)))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
                           numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def one_line_error(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[")]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---------------------------------------------------------------------------------------------- targets

def test_string_json_and_short_forms_parse_to_the_same_target():
    from kerneltune.targets.host import llvm_target
    from kerneltune.targets.parse import check_name, parse_target

    host = parse_target("llvm", 2)
    assert str(host.target) == str(llvm_target(2))  # the records' target key of the short form is unchanged
    b = check_name('{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}')
    assert dict(check_name(AARCH64).attrs) == dict(b.attrs) and b.get("mcpu") == "cortex-a72"
    assert check_name("cuda -arch=sm_90").get("arch") == check_name("cuda:sm_90").get("arch") == "sm_90"
    assert check_name("llvm -mattr=+avx2,+fma").get("mattr") == ["+avx2", "+fma"]
    assert check_name(AARCH64).is_cross and not check_name("llvm -mcpu=znver3").is_cross


def test_a_cross_target_string_and_json_build_the_same_target():
    """Needs the aarch64 cross gcc (``.ci/run`` installs it; a machine without it skips, saying so)."""
    from kerneltune.targets.parse import parse_target
    from kerneltune.targets.toolchains import cross_toolchain

    try:
        cross_toolchain("aarch64-linux-gnu")
    except UserError as exc:
        pytest.skip(str(exc))
    a = parse_target(AARCH64, 2)
    b = parse_target('{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}', 2)
    assert str(a.target) == str(b.target) and a.target.attrs["mcpu"] == "cortex-a72"
    assert not a.can_run and "aarch64" in a.note


def test_an_mcpu_this_cpu_lacks_builds_but_is_not_run_here():
    from kerneltune.targets.host import host_arch, missing_cpu_features
    from kerneltune.targets.parse import parse_target

    if host_arch() != "x86_64":
        pytest.skip("x86 CPU names")
    # the first of these newest x86 CPUs whose features this one lacks (a Xeon may be a Sapphire Rapids itself)
    for cpu in ("diamondrapids", "graniterapids", "sapphirerapids", "znver5", "arrowlake-s"):
        missing = missing_cpu_features(parse_target(f"llvm -mcpu={cpu}", 1).target)
        if missing:
            break
    else:
        pytest.skip("this CPU has every feature of the newest x86 CPUs LLVM knows")
    spec = parse_target(f"llvm -mcpu={cpu}", 1)
    assert not spec.can_run and missing[0] in spec.note
    assert parse_target("llvm -mcpu=x86-64", 1).can_run  # baseline x86-64 runs everywhere


@pytest.mark.parametrize("target, words", [
    ("llvm -mcpu=nosuchcpu", ("nosuchcpu", "-mtriple")),
    ('{"kind": "cuda"', ("json",)),
    ('{"arch": "sm_80"}', ("kind",)),
    ("llvm -bogus=1", ("bogus",)),
    ("llvm mcpu", ("-key=value",)),
    ("llvm -mtriple=aarch64-apple-darwin", ("linux",)),
    ("llvm:znver5", ("-mcpu",)),
    ("cuda -arch=sm_foo", ("sm_foo",)),
    ("vulkan", ("unknown target",)),
])
def test_bad_targets_are_one_line_exit_2(target, words, tmp_path, capsys):
    rc = optimize_model_main([str(BERT_TINY), "--target", target, "-o", str(tmp_path / "o"), "--skip-graph"])
    line = one_line_error(capsys)
    assert rc == 2 and not (tmp_path / "o" / "model.so").exists()
    for w in words:
        assert w.lower() in line.lower(), line


def test_rocm_says_the_runtime_has_no_rocm_or_builds(tmp_path, capsys):
    from kerneltune.targets.toolchains import find_lld, rocm_bitcode_dir

    if find_lld() and rocm_bitcode_dir():
        pytest.skip("ROCm toolchain installed: test_pipeline builds the code object")
    rc = optimize_model_main([str(BERT_TINY), "--target", "rocm", "-o", str(tmp_path / "o"), "--skip-graph"])
    line = one_line_error(capsys)
    assert rc == 2 and "without rocm" in line.lower() and "apt-get install" in line


def test_missing_cross_toolchain_names_the_debian_packages(monkeypatch):
    from kerneltune.targets import toolchains
    from kerneltune.targets.parse import parse_target

    monkeypatch.setattr(toolchains.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross"):
        parse_target(AARCH64, 1)


def test_cross_compile_writes_an_aarch64_library_that_is_not_run_here(tmp_path, capsys):
    from kerneltune.targets.toolchains import cross_toolchain

    try:
        cross_toolchain("aarch64-linux-gnu")
    except UserError as exc:
        pytest.skip(str(exc))
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), str(path))
    out = tmp_path / "arm"
    assert optimize_model_main([str(path), "--target", AARCH64, "--skip-graph", "-o", str(out)]) == 0
    lib = (out / "model.so").read_bytes()
    assert lib[:4] == b"\x7fELF" and int.from_bytes(lib[18:20], "little") == EM_AARCH64
    report = json.loads((out / "report.json").read_text())
    assert report["deploy"]["arch"] == "aarch64" and not report["deploy"]["runs_on_build_machine"]
    assert report["stages"]["compile"]["checked"].startswith("graph only")
    capsys.readouterr()
    assert run_model_main([str(out)]) == 2
    assert "aarch64" in one_line_error(capsys)
    # tuning needs the device: refused before any work, pointing at --rpc
    assert optimize_model_main([str(path), "--target", AARCH64, "--trials", "4", "-o", str(tmp_path / "t")]) == 2
    assert "--rpc" in one_line_error(capsys)


# ------------------------------------------------------------------------------------ built folder, API

@pytest.fixture(scope="module")
def bert_built(tmp_path_factory):
    """bert-tiny built through the Python API (graph stage skipped: the pipeline tests cover it)."""
    out = tmp_path_factory.mktemp("bert") / "built"
    model = pipeline.optimize(str(BERT_TINY), target="llvm", output=out, threads=2, skip_graph=True)
    return out, model


def _bert_feeds(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 100, (1, 128)).astype(np.int64),
            "attention_mask": np.ones((1, 128), np.int64), "token_type_ids": np.zeros((1, 128), np.int64)}


def test_api_optimizes_runs_saves_and_loads_bert_tiny_like_onnxruntime(bert_built, tmp_path):
    out, model = bert_built
    feeds = _bert_feeds()
    ref = run_ort(onnx.load(str(BERT_TINY)), feeds)
    got = model.run(feeds)
    assert list(got) == ["last_hidden_state", "pooler_output"]
    for r, g in zip(ref, got.values()):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
    saved = model.save(tmp_path / "copy")
    again = pipeline.load(saved).run(list(feeds.values()))  # a sequence in input order works too
    for a, b in zip(got.values(), again.values()):
        np.testing.assert_array_equal(a, b)
    sig = json.loads((out / "report.json").read_text())["deploy"]
    assert [t["name"] for t in sig["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert sig["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": [1, 128]}
    assert sig["outputs"][1]["shape"] == [1, 128] and sig["device"] == "cpu"


def test_api_refuses_wrong_feeds_in_one_line(bert_built):
    _, model = bert_built
    feeds = _bert_feeds()
    with pytest.raises(UserError, match=r"compiled for \[1, 128\]"):
        model.run(feeds | {"input_ids": feeds["input_ids"][:, :64]})
    with pytest.raises(UserError, match="missing: token_type_ids"):
        model.run({k: v for k, v in feeds.items() if k != "token_type_ids"})
    with pytest.raises(UserError, match="float32"):
        model.run(feeds | {"input_ids": feeds["input_ids"].astype(np.float32)})
    with pytest.raises(UserError, match="report.json"):
        pipeline.load(BERT_TINY.parent)


def test_run_model_prints_percentiles_checks_and_writes_outputs(bert_built, tmp_path, capsys):
    out, model = bert_built
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **_bert_feeds(2))
    args = [str(out), "--inputs", str(inputs), "--repeat", "5", "--check", "--json", str(tmp_path / "r.json"),
            "--outputs", str(tmp_path / "out.npz")]
    assert run_model_main(args) == 0
    line = capsys.readouterr().out
    assert "p50" in line and "p99" in line and "vs onnxruntime: ok" in line
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["runs"] == 5 and res["check"]["ok"]
    assert 0 < res["min_ms"] <= res["p50_ms"] <= res["p90_ms"] <= res["p99_ms"]
    with np.load(tmp_path / "out.npz") as saved:
        ref = run_ort(onnx.load(str(out / "optimized.onnx")), _bert_feeds(2))
        np.testing.assert_allclose(saved["pooler_output"], ref[1], rtol=1e-4, atol=1e-4)
    assert run_model_main([str(out), "--repeat", "0"]) == 2
    shutil.copytree(out, tmp_path / "partial")
    (tmp_path / "partial" / "report.json").unlink()
    capsys.readouterr()
    assert run_model_main([str(tmp_path / "partial")]) == 2
    assert "report.json" in one_line_error(capsys)


def test_run_model_on_an_rpc_device_prints_percentiles_and_checks(bert_built, tmp_path, capsys, rpc_tracker):
    """run-model --rpc: model.so uploaded to the device a tracker hands out (here a server on localhost),
    run and timed there, outputs checked against onnxruntime here."""
    out, _ = bert_built
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **_bert_feeds(3))
    rpc = rpc_tracker
    assert run_model_main([str(out), "--rpc", rpc, "--inputs", str(inputs), "--repeat", "5", "--check",
                           "--json", str(tmp_path / "r.json"), "--outputs", str(tmp_path / "o.npz")]) == 0
    line = capsys.readouterr().out
    # a key no server registered: one line naming it, before anything is uploaded
    assert run_model_main([str(out), "--rpc", rpc.rsplit(":", 1)[0] + ":gpu0"]) == 2
    assert "no device registered under key 'gpu0'" in one_line_error(capsys)
    assert f"on {rpc}" in line and "vs onnxruntime: ok" in line
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["rpc"] == rpc and res["runs"] == 5 and res["check"]["ok"] and res["threads"] >= 1
    assert 0 < res["min_ms"] <= res["p50_ms"] <= res["p90_ms"] <= res["p99_ms"] and res["mean_ms"] > 0
    ref = run_ort(onnx.load(str(out / "optimized.onnx")), _bert_feeds(3))
    with np.load(tmp_path / "o.npz") as got:
        assert list(got.files) == ["last_hidden_state", "pooler_output"]
        for name, r in zip(got.files, ref):
            np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------- scalar inputs, partial --inputs, integrity

def scaled() -> onnx.ModelProto:
    """y = x * s, ``s`` a rank-0 (scalar) input (issue 25: every run of such a build failed)."""
    g = helper.make_graph([helper.make_node("Mul", ["x", "s"], ["y"])], "scaled",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.fixture(scope="module")
def scalar_built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scalar") / "built"
    pipeline.optimize(scaled(), output=out, threads=1, skip_graph=True)
    return out


@pytest.fixture(scope="module")
def mlp_built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mlp") / "built"
    pipeline.optimize(mlp(), output=out, threads=1, skip_graph=True)
    return out


def _scalar_feeds() -> dict[str, np.ndarray]:
    return {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5, "s": np.array(1.5, np.float32)}


def _copy(built: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "copy"))


def _edit_report(directory: Path, edit) -> None:
    report = json.loads((directory / "report.json").read_text())
    edit(report["deploy"])
    (directory / "report.json").write_text(json.dumps(report))


def test_a_scalar_input_runs_in_run_model_and_the_api_like_onnxruntime(scalar_built, tmp_path, capsys):
    feeds = _scalar_feeds()
    ref = run_ort(scaled(), feeds)[0]
    np.testing.assert_array_equal(pipeline.load(scalar_built).run(feeds)["y"], ref)
    np.testing.assert_array_equal(pipeline.load(scalar_built).run([feeds["x"], 1.5])["y"], ref)  # a Python float
    np.savez(tmp_path / "in.npz", **feeds)
    assert run_model_main([str(scalar_built), "--inputs", str(tmp_path / "in.npz"), "--repeat", "2", "--check",
                           "--outputs", str(tmp_path / "out.npz")]) == 0
    assert "vs onnxruntime: ok" in capsys.readouterr().out
    with np.load(tmp_path / "out.npz") as got:
        np.testing.assert_array_equal(got["y"], ref)
    assert run_model_main([str(scalar_built), "--repeat", "2", "--check"]) == 0  # random inputs, scalar included


def test_run_model_draws_the_inputs_a_partial_npz_leaves_out_and_says_so(scalar_built, tmp_path, capsys):
    """One rule with optimize-model (graphopt.validate.read_inputs): a missing input is drawn at random, and
    a warning names it."""
    x = _scalar_feeds()["x"]
    np.savez(tmp_path / "in.npz", x=x)
    assert run_model_main([str(scalar_built), "--inputs", str(tmp_path / "in.npz"), "--repeat", "1", "--seed", "3",
                           "--check", "--outputs", str(tmp_path / "out.npz")]) == 0
    err = capsys.readouterr().err
    assert "warning: --inputs" in err and "gives no s" in err
    s = pipeline.load(scalar_built).random_feeds(3)["s"]
    with np.load(tmp_path / "out.npz") as got:
        np.testing.assert_array_equal(got["y"], run_ort(scaled(), {"x": x, "s": s})[0])


def test_a_truncated_library_is_one_line_not_a_crash(scalar_built, tmp_path):
    """An interrupted copy: loading a truncated model.so died with SIGBUS."""
    import subprocess
    import sys

    d = _copy(scalar_built, tmp_path)
    lib = d / "model.so"
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])
    p = subprocess.run([sys.executable, "-c", "import sys; from pipeline.cli import run_model_main; "
                        "sys.exit(run_model_main())", str(d), "--repeat", "1"], capture_output=True, text=True,
                       timeout=300, env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT),
                                         "TVM_NUM_THREADS": "1", "HOME": str(tmp_path)})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-2000:])
    assert lines[0] == (f"error: {lib} is not the library this build wrote (size/hash differs): copy the folder "
                        "again or rebuild")


def test_a_library_of_another_build_is_one_line(scalar_built, mlp_built, tmp_path):
    d = _copy(scalar_built, tmp_path)
    shutil.copyfile(mlp_built / "model.so", d / "model.so")
    with pytest.raises(UserError, match="model.so is not the library this build wrote"):
        pipeline.load(d).run(_scalar_feeds())


def test_a_rebuild_into_the_same_folder_runs_the_new_library_in_the_same_process(tmp_path):
    """dlopen gives back the library already loaded from a path: a model built twice into one folder in one
    process (here one length, then another) ran the first build's kernels while the first model lived, and
    refused the second build's length (pipeline.artifact.versioned_path)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [vi("x", TensorProto.FLOAT, ["n", 8])], [vi("y", TensorProto.FLOAT, ["n", 5])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path, out = tmp_path / "mm.onnx", tmp_path / "built"
    onnx.save(model, str(path))
    first = pipeline.optimize(str(path), output=out, threads=1, skip_graph=True, dims={"n": 3})
    x3 = rng.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(first.run({"x": x3})["y"], x3 @ w, rtol=1e-5, atol=1e-5)
    second = pipeline.optimize(str(path), output=out, threads=1, skip_graph=True, dims={"n": 6})
    x6 = rng.standard_normal((6, 8)).astype(np.float32)
    for model_ in (second, pipeline.load(out)):
        np.testing.assert_allclose(model_.run({"x": x6})["y"], x6 @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(first.run({"x": x3})["y"], x3 @ w, rtol=1e-5, atol=1e-5)  # the first still runs


def test_edited_dtypes_in_report_json_are_one_line_and_old_folders_still_load(scalar_built, tmp_path):
    d = _copy(scalar_built, tmp_path)
    _edit_report(d, lambda dep: dep["inputs"][1].update(dtype="float64"))
    with pytest.raises(UserError, match="report.json.*edited"):
        pipeline.load(d)
    # a folder written before the hashes: the library itself refuses the edited signature, in one line
    _edit_report(d, lambda dep: [dep.pop("files"), dep.pop("checksum")])
    with pytest.raises(UserError, match=r"model.so rejects input 's'.*report.json"):
        pipeline.load(d).run(_scalar_feeds())
    _edit_report(d, lambda dep: dep["inputs"][1].update(dtype="no-such-type"))
    with pytest.raises(UserError, match="report.json.*damaged"):
        pipeline.load(d)
    _edit_report(d, lambda dep: dep["inputs"][1].update(dtype="float32"))  # unedited, without hashes: runs
    np.testing.assert_array_equal(pipeline.load(d).run(_scalar_feeds())["y"], run_ort(scaled(), _scalar_feeds())[0])


@pytest.mark.parametrize("kwargs, words", [
    ({"trials": None}, "trials=None"), ({"trials": "0"}, "trials='0'"), ({"trials": True}, "trials=True"),
    ({"threads": "2"}, "threads='2'"), ({"seed": -1}, "seed=-1"), ({"seed": 1.5}, "seed=1.5"),
    ({"skip_graph": "yes"}, "skip_graph='yes'"), ({"input_shapes": {"x": "2,16"}}, "input_shapes"),
    ({"target": None}, "target=None"), ({"scheduler": "fifo"}, "scheduler='fifo'"),
    ({"searcher": "anneal"}, "searcher='anneal'"), ({"inputs": 3}, "inputs=3"), ({"output": 1}, "output=1"),
    ({"layout": "nhwc"}, "layout='nhwc'"), ({"time_limit": 0}, "time_limit=0"),
])
def test_api_arguments_of_a_wrong_type_or_value_are_one_line(kwargs, words, tmp_path):
    with pytest.raises(UserError, match=re.escape(words)) as info:
        pipeline.optimize(mlp(), **({"output": tmp_path / "o"} | kwargs))
    assert "\n" not in str(info.value) and not (tmp_path / "o").exists()
    with pytest.raises(UserError, match=re.escape("threads='2'")):
        pipeline.load(tmp_path, threads="2")


# ------------------------------------------------------------------------------------------------ rebuilds

def test_rebuild_from_complete_records_starts_no_measurer(tmp_path, monkeypatch):
    """A rerun whose records hold every trial rebuilds the same build without workers or a device."""
    from kerneltune import measure
    from pipeline.context import BuildContext, TuneOptions
    from pipeline.optimize_model import optimize_model

    path = tmp_path / "m.onnx"
    onnx.save(mlp(), str(path))
    records = tmp_path / "records.jsonl"
    tuning = TuneOptions(trials=4, records=str(records), progress=False)
    ctx = BuildContext.create(threads=1, skip_graph=True, tuning=tuning)
    first = optimize_model(str(path), str(tmp_path / "a"), ctx)
    assert first.report["stages"]["tune"]["measured_now"] > 0

    def no_measurer(*a, **k):
        raise AssertionError("a measurer was started for a rebuild from complete records")

    monkeypatch.setattr(measure.Measurer, "__init__", no_measurer)
    again = optimize_model(str(path), str(tmp_path / "b"), ctx)
    tune = again.report["stages"]["tune"]
    assert tune["measured_now"] == 0 and tune["trials"] == first.report["stages"]["tune"]["trials"]
    assert [t["schedule"] for t in again.report["tasks"]] == [t["schedule"] for t in first.report["tasks"]]
    assert tune["e2e"]["kept"] == first.report["stages"]["tune"]["e2e"]["kept"]
    assert tune["e2e"]["status"] in ("recorded", first.report["stages"]["tune"]["e2e"]["status"])


def test_metaschedule_engine_without_xgboost_names_the_extra(monkeypatch):
    import importlib.util

    from pipeline import metaschedule

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xgboost" else real(name, *a))
    with pytest.raises(UserError, match=r"optimize-model\[metaschedule\].*--skip-metaschedule"):
        metaschedule.check_installed()


# The command-line options the API spells differently, or leaves to the caller (where output goes, the log).
API_NAMES = {"model": "model", "input_shape": "input_shapes", "dim": "dims", "skip_tune": "skip_tune",
             "timeout": "tuning_timeout", "no_progress": "progress", "output": "output"}
NOT_IN_API = {"help", "version", "verbose", "quiet", "debug"}


def test_every_optimize_model_option_is_an_api_argument():
    """API parity (issue 42): what optimize-model takes, pipeline.optimize takes."""
    import inspect

    from pipeline.cli import build_optimize_parser

    options = {a.dest for a in build_optimize_parser()._actions} - NOT_IN_API
    params = set(inspect.signature(pipeline.optimize).parameters)
    assert {API_NAMES.get(o, o) for o in options} - params == set()
