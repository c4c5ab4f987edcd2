"""Builds side by side, measurements alone.

A model build is mostly C++ (Relax passes, LLVM codegen) that releases the GIL, so two builds in two
threads take less time than in turn on two cores: ResNet-50 built twice, 12.9 s in turn, 6.9 s side by side
(Intel Xeon, 2 cores; identical outputs).  The graph stage builds models it then times (its end-to-end
check), so it builds them side by side (:func:`build_concurrently`).

Two things keep that safe:

* **The Python side of TVM runs one thread at a time** (:func:`serial`): TOPI's operator definitions keep
  their tag scope in a class attribute ("nested op_tag is not allowed" when two legalizations overlap), and
  the ONNX importer redirects the process's stdout.  Import, legalization, partition, scheduling and
  constant folding hold the lock; the code generation (:func:`building`) does not.
* **A measurement runs alone** (:func:`measuring`): a template's default config can calibrate a tile on this
  CPU the first time it meets a task (:func:`kerneltune.prepack.kernel_timer`), and a time taken beside a
  code generation is a figure for a busy machine, cached as this CPU's.  It waits until no thread is
  generating code, and none starts until it is done.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

from kerneltune.targets.host import default_threads

T = TypeVar("T")

_serial = threading.RLock()
_cond = threading.Condition()
_state = {"building": 0, "measuring": False, "waiting": 0}
_local = threading.local()


def serial() -> threading.RLock:
    """The lock of TVM's Python side (see the module docstring); re-entrant."""
    return _serial


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Code generation running in this thread (lock-free: starts once no measurement runs or waits)."""
    with _cond:
        _cond.wait_for(lambda: not _state["measuring"] and not _state["waiting"])
        _state["building"] += 1
    _local.building = True
    try:
        yield
    finally:
        _local.building = False
        with _cond:
            _state["building"] -= 1
            _cond.notify_all()


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """The machine to this thread alone: waits until no thread generates code, and keeps new code
    generation from starting until the measurement is done."""
    if getattr(_local, "building", False):
        raise RuntimeError("a measurement inside code generation would wait for itself")
    with _cond:
        _state["waiting"] += 1
        _cond.wait_for(lambda: _state["building"] == 0 and not _state["measuring"])
        _state["waiting"] -= 1
        _state["measuring"] = True
    try:
        yield
    finally:
        with _cond:
            _state["measuring"] = False
            _cond.notify_all()


def build_concurrently(builds: Sequence[Callable[[], T]]) -> list[T]:
    """Each of ``builds`` run side by side on the cores this process may use (each taking :func:`serial` for
    its Python side), and their results in order; the first failure is raised after all have ended.  The
    main thread's SIGINT handler is put back after: TVM's FFI swaps in its own around each call, and two
    threads' swaps interleave."""
    if len(builds) <= 1 or default_threads() == 1:
        return [b() for b in builds]

    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    try:
        with ThreadPoolExecutor(min(len(builds), default_threads())) as pool:
            futures = [pool.submit(b) for b in builds]
            return [f.result() for f in futures]
    finally:
        if main and handler is not None:
            signal.signal(signal.SIGINT, handler)


def built_in_batches(builds: Sequence[Callable[[], T]], size: int) -> Iterator[T]:
    """Each of ``builds``' results, in order: :func:`build_concurrently` ``size`` at a time, the next batch
    started only once the caller has taken the last one's results (and timed them alone), so that no more
    than ``size`` builds' inputs are held at once."""
    for start in range(0, len(builds), size):
        yield from build_concurrently(builds[start:start + size])
