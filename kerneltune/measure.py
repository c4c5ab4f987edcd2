"""Measure configs of a task: build them in parallel worker processes, time them one at a time.

API::

    m = Measurer(target, MeasureOptions(number=10, repeat=3, min_repeat_ms=0, build_timeout=60, run_timeout=30,
                                        session_timeout=60), workers=2, rpc=None, cache_flush=False)
    results = m.measure(task, configs)      # list[MeasureResult], same order as configs
    m.close()                               # or use ``with Measurer(...) as m:``

``MeasureResult``: ``config``, ``latency_s`` (median of ``repeat`` timings, each the mean of ``number``
calls, or of enough calls to last ``min_repeat_ms``, or of fewer calls when one call is so slow that they
would take over ``TIMING_BUDGET_S``; None on failure), ``gflops`` (0 on failure),
``error`` (None, or one of ``"invalid config: ..."``, ``"build failed: ..."``, ``"build timeout"``,
``"run timeout"``, ``"run failed: ..."``, ``"wrong result: max err ..."``), ``build_s`` (seconds the
worker spent scheduling + compiling + exporting) and ``run_s`` (wall seconds of the timed run).
``Measurer.measure`` never raises for a bad config; the tuner just reads ``error``.

``cache_flush=True`` (CPU targets; ``Measurer.timing == "cold"``) flushes every argument but the first from
the caches before each call and times calls one by one: inside a model a kernel's weights come from DRAM
(BERT-base holds 340 MB of them) while its activation input was just written by the previous kernel.
Timed warm, the tuned BERT-base matmuls ran 1.4-1.6x slower in the model than in the tuner (128x768x3072:
1.35 ms tuned, 2.16 ms in place; timed cold: 1.98 ms), and the configs that win warm are not the ones
that win cold.  Ansor and MetaSchedule flush the same way (``enable_cpu_cache_flush``).

The measurer composes four parts, each in its own module (MetaSchedule's builder / runner split):

* :mod:`kerneltune.builder` - schedule + compile + export one config, in a pool of ``workers`` spawned
  processes started once and reused (:mod:`kerneltune.pool`; importing TVM costs seconds,
  ``tvm.s_tir.tensor_intrin`` is never imported).  A build that hangs past ``build_timeout`` or crashes its
  process is recorded as a failure and the worker is replaced -- the tuner never dies with it.
* :mod:`kerneltune.runner` - load + time + check, local or over RPC behind one session interface.  All builds
  of a batch finish before any timing starts, and configs are timed one after another in one runner
  process: on a 2-core machine a concurrent compile would corrupt the timings.  The runner is killed and
  replaced when a run exceeds ``run_timeout`` (an infinite or pathological kernel).
* :mod:`kerneltune.check` - the output is compared with the task's reference for the first successful config
  of a task and for every config that beats the best so far, so a wrong fast kernel can never become the
  best one (this module keeps the best so far).

Runners and builders read ``TVM_NUM_THREADS`` from the environment; when unset they use the target's
``num-cores`` (TVM would use one thread on this VM otherwise).

numpy's own matmul on the same shape, for comparisons in one run, is :mod:`kerneltune.baseline`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import tvm

from kerneltune.pool import WorkerPool
from kerneltune.runner import RunConfig, check_rpc
from kerneltune.targets.registry import kind_of
from kerneltune.targets.threads import tvm_num_threads


@dataclass
class MeasureResult:
    config: tuple
    latency_s: float | None
    gflops: float
    error: str | None
    build_s: float
    run_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


def timing_of(cache_flush: bool) -> str:
    """The records' timing label of a measurer that flushes caches (``cold``) or not (``warm``)."""
    return "cold" if cache_flush else "warm"


class LazyMeasurer:
    """A measurer started at the first ``measure`` call: a rerun whose records hold every config the search
    proposes (a rebuild from complete records) starts no worker process and never touches the device.
    ``start()`` returns the real measurer (it may check the device first); ``timing`` must be known before
    it starts, since it selects which records resume the run."""

    def __init__(self, start: Callable[[], "Measurer"], timing: str):
        self._start, self.timing = start, timing
        self._real: Measurer | None = None

    @property
    def started(self) -> bool:
        return self._real is not None

    def measure(self, task, configs: Sequence[tuple]) -> list[MeasureResult]:
        if self._real is None:
            self._real = self._start()
        return self._real.measure(task, configs)

    def __enter__(self) -> "LazyMeasurer":
        return self

    def __exit__(self, *exc) -> None:
        if self._real is not None:
            self._real.close()


@dataclass(frozen=True)
class MeasureOptions:
    """How a :class:`Measurer` times and how long it waits (see the module docstring)."""

    number: int = 10  # calls per timing
    repeat: int = 3  # timings per config (their median is the latency)
    min_repeat_ms: int = 0  # a timing lasts at least this long (more calls)
    build_timeout: float = 60.0  # seconds one config's build may take
    run_timeout: float = 30.0  # seconds one config's run may take
    session_timeout: int = 60  # seconds an --rpc session is held


class Measurer:
    """Builds (parallel, in worker processes) and times (sequentially, in one runner process) configs."""

    PREPARE_TIMEOUT = 900.0  # naive reference of the largest benchmark operators, on a loaded machine

    def __init__(self, target, options: MeasureOptions = MeasureOptions(), workers: int | None = None,
                 rpc: str | None = None, cache_flush: bool = False):
        self.target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
        self.device = kind_of(self.target).device  # a UserError for kinds we cannot measure on
        # The flush is a CPU instruction (clflush): a GPU kernel's operands live in device memory.
        self.cache_flush = cache_flush and self.device == "cpu"
        self.number, self.repeat, self.min_repeat_ms = options.number, options.repeat, options.min_repeat_ms
        self.build_timeout, self.run_timeout = options.build_timeout, options.run_timeout
        check_rpc(rpc)
        self.rpc, self.session_timeout = rpc, options.session_timeout
        cores = int(self.target.attrs["num-cores"]) if "num-cores" in self.target.attrs else (os.cpu_count() or 1)
        env = {"TVM_NUM_THREADS": str(tvm_num_threads(cores))}
        self._target_json = str(self.target)
        self._tmp = tempfile.mkdtemp(prefix="kerneltune-")
        self._builders = WorkerPool(workers or max(1, min(os.cpu_count() or 1, 4)), env, "kerneltune.builder:warm")
        self._runner = WorkerPool(1, env, "kerneltune.runner:warm")
        self._best: dict[str, float] = {}  # task key -> best verified GFLOPS
        self._prepared: tuple[str, int] | None = None  # (task key, runner generation) holding its reference
        self._counter = 0
        self._lock = threading.Lock()

    @property
    def run_config(self) -> RunConfig:
        return RunConfig(self.device, self.number, self.repeat, self.min_repeat_ms, self.cache_flush, self.rpc,
                         self.session_timeout)

    @property
    def timing(self) -> str:
        """How latencies are taken (``warm`` or ``cold``): records of one kind never resume the other."""
        return timing_of(self.cache_flush)

    def __enter__(self) -> "Measurer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._builders.close()
        self._runner.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _lib_path(self) -> str:
        with self._lock:
            self._counter += 1
            return os.path.join(self._tmp, f"k{self._counter}.so")

    def measure(self, task, configs: Sequence[tuple]) -> list[MeasureResult]:
        """Build every config, then time them in order; failures get gflops 0 and a reason."""
        configs = [tuple(tuple(v) if isinstance(v, list) else v for v in c) for c in configs]

        def build(config):
            path = self._lib_path()
            t0 = time.perf_counter()
            status, value = self._builders.call("kerneltune.builder:build", (task, config, self._target_json, path),
                                                self.build_timeout)
            return status, value, time.perf_counter() - t0

        built = self._builders.map(build, configs)
        results = []
        for config, (status, value, build_s) in zip(configs, built):
            if status != "ok":
                error = {"invalid": f"invalid config: {value}", "error": f"build failed: {value}",
                         "timeout": "build timeout", "crash": f"build failed: {value}"}[status]
                results.append(MeasureResult(config, None, 0.0, error, build_s, 0.0))
                continue
            path, build_s, packings = value
            results.append(self._run(task, config, path, build_s, tuple(packings)))
            try:
                os.remove(path)
            except OSError:
                pass
        return results

    def _run(self, task, config, lib_path: str, build_s: float, packings: tuple = ()) -> MeasureResult:
        best = self._best.get(task.key)
        runner = self._runner.workers[0]
        if self._prepared != (task.key, runner.generation):
            status, value = self._runner.call("kerneltune.runner:prepare", (task,), self.PREPARE_TIMEOUT)
            if status != "ok":
                return MeasureResult(config, None, 0.0, f"run failed: reference: {value or status}", build_s, 0.0)
            self._prepared = (task.key, runner.generation)
        t0 = time.perf_counter()
        status, value = self._runner.call("kerneltune.runner:run", (task, lib_path, self.run_config, best, packings),
                                          self.run_timeout)
        run_s = time.perf_counter() - t0
        if status == "timeout":
            return MeasureResult(config, None, 0.0, "run timeout", build_s, run_s)
        if status != "ok":
            return MeasureResult(config, None, 0.0, f"run failed: {value}", build_s, run_s)
        latency, error = value
        if error is not None:
            return MeasureResult(config, latency, 0.0, error, build_s, run_s)
        gflops = task.flops / latency / 1e9
        if best is None or gflops > best:
            self._best[task.key] = gflops
        return MeasureResult(config, latency, gflops, None, build_s, run_s)

