"""This CPU's peak fp32 FMA throughput, measured, so tuned kernels can be judged against the hardware.

Speedups over numpy say little on their own: how far a kernel can beat OpenBLAS depends on how close
OpenBLAS already is to the machine's peak (on a Zen 5 it reached ~100 of ~620 GFLOP/s at 128x768x768; on a
Zen 4 with 512-bit FMAs split in two it reaches ~185 of ~225).  The peak is measured, not looked up: a C loop
of independent 512-bit (or 256-bit) FMA chains per thread, compiled for this CPU with the system C compiler
and OpenMP, best of 5 runs.

    python bench/peak.py [--threads N]      # prints {"peak_gflops": ..., "threads": N, "isa": ...}
    python bench/peak.py --int8             # the u8 x s8 dot-product peak: {"peak_gops": ..., "isa": ...}

The int8 peak is the same loop of ``vpdpbusd`` (AVX-512 VNNI, 64 multiply-adds = 128 ops per instruction;
AVX-VNNI's 256-bit form where only that exists): what int8 kernels are judged against.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
#if defined(__AVX512F__)
typedef __m512 vec; enum { LANES = 16 };
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define SUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vec; enum { LANES = 8 };
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
static float SUM(__m256 v) { float t[8]; _mm256_storeu_ps(t, v); return t[0] + t[7]; }
#endif
enum { CHAINS = 12 };   /* > FMA latency x pipes: the loop is throughput-bound, not latency-bound */
int main(void) {
  double best = 0;
  for (int rep = 0; rep < 5; rep++) {
    const long iters = 20000000;
    float sink = 0;
    double t0 = omp_get_wtime();
    #pragma omp parallel reduction(+:sink)
    {
      vec a[CHAINS], b = SET1(1.0000001f), c = SET1(1e-7f);
      for (int i = 0; i < CHAINS; i++) a[i] = SET1((float)i);
      for (long it = 0; it < iters; it++)
        for (int i = 0; i < CHAINS; i++) a[i] = FMA(a[i], b, c);
      for (int i = 0; i < CHAINS; i++) sink += SUM(a[i]);
    }
    double t = omp_get_wtime() - t0;
    double g = (double)iters * CHAINS * LANES * 2 * omp_get_max_threads() / t / 1e9;
    if (g > best) best = g;
    if (sink == 1.25f) printf(" ");   /* keep the chains alive */
  }
  printf("%.1f %d\n", best, LANES * 32);
  return 0;
}
"""


_VNNI_SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
#if defined(__AVX512VNNI__)
typedef __m512i vec; enum { BYTES = 64 };
#define SET1 _mm512_set1_epi32
#define DOT _mm512_dpbusd_epi32
#define LOW(v) _mm_cvtsi128_si32(_mm512_castsi512_si128(v))
#elif defined(__AVXVNNI__)
typedef __m256i vec; enum { BYTES = 32 };
#define SET1 _mm256_set1_epi32
#define DOT _mm256_dpbusd_avx_epi32
#define LOW(v) _mm_cvtsi128_si32(_mm256_castsi256_si128(v))
#else
#error "no VNNI"
#endif
enum { CHAINS = 12 };
int main(void) {
  double best = 0;
  for (int rep = 0; rep < 5; rep++) {
    const long iters = 20000000;
    int sink = 0;
    double t0 = omp_get_wtime();
    #pragma omp parallel reduction(+:sink)
    {
      vec a[CHAINS], b = SET1(0x01010101), c = SET1(0x01020304);
      for (int i = 0; i < CHAINS; i++) a[i] = SET1(i);
      for (long it = 0; it < iters; it++)
        for (int i = 0; i < CHAINS; i++) a[i] = DOT(a[i], b, c);
      for (int i = 0; i < CHAINS; i++) sink += LOW(a[i]);
    }
    double t = omp_get_wtime() - t0;
    double g = (double)iters * CHAINS * BYTES * 2 * omp_get_max_threads() / t / 1e9;
    if (g > best) best = g;
    if (sink == 12345) printf(" ");
  }
  printf("%.1f %d\n", best, BYTES * 8);
  return 0;
}
"""


def _run_c(source: str, threads: int) -> list[str] | None:
    """``source`` compiled for this CPU with OpenMP and run: its output's words (None without a compiler)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(source)
        built = subprocess.run([cc, "-O3", "-march=native", "-fopenmp", str(src), "-o", str(exe)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return None
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        return out.stdout.split() if out.returncode == 0 else None


def fma_peak_gflops(threads: int) -> dict | None:
    """``{"peak_gflops", "threads", "isa"}`` measured here, or None without a C compiler with OpenMP."""
    words = _run_c(_SOURCE, threads)
    if words is None:
        return None
    gflops, bits = words
    return {"peak_gflops": float(gflops), "threads": threads, "isa": f"{bits}-bit FMA"}


def vnni_peak_gops(threads: int) -> dict | None:
    """``{"peak_gops", "threads", "isa"}``: u8 x s8 multiply-adds (2 ops each) per second with ``vpdpbusd``,
    or None without a compiler or a VNNI CPU."""
    words = _run_c(_VNNI_SOURCE, threads)
    if words is None:
        return None
    gops, bits = words
    return {"peak_gops": float(gops), "threads": threads, "isa": f"{bits}-bit vpdpbusd"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--int8", action="store_true", help="the u8 x s8 dot-product (VNNI) peak instead")
    args = p.parse_args(argv)
    peak = vnni_peak_gops(args.threads) if args.int8 else fma_peak_gflops(args.threads)
    if peak is None:
        print("peak: no C compiler with OpenMP found (set CC)" + (", or no VNNI on this CPU" if args.int8 else ""),
              file=sys.stderr)
        return 2
    print(json.dumps(peak))
    return 0


if __name__ == "__main__":
    sys.exit(main())
