"""The parallel-for that ships inside a CPU model.so: built into the library at export, installed at load.

Why: TVM's runtime pool gives task *i* of every parallel loop to worker *i* and waits for all of them, so on
a server whose cores are shared one descheduled worker stalls each kernel for a scheduler time slice (issue
25: bert_tiny's p99 264 ms against onnxruntime's 6.2 ms with two busy processes on two cores).  onnxruntime's
pool lets the calling thread take the work a stalled worker has not started.  ``native/parallel.c`` does the
same for TVM kernels: a loop is cut into :data:`CHUNKS_PER_THREAD` chunks per thread, claimed from one atomic
counter by whoever runs.  TVM's generated code calls its launcher through the ``__TVMBackendParallelLaunch``
pointer every TVM library exports (TVM's ``c_backend_api.h``); :func:`install` points it at ours after TVM
loaded the library.  A library without the launcher (an older build) keeps TVM's pool, as does a process
with ``OPTIMIZE_MODEL_POOL=tvm`` in its environment (to compare the two: ``bench/contention.py``); unset,
empty, ``own`` or ``native`` mean the library's own launcher, and any other value is warned about once and
ignored (a typo must not pass silently, nor stop a deployed model).
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "parallel.c"
LAUNCH = "optm_parallel_launch"
CONFIG = "optm_parallel_config"
TVM_POINTER = "__TVMBackendParallelLaunch"
POOL_VARIABLE = "OPTIMIZE_MODEL_POOL"
POOLS = ("own", "native", "tvm")  # its values: the library's own launcher (the default; two names), TVM's pool

CHUNKS_PER_THREAD = 4  # bench/contention.py: enough for the caller to absorb a stalled worker's share
# How long a worker spins for the next loop before it sleeps on the futex, in microseconds.  It was 2000
# pause iterations, whose length depends on the CPU: 26 us on an Intel Xeon Emerald Rapids, whose pause
# takes 13 ns (measured), several times that where a pause takes the ~140 cycles Intel's optimization manual
# gives for Skylake server cores.  A loop that finds its worker asleep wakes it; in a VM that wake waits for
# the host to run the halted vCPU, and the caller meanwhile claims every chunk itself.  With 26 us, int8
# MobileNet-v2 (65 kernels of 10-60 us) run in short bursts after idle seconds (graphopt.timing's blocks) fell
# after a few seconds of that pattern to 4.1-4.6 ms instead of 2.0, on one core's worth of CPU; 100 and
# 200 us kept 2.0 ms throughout (same Xeon, 2 threads).  bench/contention.py kept its tails below
# onnxruntime's with 200 (docs/benchmarks.md).
SPIN_US = 200


def object_file(workdir: Path, compiler: str | None = None) -> Path | None:
    """Compile the launcher for the library's CPU with the compiler that links it (TVM's ``cc``, or the
    cross gcc); None, with a warning, where it does not compile (the library then keeps TVM's pool)."""
    from tvm.support import cc

    out = workdir / "optm_parallel.o"
    cmd = [compiler or cc.get_cc(), "-x", "c", "-std=gnu11", "-O2", "-fPIC", "-c", str(SOURCE), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["no message"])[0][:200]
        log.warning("warning: the shared-core parallel launcher did not compile (%s); model.so uses TVM's "
                    "thread pool", first)
        return None
    return out


def install(library: Path, threads: int) -> bool:
    """Point the kernels of the loaded ``library`` at its own launcher, sized to ``threads``; False when the
    library has none.  Call after ``tvm.runtime.load_module`` (which sets the pointer to TVM's pool): dlopen
    of the same file returns the same handle, so this edits the copy TVM runs."""
    if _pool(os.environ.get(POOL_VARIABLE, "").strip().lower()) == "tvm":
        return False
    lib = ctypes.CDLL(str(library))
    if not hasattr(lib, LAUNCH) or not hasattr(lib, TVM_POINTER):  # no launcher, or no kernel with a parallel loop
        return False
    getattr(lib, CONFIG)(ctypes.c_int(threads), ctypes.c_int(CHUNKS_PER_THREAD), ctypes.c_int(SPIN_US))
    pointer = ctypes.c_void_p.in_dll(lib, TVM_POINTER)
    pointer.value = ctypes.cast(getattr(lib, LAUNCH), ctypes.c_void_p).value
    return True


@lru_cache(maxsize=None)
def _pool(value: str) -> str:
    """The pool ``$OPTIMIZE_MODEL_POOL``'s (lowercased) ``value`` asks for; a value it does not know is warned
    about, once per value and process (every model load asks), and means the default, the own launcher."""
    if value and value not in POOLS:
        log.warning("warning: %s=%r is not one of %s (or unset); the model uses its own parallel launcher",
                    POOL_VARIABLE, value, ", ".join(POOLS))
        return POOLS[0]
    return value
