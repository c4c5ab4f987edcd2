"""Measurer: parallel builds in reusable workers, timed runs, failures recorded without stopping, wrong
kernels caught by the reference check."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import tvm

import rpc_device
from kerneltune import templates
from kerneltune.targets.host import llvm_target
from kerneltune.baseline import numpy_baseline
from kerneltune.measure import MeasureOptions, Measurer
from kerneltune.runner import RunConfig, run
from kerneltune.task import build_func, make_task

LLVM = llvm_target(2)  # AVX-512 code on this Zen 5, like the pipeline's


@pytest.fixture(scope="module")
def measurer():
    with Measurer(LLVM, MeasureOptions(number=2, repeat=2, build_timeout=120, run_timeout=60), workers=1) as m:
        yield m


def test_measure_valid_invalid_and_broken_configs(measurer):
    task = make_task("matmul", "32,48,64")
    good = templates.default_config(task, LLVM)
    space = templates.space_for(task, LLVM)
    other = space.from_dict({**space.as_dict(good), "tile_k": (48, 1), "unroll": 0})
    results = measurer.measure(task, [good, good[:-1], other])
    assert [r.config for r in results] == [good, good[:-1], other]
    assert results[0].error is None and results[0].gflops > 0 and results[0].latency_s > 0
    assert results[0].gflops == pytest.approx(task.flops / results[0].latency_s / 1e9)
    assert results[1].error.startswith("invalid config") and results[1].gflops == 0
    assert results[2].error is None and results[2].gflops > 0     # the config after a failure still runs

    # A task whose anchor block does not exist fails inside the build worker: recorded, not raised.
    broken = dataclasses.replace(task, anchor="no_such_block")
    bad, after = measurer.measure(broken, [good])[0], measurer.measure(task, [good])[0]
    assert bad.error.startswith("build failed") and bad.gflops == 0 and bad.latency_s is None
    assert after.error is None and after.gflops > 0

    # Builders never import the slow tensor intrinsics module.
    status, modules = measurer.builder.pool.call("kerneltune.pool:loaded_modules", (), 60)
    assert status == "ok" and "tvm.s_tir.tensor_intrin" not in modules and "tvm" in modules


def test_build_and_run_timeouts_do_not_stop_tuning(measurer):
    task = make_task("matmul", "16,16,32")
    good = templates.default_config(task, LLVM)
    measurer.builder.timeout = 0.001  # nothing builds this fast: the worker is killed and replaced
    try:
        timed_out = measurer.measure(task, [good])[0]
    finally:
        measurer.builder.timeout = 120
    assert timed_out.error == "build timeout" and timed_out.gflops == 0
    # a kernel whose timed runs take tens of ms: the 16x16x32 one answered within 1 ms, or its answer was
    # already waiting when a loaded parent polled for it, and the test depended on the machine's load
    task = make_task("matmul", "512,512,512")
    good = templates.default_config(task, LLVM)
    measurer.runner.timeout = 0.001
    try:
        run_out = measurer.measure(task, [good])[0]
    finally:
        measurer.runner.timeout = 60
    assert run_out.error == "run timeout" and run_out.gflops == 0
    again = measurer.measure(task, [good])[0]
    assert again.error is None and again.gflops > 0


def test_wrong_kernel_is_caught(tmp_path):
    """A library computing A @ B^T instead of A @ B is flagged by the reference check."""
    task = make_task("matmul", "16,16,16")
    wrong_task = make_task("matmul", "16,16,16", transpose_b=True)
    path = str(tmp_path / "wrong.so")
    build_func(templates.apply(wrong_task, templates.default_config(wrong_task, LLVM), LLVM), LLVM).export_library(path)
    latency, error = run(task, path, RunConfig("cpu", 1, 1), None)
    assert latency > 0 and error is not None and error.startswith("wrong result: max err")
    right = str(tmp_path / "right.so")
    build_func(templates.apply(task, templates.default_config(task, LLVM), LLVM), LLVM).export_library(right)
    assert run(task, right, RunConfig("cpu", 1, 1), None)[1] is None
    # Above the best so far -> checked; at or below it -> not re-checked (the check costs a run).
    assert run(task, path, RunConfig("cpu", 1, 1), float("inf"))[1] is None


def test_numpy_baseline_runs_blas_with_the_threads_asked_for():
    """OpenBLAS starts one thread per core unless told otherwise before it loads: the measuring process
    runs with exactly the threads given (its OS thread count), whatever this process's environment says."""
    one = numpy_baseline(64, 64, 64, threads=1, min_seconds=0.05, repeat=3)
    assert np.isfinite(one.gflops) and one.gflops > 0 and one.threads == 1
    assert one.process_threads == 1
    if len(os.sched_getaffinity(0)) >= 2:  # OpenBLAS starts no more threads than cores
        two = numpy_baseline(64, 64, 64, threads=2, min_seconds=0.05, repeat=3)
        assert two.process_threads == 2


def test_bad_target_kind_is_user_error():
    from graphopt.errors import UserError

    with pytest.raises(UserError):
        Measurer(tvm.target.Target({"kind": "c"}))


def _measure_default(rpc: str):
    task = make_task("matmul", "16,32,16")
    with Measurer(LLVM, MeasureOptions(number=2, repeat=2), workers=1, rpc=rpc) as m:
        return m.measure(task, [templates.default_config(task, LLVM)])[0]


@pytest.mark.slow  # the tracker test below measures through a server the same way, and checks the keys too
def test_rpc_server_uses_same_path():
    """A TVM RPC server (here on localhost) measures through the same upload/load/time_evaluator path."""
    with rpc_device.server() as address:
        result = _measure_default(address)
    assert result.error is None and result.gflops > 0


def test_rpc_tracker_hands_out_the_keyed_device(rpc_tracker):
    """Scale-out as deployed: a tracker, a device server registered under a key, and ``host:port:key``."""
    from graphopt.errors import UserError
    from kerneltune.runner import check_device

    rpc = rpc_tracker
    result = _measure_default(rpc)
    assert result.error is None and result.gflops > 0
    # The up-front check: a key no server registered is refused at once, naming the keys there are.
    check_device(rpc)
    with pytest.raises(UserError, match=r"no device registered under key 'gpu0' \(registered: testcpu\)"):
        check_device(rpc.rsplit(":", 1)[0] + ":gpu0")


@pytest.mark.slow
def test_cold_cache_timing_is_slower_on_a_weight_bound_kernel(tmp_path):
    """``cache_flush`` times the kernel with its weight in DRAM, as in a model: on a matmul that streams an
    8 MiB weight for 8 rows, cold calls must cost clearly more than warm ones (cache-resident weight).
    A comparison of two timings: slow (run it on a quiet machine), since other load on the cores moves both."""
    task = make_task("matmul", "8,2048,1024")
    lib_path = str(tmp_path / "k.so")
    build_func(templates.apply(task, templates.default_config(task, LLVM), LLVM), LLVM).export_library(lib_path)
    warm, err_w = run(task, lib_path, RunConfig("cpu", 20, 5), None)
    cold, err_c = run(task, lib_path, RunConfig("cpu", 20, 5, cache_flush=True), None)
    assert err_w is None and err_c is None
    assert cold > 1.2 * warm, (cold, warm)


def test_cold_cache_measurer_times_and_labels_its_records():
    """A measurer with ``cache_flush`` runs the kernel correctly and labels its timings "cold", so records
    taken with warm caches never resume it."""
    task = make_task("matmul", "8,2048,1024")
    with Measurer(LLVM, workers=1, cache_flush=True) as m:
        assert m.timing == "cold"
        res = m.measure(task, [templates.default_config(task, LLVM)])[0]
        assert res.error is None and res.gflops > 0


def test_slow_kernels_get_fewer_timed_calls():
    """An untiled kernel (G-BFS's start) must not cost 30 calls of half a second: the calls per timing
    shrink to fit the budget; fast kernels keep what was asked; cold timings keep one call each."""
    from kerneltune.runner import COLD_REPEAT, TIMING_BUDGET_S, timing_plan

    assert timing_plan(1e-4, 10, 3, False) == (10, 3)
    number, repeat = timing_plan(0.05, 10, 3, False)
    assert repeat == 3 and 1 <= number < 10 and number * repeat * 0.05 <= TIMING_BUDGET_S
    assert timing_plan(5.0, 10, 3, False) == (1, 3)        # never below one call per timing
    assert timing_plan(1e-4, 10, 3, True) == (1, COLD_REPEAT)
    assert timing_plan(5.0, 10, 3, True) == (1, 3)



def test_measurer_composes_an_injected_builder_and_runner():
    """The measurer only composes its parts: a builder and a runner handed in (a test, a remote setup) are
    used as they are, and closed with it; each run gets the best verified GFLOPS so far as ``check_above``;
    failures keep their messages."""
    from kerneltune.builder import BuilderResult
    from kerneltune.runner import RunnerResult

    task = make_task("matmul", "16,16,16")
    lat = {(1,): 2e-6, (2,): 1e-6, (3,): 4e-6}  # (4,) fails to build, (5,) runs wrong

    class Builder:
        closed = False

        def build(self, inputs):
            return [BuilderResult(None, "invalid config: no", 0.5) if i.config == (4,) else
                    BuilderResult(f"/nonexistent/{i.config[0]}.so", None, 0.25, ("p",)) for i in inputs]

        def close(self):
            self.closed = True

    class Runner:
        closed = False
        seen: list = []

        def run(self, inputs):
            (item,) = inputs
            self.seen.append((item.artifact_path, item.packings, item.check_above))
            n = int(item.artifact_path.rsplit("/", 1)[1].split(".")[0])
            if n == 5:
                return [RunnerResult(3e-6, "wrong result: max err 1", 0.125)]
            return [RunnerResult(lat[(n,)], None, 0.125)]

        def close(self):
            self.closed = True

    builder, runner = Builder(), Runner()
    with Measurer(LLVM, builder=builder, runner=runner) as m:
        results = m.measure(task, [(1,), (4,), (2,), (3,), (5,)])
    assert builder.closed and runner.closed
    g = [task.flops / lat[(n,)] / 1e9 for n in (1, 2)]
    assert [r.error for r in results] == [None, "invalid config: no", None, None, "wrong result: max err 1"]
    assert results[0].gflops == pytest.approx(g[0]) and results[1].build_s == 0.5 and results[1].run_s == 0.0
    assert results[4].gflops == 0 and results[4].latency_s == 3e-6 and results[2].build_s == 0.25
    assert [s[2] for s in runner.seen] == [None, g[0], g[1], g[1]]
    assert all(s[1] == ("p",) for s in runner.seen)


def test_the_target_owns_its_thread_count(monkeypatch):
    """A target's thread count is read by kerneltune.targets alone (``num_cores``, ``TargetSpec.threads``):
    each caller gives what a target without one means to it, and the measurer's workers run with it."""
    from kerneltune.measure import worker_env
    from kerneltune.targets.host import num_cores
    from kerneltune.targets.parse import parse_target

    two, bare = llvm_target(2), tvm.target.Target({"kind": "llvm"})
    assert num_cores(two) == 2 and num_cores(bare) == 1 and num_cores(bare, default=0) == 0
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    assert worker_env(two) == {"TVM_NUM_THREADS": "2"}
    assert worker_env(bare) == {"TVM_NUM_THREADS": str(os.cpu_count() or 1)}
    assert parse_target("llvm", 3).threads == 3 and parse_target("cuda", 3).threads is None  # report.json's
