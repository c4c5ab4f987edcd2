"""Run a command held to AVX2 on a CPU with AVX-512 / VNNI / AMX: the peers of an ``-mcpu=x86-64-v3`` build.

onnxruntime (MLAS) and OpenVINO (oneDNN) choose their kernels from CPUID when they start, so on a VNNI
machine an AVX2 build of ours would be timed against their VNNI and AMX kernels, and no flag of theirs holds
them back.  This launcher loads ``isa_mask.c`` (compiled here with ``cc``) into the command with
``LD_PRELOAD``: it turns on Linux's CPUID faulting and answers CPUID with the machine's answer less every
feature above AVX2, so every library in the process sees an AVX2 CPU with this one's cores, caches and
memory.  Needs Linux's ``cpuid_fault`` (in /proc/cpuinfo's flags; most KVM guests have it) and a C compiler.

    python bench/isa_mask.py python bench/int8.py --mcpu x86-64-v3 --models tv:resnet --out bench/results/int8_avx2

Our builds in such a process must name their ISA (``--mcpu x86-64-v3``): LLVM names the host CPU from its
family and model, which the mask leaves as they are.  :func:`held_isa` tells a bench script (and its JSON)
that it runs held.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltune.targets.host import cpu_flags  # noqa: E402 - TVM-free: the launcher starts fast

SOURCE = Path(__file__).with_name("isa_mask.c")


def library(cache: Path | None = None) -> Path:
    """``isa_mask.c`` compiled to a shared library (kept beside the user's cache, rebuilt when the source
    changes); raises RuntimeError when it cannot be (no compiler, no CPUID faulting)."""
    if "cpuid_fault" not in cpu_flags():
        raise RuntimeError("this kernel or VM has no CPUID faulting (no cpuid_fault in /proc/cpuinfo): the "
                           "peers cannot be held to AVX2 here")
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build bench/isa_mask.c")
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "optimize-model"
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"isa_mask-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / out.name
            run = subprocess.run([cc, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(built), "-ldl"],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"cc could not build bench/isa_mask.c: {run.stderr.strip()[:200]}")
            os.replace(built, out)
    return out


def held_isa() -> str | None:
    """``"avx2"`` when this process runs under the mask (the CPU's flags have features that CPUID, as numpy
    read it at import, does not), else None."""
    from numpy._core._multiarray_umath import __cpu_features__ as seen

    flags = cpu_flags()
    has = "avx512f" in flags or "avx512_vnni" in flags or "avx_vnni" in flags
    return "avx2" if has and not (seen.get("AVX512F") or seen.get("AVX512VNNI")) else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n")[0] + "\n\nusage: python bench/isa_mask.py COMMAND [ARGS...]")
        return 0 if argv else 2
    try:
        lib = library()
    except RuntimeError as exc:
        print(f"isa_mask: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(x for x in (str(lib), env.get("LD_PRELOAD", "")) if x)
    return subprocess.call(argv, env=env)


if __name__ == "__main__":
    sys.exit(main())
