"""numpy's (OpenBLAS) matmul on a task's shape: the baseline ``tune-kernels`` and bench/tuners.py report
next to the tuned kernel, timed in the same run, before any tuner worker starts.

Fair only under the tuned kernel's conditions: the same thread count, and the cores to itself.  OpenBLAS
otherwise starts one thread per core whatever ``--threads`` says, and measured 0.09-6 GFLOP/s on a loaded
2-core machine beside the tuner's worker processes (a "748x speed-up").  So it runs in a fresh process whose
environment limits OpenBLAS (and an OpenMP or MKL build of numpy) to the kernel's threads - read when the
BLAS library loads, so it must be set before that process imports numpy; threadpoolctl would do it in
process but is no dependency - and the callers measure it before they start the measurer.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

# Every BLAS build numpy may load reads one of these at start-up (OpenBLAS, OpenMP builds, MKL, BLIS).
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")


@dataclass(frozen=True)
class Baseline:
    gflops: float
    threads: int  # the BLAS threads asked for
    process_threads: int  # OS threads of the measuring process after timing (Linux; 0 where unknown)


def blas_environment(threads: int) -> dict[str, str]:
    """This process's environment with every BLAS limited to ``threads`` threads."""
    return {**os.environ, **{name: str(threads) for name in BLAS_THREAD_VARIABLES}}


def numpy_baseline(m: int, k: int, n: int, threads: int, min_seconds: float = 1.0, repeat: int = 5,
                   seed: int = 0) -> Baseline:
    """GFLOP/s of numpy's matmul on (m,k)x(k,n) fp32 with ``threads`` BLAS threads, measured in a fresh
    process (see the module docstring).

    Why a fresh process besides the thread limit: once TVM's runtime has run a parallel kernel its worker
    threads keep spinning for a while, and OpenBLAS sharing the same two cores measured 135 instead of 190
    GFLOP/s here; the baseline must not be handicapped by the tuner it is compared with.
    """
    code = (f"from kerneltune.baseline import numpy_gflops_here as f, process_threads as t; "
            f"print(f({m}, {k}, {n}, {min_seconds}, {repeat}, {seed}), t())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=blas_environment(threads))
    gflops, seen = out.stdout.strip().splitlines()[-1].split()
    return Baseline(float(gflops), threads, int(seen))


def process_threads() -> int:
    """OS threads of this process (Linux /proc; 0 elsewhere): what the BLAS library really started."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def numpy_gflops_here(m: int, k: int, n: int, min_seconds: float, repeat: int, seed: int) -> float:
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
