"""Every bad input refused cleanly, every success checked (NaN included), artifacts whole or absent.

The corpus (``tests/bad_inputs.py``) runs against optimize-model, graphopt, tune-kernels, bench-model and
``python -m models``: every case must exit 0 with an artifact verified independently (TVM + onnxruntime
recomputed here) or exit 2 with one stderr line naming the problem.  In CI: every case that is refused
before TVM loads, in-process; a representative set as real subprocesses.  ``-m slow`` (and
``bench/reliability.py``) runs every case as a subprocess.  Also here: the output comparison on its own
(NaN probes, scale, dtypes), atomic writes on a full disk, temporary folders after SIGKILL, Ctrl-C.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper as h

import bad_inputs as B
from graphopt import fileio
from graphopt.compare import TOLERANCES, compare_outputs, compare_runs
from graphopt.errors import UserError
from graphopt.feeds import random_inputs, run_ort
from graphopt.onnx_io import import_onnx
from kerneltune.space import divisors, factorizations

CASES = B.all_cases()
IN_PROCESS = [c for c in CASES if c.before_tvm and not c.needs_unshare]
# One or more real subprocesses per command and category: the user's view (console-script start-up, TVM's
# native logging, exit codes) that an in-process call cannot show.
SUBPROCESS = {
    "missing-file/optimize-model", "truncated/tune-kernels", "cycle/tune-kernels", "no-outputs/optimize-model",
    "expand-130GB/graphopt", "shape-huge/tune-kernels", "op-shape-huge/tune-kernels", "no-subcommand/graphopt",
    "models-no-subcommand/models", "threads-huge/bench-model", "o-under-proc/optimize-model",
    "o-disk-full/optimize-model", "o-read-only/optimize-model", "nan-Relu/optimize-model",
    "gather-ids/optimize-model", "target-cuda-no-gpu/optimize-model", "lstm-1e5-steps/optimize-model",
}
UNSHARE = B.unshare_available()


def test_corpus_is_broad():
    categories = {c.category for c in CASES}
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)
    assert {"file", "invalid model", "input shape", "option", "output path", "--inputs", "NaN probe",
            "edge case"} <= categories
    assert {c.command for c in CASES} == {"optimize-model", "bench-model", "graphopt", "tune-kernels", "models"}
    assert SUBPROCESS <= {c.name for c in CASES}


def _assert_clean(outcome: B.Outcome) -> None:
    assert outcome.verdict == "clean", (outcome.verdict, outcome.detail, outcome.stderr[-1500:])


@pytest.mark.parametrize("case", IN_PROCESS, ids=lambda c: c.name)
def test_corpus_in_process(case, tmp_path):
    _assert_clean(B.run_case(case, tmp_path, in_process=True))


@pytest.mark.parametrize("case", [c for c in CASES if c.name in SUBPROCESS], ids=lambda c: c.name)
def test_corpus_subprocess(case, tmp_path):
    if case.needs_unshare and not UNSHARE:
        pytest.skip("no private mount namespace here (unshare -rm)")
    _assert_clean(B.run_case(case, tmp_path, in_process=False))


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.name not in SUBPROCESS], ids=lambda c: c.name)
def test_corpus_subprocess_all(case, tmp_path):
    if case.needs_unshare and not UNSHARE:
        pytest.skip("no private mount namespace here (unshare -rm)")
    _assert_clean(B.run_case(case, tmp_path, in_process=False))


def test_no_tvm_before_the_model_is_checked(tmp_path):
    """A bad file or graph is reported before TVM loads (it takes seconds): TVM is not even imported."""
    bad = B.save(B.model([h.make_node("Relu", ["x"], ["y"])], [B.vi("x", [2])], []), tmp_path)
    code = ("import sys; from pipeline.cli import optimize_model_main as m, tune_kernels_main as t, "
            "bench_model_main as b; "
            f"rc = [m([{str(tmp_path / 'nope.onnx')!r}, '-o', {str(tmp_path / 'o')!r}]), t([{bad!r}, '--list']), "
            f"b([{bad!r}])]; print(rc, 'tvm' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=B.environment(), timeout=120)
    assert p.stdout.strip() == "[2, 2, 2] False", (p.stdout, p.stderr)


def test_an_npz_bomb_is_refused_from_its_header_without_decompressing(tmp_path):
    """A 1 MB --inputs file holding 1 GB of compressed zeros took 1 GB of memory to be refused for a shape its
    128-byte header shows (issue 25): refused now from the header, or by the memory check of the shape it
    declares, with the memory a model check needs (tracemalloc follows numpy's buffers)."""
    import tracemalloc

    from graphopt.validate import check_model

    bomb = B.zeros_npz(tmp_path, "x", (2**28, 1))  # 1 GB of float32
    static = B.save(B.relu(), tmp_path)  # x is [2, 3]
    free_rows = B.save(B.model([h.make_node("Relu", ["x"], ["y"])], [B.vi("x", ["N", 1])], [B.vi("y", ["N", 1])]),
                       tmp_path, "n.onnx")
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match="has 268435456 at axis 0 where the model fixes 2"):
            check_model(static, None, bomb)
        with pytest.raises(UserError, match=r"tensor 'x' of shape \[268435456, 1\].*memory"):
            check_model(free_rows, None, bomb, memory_limit=2**28)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**26, f"{peak / 2**20:.0f} MiB allocated to refuse the file"


def test_a_partial_npz_draws_the_rest_at_random_with_one_warning(tmp_path, caplog):
    """optimize-model's rule, the same code as run-model's (tests/test_deploy.py): an input the file leaves
    out is drawn at random, and one warning line names it."""
    from graphopt.feeds import sample_feeds
    from graphopt.validate import check_model

    m = B.model([h.make_node("Add", ["x", "z"], ["y"])], [B.vi("x", [2, 3]), B.vi("z", [2, 3])], [B.vi("y", [2, 3])])
    path = B.save(m, tmp_path)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with caplog.at_level("WARNING"):
        model = check_model(path, None, B.npz(tmp_path, x=x))
    assert [r.getMessage() for r in caplog.records] == [
        f"warning: --inputs {tmp_path / 'in.npz'} gives no z: random values (the --seed draw) are used for it"]
    feeds = sample_feeds(import_onnx(m), model.samples, 5)
    np.testing.assert_array_equal(feeds["x"], x)
    np.testing.assert_array_equal(feeds["z"], random_inputs(import_onnx(m), 5)["z"])
    np.testing.assert_array_equal(run_ort(m, feeds)[0], x + feeds["z"])


# ---- the output comparison -------------------------------------------------------------------------------------

def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - np.max(z, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# Two ways a kernel may treat NaN: propagate it (IEEE arithmetic, numpy's max) or lose it (maxNum/minNum
# semantics: a max(x, 0) kernel, a reduction that skips NaN, a softmax treating NaN as -inf).
NAN_KERNELS = {
    "Relu": (lambda l: np.maximum(l, 0), lambda l: np.fmax(l, 0)),
    "Max": (lambda l: np.maximum(l, 0), lambda l: np.fmax(l, 0)),
    "Min": (lambda l: np.minimum(l, 0), lambda l: np.fmin(l, 0)),
    "Clip": (lambda l: np.minimum(np.maximum(l, 0), 1), lambda l: np.fmin(np.fmax(l, 0), 1)),
    "ReduceMax": (lambda l: np.max(l, axis=1), lambda l: np.nanmax(l, axis=1)),
    "Softmax": (_softmax, lambda l: _softmax(np.where(np.isnan(l), -np.inf, l))),
}


@pytest.mark.parametrize("op", list(NAN_KERNELS))
def test_nan_probe_is_caught(op):
    """op(Log(x)) on inputs half negative: whichever way onnxruntime treats the NaN, a kernel treating it the
    other way must fail the check (``max(err, nan)`` kept ``err``: issue 17 saw "max abs err 0")."""
    attrs = {"ReduceMax": {"axes": [1], "keepdims": 0}, "Softmax": {"axis": -1}}.get(op, {})
    m = B.unary_of_log(op, **attrs)
    feeds = random_inputs(import_onnx(m), 0)
    ref = run_ort(m, feeds)
    assert compare_outputs(ref, [ref[0].copy()]).ok  # the same NaNs: equal
    with np.errstate(invalid="ignore"):
        log = np.log(feeds["x"].astype(np.float64))
        results = [kernel(log).astype(np.float32) for kernel in NAN_KERNELS[op]]
    other = [r for r in results if not np.array_equal(np.isnan(r), np.isnan(ref[0]))]
    assert other, "both kernels agree with onnxruntime on NaN: the probe probes nothing"
    for wrong in other:
        verdict = compare_outputs(ref, [wrong])
        assert not verdict.ok and verdict.nan_mismatch > 0 and "NaN" in verdict.reason()


def test_the_check_fails_a_wrong_build(tmp_path):
    """End to end: a compiled model checked against a reference whose weight differs by 1% (what a wrong
    kernel looks like from outside) fails; against its own model it passes."""
    from kerneltune.targets.parse import parse_target
    from pipeline.compile import check_outputs, compile_partition
    from pipeline.partition import partition
    from pipeline.relax_import import import_model

    m = B.big_logits()
    imported = import_model(m)
    compiled = compile_partition(imported, partition(imported.mod), parse_target("llvm", 1))
    right = check_outputs(compiled, imported.graph, m)
    assert right.ok and right.input_sets == 3 and right.top1_agreement is not None
    wrong = onnx.ModelProto.FromString(m.SerializeToString())
    w = onnx.numpy_helper.to_array(wrong.graph.initializer[0]) * np.float32(1.01)
    wrong.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w, "w"))
    bad = check_outputs(compiled, imported.graph, wrong)
    assert not bad.ok and bad.worst > 1 and "exceed" in bad.reason()


def test_infinities_must_match_in_sign_and_place():
    ref = [np.array([np.inf, -np.inf, 1.0], np.float32)]
    assert compare_outputs(ref, [ref[0].copy()]).ok
    for got in ([np.inf, np.inf, 1.0], [np.inf, -np.inf, np.inf], [3e38, -np.inf, 1.0]):
        c = compare_outputs(ref, [np.array(got, np.float32)])
        assert not c.ok and c.inf_mismatch == 1


def test_scale_aware_check_passes_large_correct_outputs_and_fails_wrong_ones():
    """Logits near 800 (Inception-v3) re-associated in fp32 are off by ~1e-3 absolute, 1.6e-6 relative: that
    is correct; a wrong build (a swapped weight row, a dropped bias) is off by the order of the values."""
    rng = np.random.default_rng(0)
    ref = (rng.standard_normal((4, 1000)) * 300).astype(np.float32)
    noise = ref + (rng.standard_normal(ref.shape) * 1.3e-3).astype(np.float32)
    ok = compare_outputs([ref], [noise])
    assert ok.ok and ok.max_abs_err > 1e-4 and ok.max_rel_err < 1e-5 and ok.top1_agreement == 1.0
    assert (ok.atol, ok.rtol) == (TOLERANCES["float32"].atol, TOLERANCES["float32"].rtol)
    wrong = ref.copy()
    wrong[:, :2] = wrong[:, [1, 0]]  # two classes swapped
    bad = compare_outputs([ref], [wrong])
    assert not bad.ok and bad.worst > 1 and bad.max_abs_err > 1
    # tiny outputs: an absolute error far below 1e-4 that is 10% of the values is still wrong
    small = (rng.standard_normal(64) * 1e-6).astype(np.float32)
    assert compare_outputs([small], [small * 1.1]).ok  # within atol: below what fp32 kernels resolve here
    assert not compare_outputs([small * 1e3], [small * 1.1e3]).ok


def test_tolerance_follows_the_dtype():
    rng = np.random.default_rng(1)
    h16 = rng.standard_normal((8, 8)).astype(np.float16)
    near = (h16.astype(np.float32) + 4e-3).astype(np.float16)  # a few fp16 ulps: a correct fp16 kernel
    assert compare_outputs([h16], [near]).ok
    assert not compare_outputs([h16.astype(np.float32)], [near.astype(np.float32)]).ok  # not in fp32
    ints = np.arange(6, dtype=np.int64)
    assert compare_outputs([ints], [ints.copy()]).ok and not compare_outputs([ints], [ints + 1]).ok
    flags = np.array([True, False])
    assert not compare_outputs([flags], [~flags]).ok


def test_shape_or_count_mismatch_fails():
    a = np.zeros((2, 3), np.float32)
    assert not compare_outputs([a], [a.T]).ok and "shapes" in compare_outputs([a], [a.T]).reason()
    assert not compare_outputs([a, a], [a]).ok


def test_several_input_sets_merge_to_the_worst():
    a = np.ones(4, np.float32)
    c = compare_runs([([a], [a]), ([a], [a + 1e-3]), ([a], [a])])
    assert not c.ok and c.input_sets == 3 and math.isclose(c.max_abs_err, 1e-3, rel_tol=1e-3)
    d = json.loads(json.dumps(c.to_dict()))
    assert d["max_abs_err"] == c.max_abs_err and d["input_sets"] == 3


def test_random_integer_inputs_stay_inside_what_the_graph_indexes():
    from onnx import TensorProto as T

    table = np.zeros((7, 3), np.float32)
    m = B.model([h.make_node("Gather", ["t", "ids"], ["g"]),
                 h.make_node("GatherElements", ["u", "idx"], ["e"], axis=1),
                 h.make_node("OneHot", ["hot", "depth", "vals"], ["o"])],
                [B.vi("ids", [64], T.INT64), B.vi("idx", [2, 64], T.INT64), B.vi("hot", [64], T.INT64)],
                [B.vi("g", [64, 3]), B.vi("e", [2, 64]), B.vi("o", [64, 5])],
                [B.init("t", table), B.init("u", np.zeros((2, 11), np.float32)), B.init("depth", np.array(5)),
                 B.init("vals", np.array([0, 1], np.float32))])
    feeds = random_inputs(import_onnx(m), 0)
    assert feeds["ids"].max() == 6 and feeds["idx"].max() == 10 and feeds["hot"].max() == 4
    run_ort(m, feeds)  # a valid feed for the reference


# ---- O(n) loops over user sizes --------------------------------------------------------------------------------

def test_divisors_do_not_scan_up_to_n():
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 300))
    t0 = time.process_time()
    big = factorizations(99_999_999_999, 4)  # issue 17: the scan spun for minutes
    assert time.process_time() - t0 < 5 and all(math.prod(f) == 99_999_999_999 for f in big)


# ---- atomic writes, full disks, temporary folders --------------------------------------------------------------

def test_full_disk_leaves_no_file_under_the_final_name(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    target.write_text("old, complete")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full)
    with pytest.raises(UserError, match=f"no space left on {tmp_path}"):
        fileio.write_text_atomic(target, "new " * 1000)
    assert target.read_text() == "old, complete" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    with pytest.raises(UserError, match="no space left on"):  # a writer that only says it in its message
        with fileio.atomic_path(tmp_path / "model.so") as tmp:
            tmp.write_bytes(b"\x7fELF")
            raise RuntimeError("ld: final link failed: No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


@pytest.mark.skipif(not UNSHARE, reason="no private mount namespace here (unshare -rm)")
def test_full_tmpfs_leaves_no_partial_file(tmp_path):
    """A real full disk: a 64 KiB tmpfs in a private mount namespace, 1 MB written through the product's
    atomic write."""
    code = ("import sys; from graphopt.fileio import write_bytes_atomic; from graphopt.errors import UserError\n"
            "try:\n    write_bytes_atomic(sys.argv[1] + '/out.onnx', b'x' * 2**20)\n"
            "except UserError as e:\n    print(e)\n")
    script = f'mount -t tmpfs -o size=64k tmpfs {tmp_path} && "$@"; ls -A {tmp_path}'
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", sys.executable, "-c", code, str(tmp_path)],
                       capture_output=True, text=True, env=B.environment(), timeout=60)
    assert p.stdout.strip() == f"no space left on {tmp_path}: out.onnx was not written; free some space or write " \
                               "elsewhere", (p.stdout, p.stderr)


def test_full_disk_during_optimize_model_writes_nothing(tmp_path, monkeypatch, capsys):
    """The whole command: the model compiled and checked, then the disk fills at the first artifact."""
    from pipeline.cli import optimize_model_main

    src = B.save(B.relu((4, 8)), tmp_path)
    out = tmp_path / "out"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full)
    assert optimize_model_main([src, "-o", str(out), "--skip-graph", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no space left on {out}")
    assert not out.exists() or list(out.iterdir()) == []


def test_stale_temporary_folder_of_a_killed_run_is_removed(tmp_path):
    env = {**B.environment(), "TMPDIR": str(tmp_path)}
    kill = "import os, signal, tempfile; from graphopt.fileio import private_tempdir as p; d = p(); " \
           "open(os.path.join(tempfile.mkdtemp(), 'big'), 'w').write('x'); print(d, flush=True); " \
           "os.kill(os.getpid(), signal.SIGKILL)"
    p = subprocess.run([sys.executable, "-c", kill], capture_output=True, text=True, env=env, timeout=60)
    killed = Path(p.stdout.strip())
    assert p.returncode == -signal.SIGKILL and killed.parent == tmp_path and killed.is_dir()
    live = subprocess.Popen([sys.executable, "-c", "import time; from graphopt.fileio import private_tempdir as p; "
                             "print(p(), flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        alive = Path(live.stdout.readline().strip())
        assert not killed.exists() and alive.is_dir()  # the killed run's folder is gone, the live one's kept
        again = subprocess.run([sys.executable, "-c", "from graphopt.fileio import private_tempdir as p; print(p())"],
                               capture_output=True, text=True, env=env, timeout=60)
        assert alive.is_dir() and not Path(again.stdout.strip()).exists()  # removed at its normal exit
    finally:
        live.kill()
        live.wait()


def test_graphopt_optimize_writes_nothing_when_outputs_differ(tmp_path, monkeypatch, capsys):
    """A wrong rewrite (simulated: the stage hands back a graph computing Neg) must not be saved."""
    import graphopt.stage as stage
    from pipeline.cli import graphopt_main

    real = stage.optimize_graph

    def wrong(graph, cost, options=None):
        res = real(graph, cost, options)
        res.graph.nodes[0].op_type = "Neg"
        res.check.kept = "optimized"
        return res

    monkeypatch.setattr(stage, "optimize_graph", wrong)
    src, out = B.save(B.relu(), tmp_path), tmp_path / "opt.onnx"
    assert graphopt_main(["optimize", src, "-o", str(out), "--cost", "analytic", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "differs from the input model" in err[0] and not out.exists()


@pytest.mark.slow
def test_ctrl_c_during_tuning_is_one_line_and_no_worker_traceback(tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does) while workers build and run."""
    records = tmp_path / "r.jsonl"
    cmd = B.command_line("tune-kernels", ["--op", "matmul", "--shape", "64,64,64", "--trials", "400", "--workers", "2",
                                          "--records", str(records), "--no-progress"])
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=B.environment(),
                         start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and (not records.exists() or records.stat().st_size == 0):
            time.sleep(0.5)
        assert records.exists(), "no record written in time"
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = B._error_lines(err)
    assert p.returncode == 130 and "Traceback" not in err and lines == [
        "error: interrupted; tuning records written so far are kept, rerun to resume"], err[-2000:]


@pytest.mark.slow
def test_sigkill_during_tuning_leaves_no_traceback_and_no_temporary_folder(tmp_path):
    """SIGKILL to the tuner alone: its workers notice the closed pipe and end without a BrokenPipeError
    traceback, and the next run removes the killed run's temporary folder."""
    base = tmp_path / "tmp"
    base.mkdir()
    env = {**B.environment(), "TMPDIR": str(base)}
    records = tmp_path / "r.jsonl"
    cmd = B.command_line("tune-kernels", ["--op", "matmul", "--shape", "64,64,64", "--trials", "400", "--workers", "2",
                                          "--records", str(records), "--no-progress"])
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                         start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and (not records.exists() or records.stat().st_size == 0):
            time.sleep(0.5)
        assert records.exists(), "no record written in time"
        assert [d.name for d in base.iterdir() if d.name.startswith("optimize-model-")], "no private temp folder"
        os.kill(p.pid, signal.SIGKILL)
        err = p.stderr.read()  # EOF once every process holding the pipe (the workers too) has ended
        p.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]
    subprocess.run(B.command_line("tune-kernels", ["--op", "matmul", "--shape", "8,8,8", "--trials", "0"]),
                   capture_output=True, env=env, timeout=120)  # refused at once, but starts as every run does
    assert [d.name for d in base.iterdir() if d.name.startswith("optimize-model-")] == []


def test_a_process_killed_by_a_signal_is_its_own_verdict():
    """SIGFPE, SIGSEGV, SIGBUS: the user saw no message; the corpus counts them apart (issue 25)."""
    case = B.all_cases()[0]
    assert B.judge(case, Path("."), [], -8, "", "")[0] == "signal"
    assert "SIGFPE" in B.judge(case, Path("."), [], 136, "", "")[1]
    assert B.judge(case, Path("."), [], 3, "", "error: boom")[0] == "internal"
    assert B.Summary([B.Outcome(case.name, "signal", -8, "", 0.0)]).counts()["signals"] == 1
