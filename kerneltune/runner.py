"""The runner: built kernels loaded on their device, timed, and checked against the task's reference.

One small interface, as MetaSchedule has it: ``Runner.run(list[RunnerInput]) -> list[RunnerResult]`` (same
order), plus ``close()``.  :class:`SessionRunner` is the default, for local and remote devices alike: an RPC
session (``tvm.rpc.LocalSession`` locally; a tracker session with ``rpc="host:port:key"``; a server reached
directly with ``rpc="host:port"``, :class:`RunConfig`'s ``rpc``) uploads the built library, loads it and runs
``time_evaluator``.  The reference output is always computed on the host.  It runs in one worker process
(:mod:`kerneltune.pool`), one config at a time: on a 2-core machine a concurrent compile would corrupt the
timings; a run past its timeout kills and replaces that process.  A test or a remote setup hands its own
runner to :class:`kerneltune.measure.Measurer`.

``cache_flush`` (CPU targets) flushes every argument but the first from the caches before each call and times
calls one by one: inside a model a kernel's weights come from DRAM while its activation input was just
written by the previous kernel (see :mod:`kerneltune.measure`).

:func:`warm`, :func:`prepare` and :func:`run` run inside the runner worker (called by name).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import tvm
from tvm import rpc as tvm_rpc

from graphopt.errors import UserError
from kerneltune.check import output_error
from kerneltune.native_log import quiet_native_stderr
from kerneltune.pool import WorkerPool, short_error
from kerneltune.prepack import pack_inputs

# Timed calls with cold caches (one call per timing: the flush runs before each timing, not each call).
COLD_REPEAT = 15
# Seconds of timed calls a config gets at most (fewer calls for slow kernels; never fewer than one per
# repeat): without it an untiled kernel of a big operator costs 30 calls x 0.5 s.
TIMING_BUDGET_S = 1.0


@dataclass(frozen=True)
class RunConfig:
    """Where and how configs are timed (the same for every config of a measurer)."""

    device: str  # TVM device type, from the target registry
    number: int = 10  # calls per timing (warm caches)
    repeat: int = 3  # timings; the latency is their median
    min_repeat_ms: int = 0
    cache_flush: bool = False
    rpc: str | None = None  # None: this machine
    session_timeout: int = 60


@dataclass(frozen=True)
class RunnerInput:
    """One built config to time: its library, the packings its inputs need, and ``check_above``: the output
    is checked against the reference when the config's GFLOPS beat it (None: always)."""

    task: object  # kerneltune.task.Task
    artifact_path: str
    packings: tuple = ()
    check_above: float | None = None


@dataclass(frozen=True)
class RunnerResult:
    """The median latency (None when no timing came back) and ``error``: None, ``"run timeout"``,
    ``"run failed: ..."`` or ``"wrong result: max err ..."``; ``run_s``: wall seconds of the timed run."""

    latency_s: float | None
    error: str | None
    run_s: float


class Runner(Protocol):
    def run(self, inputs: Sequence[RunnerInput]) -> list[RunnerResult]: ...

    def close(self) -> None: ...


class SessionRunner:
    """Times configs one after another in one worker process, each in an RPC session of ``config.rpc``
    (this machine's ``LocalSession`` when None).  The task's inputs and reference are prepared in the worker
    once per task (and again after the worker was replaced), under :data:`PREPARE_TIMEOUT`, so the naive
    reference never counts against a config's ``timeout``."""

    PREPARE_TIMEOUT = 900.0  # naive reference of the largest benchmark operators, on a loaded machine

    def __init__(self, config: RunConfig, env: dict[str, str], timeout: float = 30.0):
        self.config = config
        self.timeout = timeout  # seconds one config's run may take
        self.pool = WorkerPool(1, env, "kerneltune.runner:warm")
        self._prepared: tuple[str, int] | None = None  # (task key, worker generation) holding its reference

    def _run_one(self, item: RunnerInput) -> RunnerResult:
        task = item.task
        worker = self.pool.workers[0]
        if self._prepared != (task.key, worker.generation):
            status, value = self.pool.call("kerneltune.runner:prepare", (task,), self.PREPARE_TIMEOUT)
            if status != "ok":
                return RunnerResult(None, f"run failed: reference: {value or status}", 0.0)
            self._prepared = (task.key, worker.generation)
        t0 = time.perf_counter()
        status, value = self.pool.call("kerneltune.runner:run", (task, item.artifact_path, self.config,
                                                                 item.check_above, item.packings), self.timeout)
        run_s = time.perf_counter() - t0
        if status == "timeout":
            return RunnerResult(None, "run timeout", run_s)
        if status != "ok":
            return RunnerResult(None, f"run failed: {value}", run_s)
        latency, error = value
        return RunnerResult(latency, error, run_s)

    def run(self, inputs: Sequence[RunnerInput]) -> list[RunnerResult]:
        return [self._run_one(item) for item in inputs]

    def close(self) -> None:
        self.pool.close()


def check_rpc(rpc: str | None) -> None:
    """A one-line error for an ``--rpc`` that is neither HOST:PORT nor HOST:PORT:KEY."""
    if rpc is not None and len(rpc.split(":")) not in (2, 3):
        raise UserError(f"bad --rpc {rpc!r}: use HOST:PORT (RPC server) or HOST:PORT:KEY (tracker)")


CONNECT_TIMEOUT_S = 10.0  # for the up-front reachability check of --rpc


def check_device(rpc: str | None, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """A one-line UserError now when the ``--rpc`` device cannot be reached (tracker or server down, wrong
    port, no device registered under the key), instead of a run whose every trial fails after minutes.
    Runs before any work; a device that is busy (all sessions taken) is not an error."""
    if rpc is None:
        return
    check_rpc(rpc)
    parts = rpc.split(":")
    host, port, what = parts[0], parts[1], "tracker" if len(parts) == 3 else "server"
    if not port.isdigit():
        raise UserError(f"bad --rpc {rpc!r}: the port {port!r} is not a number")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise UserError(f"cannot reach the RPC {what} at {host}:{port} ({exc.strerror or exc}); start it or fix "
                        "--rpc HOST:PORT:KEY") from None
    if what == "tracker":
        keys = _registered_keys(host, int(port), parts[2], timeout)
        if parts[2] not in keys:
            raise UserError(f"the RPC tracker at {host}:{port} has no device registered under key {parts[2]!r} "
                            f"(registered: {', '.join(keys) or 'none'}); start an RPC server with --key "
                            f"{parts[2]} or fix --rpc")
    elif _within(timeout, lambda: open_session(rpc, int(timeout)) is not None) is None:
        raise UserError(f"the RPC server at {host}:{port} did not open a session within {timeout:.0f} s; check "
                        "--rpc")


REREGISTER_S = 3.0  # a TVM RPC server re-registers with its tracker now and then: absent this long is absent


def _registered_keys(host: str, port: int, key: str, timeout: float) -> list[str]:
    """The device keys a tracker has servers registered under.  A server drops its tracker connection and
    registers again from time to time (TVM's ``rpc_server`` does when its match key went unclaimed), so a key
    missing from one summary is looked for again for :data:`REREGISTER_S` before it counts as absent."""
    deadline = time.monotonic() + REREGISTER_S
    while True:
        summary = _within(timeout, lambda: tvm_rpc.connect_tracker(host, port).summary())
        if summary is None:
            raise UserError(f"the RPC tracker at {host}:{port} did not answer within {timeout:.0f} s; check --rpc")
        keys = sorted({str(s.get("key", "")).split(":", 1)[-1] for s in summary.get("server_info", [])})
        if key in keys or time.monotonic() >= deadline:
            return keys
        time.sleep(0.25)


def _within(timeout: float, fn):
    """``fn()`` in a daemon thread; its value, or None when it raised or did not return within ``timeout``."""
    out: list = []

    def call():
        try:
            out.append(fn())
        except Exception:  # noqa: BLE001 - the caller turns "no answer" into one line
            pass

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else None


def open_session(rpc: str | None, session_timeout: int):
    """The session configs run in: local, an RPC server, or a device handed out by a tracker."""
    if rpc is None:
        return tvm_rpc.LocalSession()
    parts = rpc.split(":")
    if len(parts) == 2:  # host:port of an RPC server
        return tvm_rpc.connect(parts[0], int(parts[1]), session_timeout=session_timeout)
    host, port, key = parts  # host:port:key of a tracker (needs the tornado package)
    tracker = tvm_rpc.connect_tracker(host, int(port))
    return tracker.request(key, priority=1, session_timeout=session_timeout)


# --- in the runner worker ---------------------------------------------------------------------------------

_RUN_CACHE: dict[str, Any] = {}
_PACKED: dict[tuple, list] = {}  # (task key, packings) -> inputs with packed weights, the last one used


def prepare(task) -> None:
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


def run(task, lib_path: str, config: RunConfig, check_above: float | None,
        packings: tuple = ()) -> tuple[float, str | None]:
    """(median latency, error or None).  Checks the output when the config's GFLOPS beat ``check_above``."""
    prepare(task)
    inputs, ref = _RUN_CACHE[task.key]
    if packings:
        pkey = (task.key, tuple(packings))
        if pkey not in _PACKED:
            _PACKED.clear()
            _PACKED[pkey] = pack_inputs(inputs, packings)
        inputs = _PACKED[pkey]
    try:  # a failure here is the device's or the connection's, never the config's (kerneltune.failures)
        sess = open_session(config.rpc, config.session_timeout)
        sess.upload(lib_path)
        with quiet_native_stderr():  # the RPC layer logs every load_module on fd 2
            lib = sess.load_module(os.path.basename(lib_path))
        dev = sess.device(config.device, 0)
    except Exception as exc:  # noqa: BLE001 - reported as an environmental failure of this trial
        return None, f"session failed: {short_error(exc)}"
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    outs = [tvm.runtime.empty(o.shape, o.dtype, dev) for o in task.outputs]
    # One probe call first: a slow kernel (G-BFS starts from untiled loops, ~0.5 s a call at 128x768x3072)
    # gets fewer calls, so timing a config costs at most ~TIMING_BUDGET_S; it cannot be a contender anyway.
    probe = float(lib.time_evaluator("main", dev, number=1, repeat=1)(*args, *outs).mean)
    number, repeat = timing_plan(probe, config.number, config.repeat, config.cache_flush)
    if config.cache_flush:  # one call per timing, each after flushing all but the first argument
        timer = lib.time_evaluator("main", dev, number=1, repeat=repeat, f_preproc="cache_flush_cpu_non_first_arg")
    else:
        timer = lib.time_evaluator("main", dev, number=number, repeat=repeat, min_repeat_ms=config.min_repeat_ms)
    latency = float(np.median(timer(*args, *outs).results))
    gflops = task.flops / latency / 1e9
    if check_above is not None and gflops <= check_above:
        return latency, None
    for o in outs:
        o.copyfrom(np.zeros(o.shape, o.dtype))
    lib["main"](*args, *outs)
    return latency, output_error([o.numpy() for o in outs], ref)


def warm() -> None:
    """Run at worker start: importing this module (TVM, its RPC layer) is the slow part, done before any
    timeout counts."""
