"""Measure configs of a task: build them in parallel worker processes, time them one at a time.

API::

    m = Measurer(target, MeasureOptions(number=10, repeat=3, min_repeat_ms=0, build_timeout=60, run_timeout=30,
                                        session_timeout=60), workers=2, rpc=None, cache_flush=False)
    results = m.measure(task, configs)      # list[MeasureResult], same order as configs
    m.close()                               # or use ``with Measurer(...) as m:``

    Measurer(target, builder=my_builder, runner=my_runner)   # injected parts (a test, a remote setup)

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

The measurer composes a builder and a runner, each a small interface in its own module (as MetaSchedule's
``Builder.build(list[BuilderInput]) -> list[BuilderResult]`` and ``Runner.run(list[RunnerInput]) ->
list[RunnerResult]``), injected or built from the options:

* :mod:`kerneltune.builder` - schedule + compile + export configs; :class:`~kerneltune.builder.LocalBuilder`
  builds in a pool of ``workers`` spawned processes started once and reused (:mod:`kerneltune.pool`;
  importing TVM costs seconds, ``tvm.s_tir.tensor_intrin`` is never imported).  A build that hangs past
  ``build_timeout`` or crashes its process is recorded as a failure and the worker is replaced -- the tuner
  never dies with it.
* :mod:`kerneltune.runner` - load + time + check; :class:`~kerneltune.runner.SessionRunner` runs local and
  RPC devices behind one interface (a TVM RPC session: ``LocalSession`` here, a server or a tracker's device
  with ``rpc``).  All builds of a batch finish before any timing starts, and configs are timed one after
  another in one runner process: on a 2-core machine a concurrent compile would corrupt the timings.  The
  runner is killed and replaced when a run exceeds ``run_timeout`` (an infinite or pathological kernel).
* :mod:`kerneltune.check` - the output is compared with the task's reference for the first successful config
  of a task and for every config that beats the best so far, so a wrong fast kernel can never become the
  best one (this module keeps the best so far and hands it to the runner as ``check_above``).

Runners and builders read ``TVM_NUM_THREADS`` from the environment; when unset they use the target's
``num-cores`` (TVM would use one thread on this VM otherwise).

numpy's own matmul on the same shape, for comparisons in one run, is :mod:`kerneltune.baseline`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import tvm

from kerneltune.builder import Builder, BuilderInput, LocalBuilder
from kerneltune.runner import RunConfig, Runner, RunnerInput, RunnerResult, SessionRunner, check_rpc
from kerneltune.targets.host import num_cores
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


def worker_env(target) -> dict[str, str]:
    """The environment of the build and run workers: ``TVM_NUM_THREADS`` from the environment, else the
    target's ``num-cores`` (TVM would use one thread on this VM otherwise)."""
    cores = num_cores(target, default=os.cpu_count() or 1)
    return {"TVM_NUM_THREADS": str(tvm_num_threads(cores))}


class Measurer:
    """Builds configs with a :class:`~kerneltune.builder.Builder` (parallel, in worker processes), times them
    with a :class:`~kerneltune.runner.Runner` (sequentially, in one runner process) and keeps each task's
    best verified GFLOPS, the threshold of the reference check.

    ``builder`` and ``runner`` are injected when given (a test, a remote build farm); by default a
    :class:`~kerneltune.builder.LocalBuilder` of ``workers`` processes and a
    :class:`~kerneltune.runner.SessionRunner` on this machine or the ``rpc`` device, both from ``options``.
    The measurer closes them."""

    def __init__(self, target, options: MeasureOptions = MeasureOptions(), workers: int | None = None,
                 rpc: str | None = None, cache_flush: bool = False, *, builder: Builder | None = None,
                 runner: Runner | None = None):
        self.target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
        device = kind_of(self.target).device  # a UserError for kinds we cannot measure on
        # The flush is a CPU instruction (clflush): a GPU kernel's operands live in device memory.
        self.cache_flush = cache_flush and device == "cpu"
        check_rpc(rpc)
        env = worker_env(self.target) if builder is None or runner is None else {}
        self.builder = builder if builder is not None else LocalBuilder(
            self.target, workers or max(1, min(os.cpu_count() or 1, 4)), env, options.build_timeout)
        self.runner = runner if runner is not None else SessionRunner(
            RunConfig(device, options.number, options.repeat, options.min_repeat_ms, self.cache_flush, rpc,
                      options.session_timeout), env, options.run_timeout)
        self._best: dict[str, float] = {}  # task key -> best verified GFLOPS

    @property
    def timing(self) -> str:
        """How latencies are taken (``warm`` or ``cold``): records of one kind never resume the other."""
        return timing_of(self.cache_flush)

    def __enter__(self) -> "Measurer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.builder.close()
        self.runner.close()

    def measure(self, task, configs: Sequence[tuple]) -> list[MeasureResult]:
        """Build every config, then time them in order; failures get gflops 0 and a reason.

        Each config is handed to the runner alone: the reference check's threshold is the best GFLOPS so
        far, which the config before may have just raised."""
        configs = [tuple(tuple(v) if isinstance(v, list) else v for v in c) for c in configs]
        built = self.builder.build([BuilderInput(task, config) for config in configs])
        results = []
        for config, b in zip(configs, built):
            if b.error is not None:
                results.append(MeasureResult(config, None, 0.0, b.error, b.build_s, 0.0))
                continue
            best = self._best.get(task.key)
            r = self.runner.run([RunnerInput(task, b.artifact_path, b.packings, best)])[0]
            results.append(self._result(task, config, b.build_s, r))
            try:
                os.remove(b.artifact_path)
            except OSError:
                pass
        return results

    def _result(self, task, config, build_s: float, r: RunnerResult) -> MeasureResult:
        if r.error is not None:
            return MeasureResult(config, r.latency_s, 0.0, r.error, build_s, r.run_s)
        gflops = task.flops / r.latency_s / 1e9
        best = self._best.get(task.key)
        if best is None or gflops > best:
            self._best[task.key] = gflops
        return MeasureResult(config, r.latency_s, gflops, None, build_s, r.run_s)
