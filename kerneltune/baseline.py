"""numpy's (OpenBLAS) matmul on a task's shape: the baseline ``tune-kernels`` and bench/tuners.py report
next to the tuned kernel, timed in the same run."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np


def numpy_gflops(m: int, k: int, n: int, min_seconds: float = 1.0, repeat: int = 5, seed: int = 0) -> float:
    """GFLOP/s of numpy's matmul (OpenBLAS) on (m,k)x(k,n) fp32, measured in a fresh process.

    Why a fresh process: once TVM's runtime has run a parallel kernel its worker threads keep spinning for
    a while, and OpenBLAS sharing the same two cores measured 135 instead of 190 GFLOP/s here; the baseline
    must not be handicapped by the tuner it is compared with.
    """
    code = (f"from kerneltune.baseline import numpy_gflops_here as f; "
            f"print(f({m}, {k}, {n}, {min_seconds}, {repeat}, {seed}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


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
