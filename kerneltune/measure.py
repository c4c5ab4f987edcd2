"""Measure configs of a task: build them in parallel worker processes, time them one at a time.

API::

    m = Measurer(target, number=10, repeat=3, build_timeout=60, run_timeout=30, workers=2, rpc=None,
                 session_timeout=60, min_repeat_ms=0, cache_flush=False)
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

Why processes, and why two phases:

* Builds run in a pool of ``workers`` spawned processes, started once and reused (importing TVM costs
  seconds; ``tvm.s_tir.tensor_intrin`` is never imported).  A build that hangs past ``build_timeout`` or
  crashes its process is recorded as a failure and the worker is replaced -- the tuner never dies with it.
* All builds of a batch finish before any timing starts, and configs are timed one after another in one
  runner process: on a 2-core machine a concurrent compile would corrupt the timings.  The runner is
  killed and replaced when a run exceeds ``run_timeout`` (an infinite or pathological kernel).
* The output is compared with the task's reference (unscheduled PrimFunc built with LLVM) for the first
  successful config of a task and for every config that beats the best so far, so a wrong fast kernel can
  never become the best one.
* Local and remote devices take the same path: an RPC session (``tvm.rpc.LocalSession`` locally; a tracker
  session with ``rpc="host:port:key"``; a server reached directly with ``rpc="host:port"``) uploads the built
  library, loads it and runs ``time_evaluator``.  The reference output is always computed on the host.

Runners and builders read ``TVM_NUM_THREADS`` from the environment; when unset they use the target's
``num-cores`` (TVM would use one thread on this VM otherwise).

``numpy_gflops(M, K, N)`` times numpy's (OpenBLAS) matmul on the same shape, for comparisons in one run.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import subprocess
import sys
import shutil
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kerneltune.native_log import quiet_native_stderr
from kerneltune.targets import kind_of, tvm_num_threads

# Tolerance of the correctness check, relative to the reference's largest magnitude: a different summation
# order of fp32 dot products differs by ~1e-6 of it; a wrong kernel by O(1).
REL_TOL = 1e-4
# Timed calls with cold caches (one call per timing: the flush runs before each timing, not each call).
COLD_REPEAT = 15
# Seconds of timed calls a config gets at most (fewer calls for slow kernels; never fewer than one per
# repeat): without it an untiled kernel of a big operator costs 30 calls x 0.5 s.
TIMING_BUDGET_S = 1.0


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


def _short(exc: BaseException, limit: int = 200) -> str:
    """One line: the last non-empty line of the message (TVM errors put the reason there)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    return text[:limit]


# ----------------------------------------------------------------------------------------- worker process

def _serve(conn, env: dict[str, str]) -> None:
    """Worker main loop: receive (function name, args), reply (True, value) or (False, message)."""
    os.environ.update(env)
    funcs = {"build": _build_in_worker, "run": _run_in_worker, "warm": _warm, "prepare": _prepare_in_worker,
             "modules": lambda: sorted(sys.modules)}
    while True:
        try:
            name, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, funcs[name](*args)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent as a failed item
            conn.send((False, exc.__class__.__name__ == "InvalidConfig", _short(exc), traceback.format_exc()))


def _warm() -> None:
    """Import what builds and runs need, so that timeouts measure work, not TVM's import (seconds)."""
    import tvm  # noqa: F401

    from . import templates  # noqa: F401


def _build_in_worker(task, config, target_json: str, out_path: str) -> tuple[str, float, list]:
    """Schedule, compile and export one config; returns (library path, seconds spent, packings).

    A weight-packing copy (``pack = prepack``) is stripped before the build: in the model it runs once at
    build time, so the timed kernel takes the packed weight; the packings say how to pack the inputs.
    """
    t0 = time.perf_counter()
    import tvm

    from . import prepack, templates
    from .task import build_func

    target = tvm.target.Target(target_json)
    func, packings = prepack.strip(templates.apply(task, config, target))
    lib = build_func(func, target)
    lib.export_library(out_path)
    return out_path, time.perf_counter() - t0, packings


_RUN_CACHE: dict[str, Any] = {}
_PACKED: dict[tuple, list] = {}  # (task key, packings) -> inputs with packed weights, the last one used


def _session(rpc: str | None, session_timeout: int):
    from tvm import rpc as tvm_rpc

    if rpc is None:
        return tvm_rpc.LocalSession()
    parts = rpc.split(":")
    if len(parts) == 2:  # host:port of an RPC server
        return tvm_rpc.connect(parts[0], int(parts[1]), session_timeout=session_timeout)
    host, port, key = parts  # host:port:key of a tracker (needs the tornado package)
    tracker = tvm_rpc.connect_tracker(host, int(port))
    return tracker.request(key, priority=1, session_timeout=session_timeout)


def _prepare_in_worker(task) -> None:
    """Inputs and reference output of ``task``, cached for the runs that follow (the naive reference build
    and run can take seconds on big shapes: that must not count against a config's run timeout)."""
    if task.key not in _RUN_CACHE:
        _RUN_CACHE.clear()  # one task at a time: keep memory flat
        inputs = task.make_inputs(seed=0)
        _RUN_CACHE[task.key] = (inputs, task.reference(inputs))


def timing_plan(probe_s: float, number: int, repeat: int, cache_flush: bool) -> tuple[int, int]:
    """(calls per timing, timings) for a kernel whose one call took ``probe_s``: as asked, or fewer calls
    when they would take over ``TIMING_BUDGET_S``, but never fewer than one call per timing and ``repeat``
    timings.  Cold timings are one call each, ``COLD_REPEAT`` of them."""
    affordable = int(TIMING_BUDGET_S / max(probe_s, 1e-9))
    if cache_flush:
        return 1, max(repeat, min(max(repeat, COLD_REPEAT), affordable))
    return max(1, min(number, affordable // max(repeat, 1))), repeat


def _run_in_worker(task, lib_path: str, device: str, number: int, repeat: int, check_above: float | None,
                   rpc: str | None, session_timeout: int, min_repeat_ms: int = 0,
                   cache_flush: bool = False, packings: tuple = ()) -> tuple[float, str | None]:
    """(median latency, error or None).  Checks the output when the config's GFLOPS beat ``check_above``."""
    _prepare_in_worker(task)
    inputs, ref = _RUN_CACHE[task.key]
    if packings:
        from .prepack import pack_inputs

        pkey = (task.key, tuple(packings))
        if pkey not in _PACKED:
            _PACKED.clear()
            _PACKED[pkey] = pack_inputs(inputs, packings)
        inputs = _PACKED[pkey]
    sess = _session(rpc, session_timeout)
    sess.upload(lib_path)
    with quiet_native_stderr():  # the RPC layer logs every load_module on fd 2
        lib = sess.load_module(os.path.basename(lib_path))
    dev = sess.device(device, 0)
    import tvm

    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    outs = [tvm.runtime.empty(o.shape, o.dtype, dev) for o in task.outputs]
    # One probe call first: a slow kernel (G-BFS starts from untiled loops, ~0.5 s a call at 128x768x3072)
    # gets fewer calls, so timing a config costs at most ~TIMING_BUDGET_S; it cannot be a contender anyway.
    probe = float(lib.time_evaluator("main", dev, number=1, repeat=1)(*args, *outs).mean)
    number, repeat = timing_plan(probe, number, repeat, cache_flush)
    if cache_flush:  # one call per timing, each after flushing all but the first argument (see module doc)
        timer = lib.time_evaluator("main", dev, number=1, repeat=repeat, f_preproc="cache_flush_cpu_non_first_arg")
    else:
        timer = lib.time_evaluator("main", dev, number=number, repeat=repeat, min_repeat_ms=min_repeat_ms)
    latency = float(np.median(timer(*args, *outs).results))
    gflops = task.flops / latency / 1e9
    if check_above is not None and gflops <= check_above:
        return latency, None
    for o in outs:
        o.copyfrom(np.zeros(o.shape, o.dtype))
    lib["main"](*args, *outs)
    err = max(float(np.max(np.abs(o.numpy() - r))) if r.size else 0.0 for o, r in zip(outs, ref))
    scale = max(1.0, max(float(np.max(np.abs(r))) if r.size else 0.0 for r in ref))
    if not np.isfinite(err) or err > REL_TOL * scale:
        return latency, f"wrong result: max err {err:.3g} (reference max {scale:.3g})"
    return latency, None


class _Worker:
    """One spawned process serving calls; replaced when a call times out or the process dies."""

    WARM_TIMEOUT = 300.0

    def __init__(self, ctx, env: dict[str, str]):
        self._ctx, self._env = ctx, env
        self.generation = -1  # bumped per process start: state cached in the process dies with it
        self._start()

    def _start(self) -> None:
        self.generation += 1
        self.conn, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=_serve, args=(child, self._env), daemon=True)
        self.proc.start()
        child.close()
        self.conn.send(("warm", ()))  # imports run while the parent does other work
        self._warming = True

    def _await_warm(self) -> None:
        if self.conn.poll(self.WARM_TIMEOUT):
            self.conn.recv()

    def call(self, name: str, args: tuple, timeout: float) -> tuple[str, Any]:
        """("ok", value) | ("invalid", msg) | ("error", msg) | ("timeout", None) | ("crash", msg)."""
        try:
            if self._warming:
                self._warming = False
                self._await_warm()
            self.conn.send((name, args))
            if not self.conn.poll(timeout):
                self.restart()
                return "timeout", None
            reply = self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            code = self.proc.exitcode
            self.restart()
            return "crash", f"worker died (exit code {code})"
        if reply[0]:
            return "ok", reply[1]
        return ("invalid" if reply[1] else "error"), reply[2]

    def restart(self) -> None:
        self.kill()
        self._start()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class _Pool:
    """Fixed set of workers; ``map`` runs calls on free workers from parent threads."""

    def __init__(self, n: int, env: dict[str, str]):
        ctx = mp.get_context("spawn")
        self.workers = [_Worker(ctx, env) for _ in range(n)]
        self._free: queue.Queue[_Worker] = queue.Queue()
        for w in self.workers:
            self._free.put(w)
        self._threads = ThreadPoolExecutor(max_workers=n)

    def call(self, name: str, args: tuple, timeout: float) -> tuple[str, Any]:
        w = self._free.get()
        try:
            return w.call(name, args, timeout)
        finally:
            self._free.put(w)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        return list(self._threads.map(fn, items))

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for w in self.workers:
            w.kill()


# ----------------------------------------------------------------------------------------------- measurer

class Measurer:
    """Builds (parallel, in worker processes) and times (sequentially, in one runner process) configs."""

    PREPARE_TIMEOUT = 900.0  # naive reference of the largest benchmark operators, on a loaded machine

    def __init__(self, target, number: int = 10, repeat: int = 3, build_timeout: float = 60.0,
                 run_timeout: float = 30.0, workers: int | None = None, rpc: str | None = None,
                 session_timeout: int = 60, min_repeat_ms: int = 0, cache_flush: bool = False):
        import tvm

        self.target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
        self.device = kind_of(self.target).device  # a UserError for kinds we cannot measure on
        # The flush is a CPU instruction (clflush): a GPU kernel's operands live in device memory.
        self.cache_flush = cache_flush and self.device == "cpu"
        self.number, self.repeat, self.min_repeat_ms = number, repeat, min_repeat_ms
        self.build_timeout, self.run_timeout = build_timeout, run_timeout
        if rpc is not None and len(rpc.split(":")) not in (2, 3):
            from graphopt.errors import UserError

            raise UserError(f"bad --rpc {rpc!r}: use HOST:PORT (RPC server) or HOST:PORT:KEY (tracker)")
        self.rpc, self.session_timeout = rpc, session_timeout
        cores = int(self.target.attrs["num-cores"]) if "num-cores" in self.target.attrs else (os.cpu_count() or 1)
        env = {"TVM_NUM_THREADS": str(tvm_num_threads(cores))}
        self._target_json = str(self.target)
        self._tmp = tempfile.mkdtemp(prefix="kerneltune-")
        self._builders = _Pool(workers or max(1, min(os.cpu_count() or 1, 4)), env)
        self._runner = _Pool(1, env)
        self._best: dict[str, float] = {}  # task key -> best verified GFLOPS
        self._prepared: tuple[str, int] | None = None  # (task key, runner generation) holding its reference
        self._counter = 0
        self._lock = threading.Lock()

    @property
    def timing(self) -> str:
        """How latencies are taken (``warm`` or ``cold``): records of one kind never resume the other."""
        return "cold" if self.cache_flush else "warm"

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
            status, value = self._builders.call("build", (task, config, self._target_json, path),
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
            status, value = self._runner.call("prepare", (task,), self.PREPARE_TIMEOUT)
            if status != "ok":
                return MeasureResult(config, None, 0.0, f"run failed: reference: {value or status}", build_s, 0.0)
            self._prepared = (task.key, runner.generation)
        t0 = time.perf_counter()
        status, value = self._runner.call(
            "run", (task, lib_path, self.device, self.number, self.repeat, best, self.rpc, self.session_timeout,
                    self.min_repeat_ms, self.cache_flush, packings),
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


def numpy_gflops(m: int, k: int, n: int, min_seconds: float = 1.0, repeat: int = 5, seed: int = 0) -> float:
    """GFLOP/s of numpy's matmul (OpenBLAS) on (m,k)x(k,n) fp32, measured in a fresh process.

    Why a fresh process: once TVM's runtime has run a parallel kernel its worker threads keep spinning for
    a while, and OpenBLAS sharing the same two cores measured 135 instead of 190 GFLOP/s here; the baseline
    must not be handicapped by the tuner it is compared with.
    """
    code = (f"from kerneltune.measure import _numpy_gflops_here as f; "
            f"print(f({m}, {k}, {n}, {min_seconds}, {repeat}, {seed}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _numpy_gflops_here(m: int, k: int, n: int, min_seconds: float, repeat: int, seed: int) -> float:
    """Median of ``repeat`` timed batches of numpy matmul in this process."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    out = np.empty((m, n), np.float32)
    np.matmul(a, b, out=out)
    t0 = time.perf_counter()
    calls = 0
    while time.perf_counter() - t0 < min_seconds / repeat:
        np.matmul(a, b, out=out)
        calls += 1
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            np.matmul(a, b, out=out)
        times.append((time.perf_counter() - t0) / calls)
    return 2.0 * m * k * n / float(np.median(times)) / 1e9
