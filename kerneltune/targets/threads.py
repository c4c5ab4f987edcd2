"""The thread count: checked once (``--threads``), then the size of TVM's thread pool, how it behaves on a
shared core (environment variables TVM reads once, when its pool starts), and how work gets a working pool in
a child forked from a process that used it (:func:`fork_safe`)."""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ParamSpec, TypeVar

from .host import default_threads

P = ParamSpec("P")
R = TypeVar("R")


# How TVM's pool behaves on a core it shares (read once, when the pool starts; a value the user set wins).
# TVM pins each worker to one core and spins ~300k iterations at every barrier before it sleeps.  On a
# server whose cores are all busy, a pinned worker waits for its core's time slice while the others spin at
# the barrier: bert_tiny's p99 was 264 ms against onnxruntime's 6.2 ms with two busy processes on two cores.
# Unpinned workers can go wherever the scheduler has room (onnxruntime does not pin either); a short spin
# gives a shared core back sooner.  bench/contention.py (Intel Xeon, 2 cores): this keeps the quiet p50
# (bert_tiny 0.82 ms, MobileNet-v2 3.49) but leaves the contended tail erratic (p99 2-190 ms); no spin at all
# holds the tail near onnxruntime's (bert_tiny 2.0/8.7 ms with 1/2 busy processes) at twice the quiet p50.
# The cause is the pool's static fork-join: each parallel loop waits for its slowest, descheduled worker.
# So a shipped CPU model.so carries its own launcher (pipeline/cpu_pool.py) and runs on it once loaded by
# optimize-model's loader; these settings still govern TVM's pool, which builds, tuning and timings in this
# process use, as does a model.so loaded by plain TVM.
POOL_ENVIRONMENT = {"TVM_BIND_THREADS": "0", "TVM_THREAD_POOL_SPIN_COUNT": "2000"}


def set_num_threads(threads: int) -> None:
    """Size TVM's thread pool: it reads ``TVM_NUM_THREADS`` once, when it first starts, and uses one thread
    on this VM otherwise.  Call before the first TVM kernel runs (the one place that sets it).  Also sets
    :data:`POOL_ENVIRONMENT`, unless the user did."""
    os.environ["TVM_NUM_THREADS"] = str(int(threads))
    for key, value in POOL_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def use_threads(threads: int | None, option: str = "--threads") -> int:
    """Check a thread count (None: the cores this process may use) and size TVM's pool with it; returns it."""
    from graphopt.limits import check_threads

    n = check_threads(threads, option) or default_threads()
    set_num_threads(n)
    return n


def tvm_num_threads(default: int) -> int:
    """The thread count TVM's pool runs with in this process (and in workers started from it)."""
    value = os.environ.get("TVM_NUM_THREADS", "")
    return int(value) if value.isdigit() else default


# ---- fork --------------------------------------------------------------------------------------------------
# TVM's CPU pool is thread-local (one pool per calling thread, its workers started at that thread's first
# parallel loop).  fork() copies only the calling thread: the child inherits that thread's pool object, whose
# workers do not exist there, and its first parallel loop waits on them forever (multiprocessing's default
# start method on Linux is fork, so a worker pool of a server that built or ran a model meets this).  Any other
# thread of the child starts a pool of its own, so the work of the thread that forked runs on a thread made in
# the child (measured on bert_tiny: a forked child's build hangs on its main thread and completes on a new one).
_forked_thread: int | None = None  # the ident of the thread fork() copied, in a forked child; else None
_fresh: ThreadPoolExecutor | None = None  # the child's thread with a pool of its own (made when first needed)
_fresh_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _forked_thread, _fresh, _fresh_lock
    _forked_thread = threading.get_ident()
    _fresh, _fresh_lock = None, threading.Lock()  # the parent's executor thread was not copied


os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_safe(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` runs where TVM's pool works: on the calling thread, except in a forked child on the thread fork()
    copied, where it runs on one long-lived thread made in the child (the result or exception handed back)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if _forked_thread is None or threading.get_ident() != _forked_thread:
            return fn(*args, **kwargs)
        return _fresh_thread().submit(fn, *args, **kwargs).result()

    return wrapper


def _fresh_thread() -> ThreadPoolExecutor:
    global _fresh
    with _fresh_lock:
        if _fresh is None:
            _fresh = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optimize-model-after-fork")
        return _fresh
