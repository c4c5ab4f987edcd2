"""The thread count: checked once (``--threads``), then the size of TVM's thread pool and how it behaves on a
shared core (environment variables TVM reads once, when its pool starts)."""
from __future__ import annotations

import os

from .host import default_threads


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
