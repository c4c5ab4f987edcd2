"""The one target registry: target kinds, ``--target`` parsing, host detection, vector width, devices.

Everything that knows what ``llvm``, ``cuda`` or ``rocm`` means lives here (:data:`REGISTRY`); the
templates, the measurer, the compiler and every CLI ask this module instead of spelling kinds themselves.

``--target llvm|cuda[:sm_XX]|rocm[:gfxNNN]`` becomes a :class:`TargetSpec` (a TVM
:class:`~tvm.target.Target` plus whether this machine can run it).

TVM 0.27 takes targets as dicts, and a bare ``{"kind": "llvm"}`` compiles for a generic x86-64 (SSE2, one
core): the schedules' vector widths and the thread pool then fit no real machine.  So ``llvm`` gets the
host's ``mcpu`` as LLVM detects it (``znver5`` here: AVX-512) and the thread count the user runs with.

GPU targets are checked up front for what their toolchain needs, so a missing piece is one line naming
the package to install rather than an error from deep inside LLVM at the end of a long compile:

* ``cuda``: the wheel emits CUDA source compiled when the module is loaded; building works without a GPU,
  running needs a GPU and NVRTC (``cuda-bindings``) or nvcc.
* ``rocm``: the wheel's LLVM emits AMDGPU code objects, but linking them needs ``ld.lld`` and the ROCm device
  bitcode (``ocml``...): Debian packages ``lld-19`` (older lld rejects the code-object ABI version TVM's
  LLVM emits) and ``rocm-device-libs``.  The wheel's runtime cannot run
  ROCm code (built without ROCm), so running or tuning needs a ROCm-enabled TVM runtime, e.g. over RPC.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from graphopt.errors import UserError

# TVM is imported inside the functions that need it: importing it takes seconds, and the CLIs validate
# --target (check_name) before anything loads TVM, so a typo fails at once.
if TYPE_CHECKING:
    import tvm


@dataclass(frozen=True)
class TargetKind:
    """What one ``--target`` kind means to every stage."""

    name: str  # the --target spelling and TVM's target kind
    device: str  # TVM device type (tvm.device(name), an RPC session's sess.device(name))
    is_gpu: bool
    template: str  # schedule template family in kerneltune.templates ("cpu" | "gpu")
    build: Callable[[str | None, int | None], "TargetSpec"]  # (arch from --target, host threads) -> spec
    arch_example: str = ""  # for help texts: cuda:sm_XX


def kind_of(target: "tvm.target.Target | str") -> TargetKind:
    """The registry entry of a TVM target (or kind name); a UserError for kinds we do not support."""
    name = target if isinstance(target, str) else target.kind.name
    if name not in REGISTRY:
        raise UserError(f"unsupported target kind {name!r}; use one of {', '.join(KINDS)}")
    return REGISTRY[name]


DEFAULT_CUDA_ARCH = "sm_80"
DEFAULT_ROCM_ARCH = "gfx942"
ROCM_INSTALL_HINT = "apt-get install lld-19 rocm-device-libs"
# Debian's default lld (14) rejects the code-object ABI version TVM 0.27's LLVM emits ("unknown abi
# version"); lld 19 links it (checked with lld-19 19.1 on bookworm).
MIN_LLD = 19

# Where Debian and ROCm installs put the device bitcode (ocml.bc, oclc_*.bc); TVM looks under
# $ROCM_PATH/amdgcn/bitcode, so the directory two levels up is what ROCM_PATH must name.
_ROCM_BITCODE_GLOBS = (
    "/opt/rocm/amdgcn/bitcode",
    "/opt/rocm-*/amdgcn/bitcode",
    "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode",
    "/usr/lib/llvm-*/lib/clang/*/lib/amdgcn/bitcode",
    "/usr/share/amdgcn/bitcode",
)


@dataclass(frozen=True)
class TargetSpec:
    """A parsed ``--target``: the TVM target plus what this machine can do with it."""

    kind: str
    target: "tvm.target.Target"
    can_run: bool  # the local TVM runtime can execute code for this target (device present and supported)
    note: str = ""  # why it cannot run, for messages and report.json

    @property
    def is_gpu(self) -> bool:
        return REGISTRY[self.kind].is_gpu


def host_cpu() -> str:
    """The host CPU name as LLVM knows it (``znver5``, ``skylake-avx512``...), ``generic`` if unknown."""
    from tvm.target import codegen

    cpu = str(codegen.llvm_get_system_cpu())
    return cpu if cpu and codegen.llvm_is_valid_cpu(cpu, "") else "generic"


def host_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo ("" elsewhere): benchmark JSON records it, because the
    same numbers mean different things on a Zen 4 and a Zen 5 (their FMA peaks differ ~2x)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_threads() -> int:
    """Cores this process may use (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def llvm_target(threads: int | None = None) -> "tvm.target.Target":
    """LLVM target for this machine's CPU: ``mcpu`` from LLVM's host detection (without it LLVM generates
    baseline x86-64 code: no AVX, no FMA, 4x fewer FLOPs per instruction) and ``threads`` cores."""
    import tvm

    return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "num-cores": int(threads or default_threads())})


def num_cores(target: "tvm.target.Target") -> int:
    """The target's ``num-cores`` (1 when unset)."""
    return int(target.attrs["num-cores"]) if "num-cores" in target.attrs else 1


def vector_bits(target: "tvm.target.Target") -> int:
    """Width of the target's widest vector register: 512 with AVX-512, 256 with AVX2, else 128.  Follows the
    target's ``mcpu``/``mattr``: a bare ``llvm`` target emits SSE2 code only."""
    from tvm.target import codegen

    if codegen.target_has_features("avx512f", target):
        return 512
    if codegen.target_has_features("avx2", target):
        return 256
    return 128


def vector_lanes(target: "tvm.target.Target", dtype: str) -> int:
    """Lanes of ``dtype`` in the target's widest vector register."""
    import tvm

    return max(1, vector_bits(target) // tvm.DataType(dtype).bits)


def set_num_threads(threads: int) -> None:
    """Size TVM's thread pool: it reads ``TVM_NUM_THREADS`` once, when it first starts, and uses one thread
    on this VM otherwise.  Call before the first TVM kernel runs (the one place that sets it)."""
    os.environ["TVM_NUM_THREADS"] = str(int(threads))


def tvm_num_threads(default: int) -> int:
    """The thread count TVM's pool runs with in this process (and in workers started from it)."""
    value = os.environ.get("TVM_NUM_THREADS", "")
    return int(value) if value.isdigit() else default


def _split(name: str) -> tuple[str, str | None]:
    """``cuda:sm_90`` / ``rocm:gfx90a`` -> (kind, arch)."""
    kind, _, arch = name.strip().lower().partition(":")
    return kind, (arch or None)


def _cuda_spec(arch: str | None) -> TargetSpec:
    import tvm

    can_run, note = False, ""
    dev = tvm.cuda(0) if tvm.runtime.enabled("cuda") else None
    if dev is not None and dev.exist:
        can_run = True
        arch = arch or "sm_" + str(dev.compute_version).replace(".", "")
    elif not tvm.runtime.enabled("cuda"):
        note = "this TVM runtime has no CUDA support: the model compiles but cannot run here"
    else:
        note = "no CUDA GPU found: the model compiles but cannot run here"
    target = tvm.target.Target({"kind": "cuda", "arch": arch or DEFAULT_CUDA_ARCH}, host=llvm_target())
    return TargetSpec("cuda", target, can_run, note)


def rocm_bitcode_dir() -> str | None:
    """The directory holding the ROCm device bitcode (``ocml.bc``), if installed."""
    env = os.environ.get("ROCM_PATH")
    candidates = [os.path.join(env, "amdgcn", "bitcode")] if env else []
    for pattern in _ROCM_BITCODE_GLOBS:
        candidates.extend(sorted(glob.glob(pattern)))
    for d in candidates:
        if os.path.isfile(os.path.join(d, "ocml.bc")) or os.path.isfile(os.path.join(d, "ocml.amdgcn.bc")):
            return d
    return None


def lld_version(path: str) -> int:
    """Major version of an ``ld.lld`` binary (0 when it cannot be told)."""
    import re
    import subprocess

    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r"LLD (\d+)", out)
    return int(m.group(1)) if m else 0


def find_lld() -> str | None:
    """The newest ``ld.lld`` (version >= MIN_LLD, not newer than TVM's LLVM) on this machine."""
    from tvm.target import codegen

    major = int(codegen.llvm_version_major())
    names = [f"ld.lld-{v}" for v in range(major, MIN_LLD - 1, -1)] + ["ld.lld", "/opt/rocm/llvm/bin/ld.lld"]
    for name in names:
        path = shutil.which(name)
        if path and lld_version(path) >= MIN_LLD:
            return path
    return None


def _use_lld(lld: str) -> None:
    """Make TVM's AMDGPU link step use ``lld`` (its own lookup stops at the unversioned, possibly old one)."""
    import tvm_ffi
    from tvm.support import rocm

    def link(obj_bin):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            obj, cobj = os.path.join(d, "kernel.o"), os.path.join(d, "kernel.co")
            with open(obj, "wb") as fh:
                fh.write(bytes(obj_bin))
            rocm.rocm_link(obj, cobj, lld=lld)
            with open(cobj, "rb") as fh:
                return bytearray(fh.read())

    tvm_ffi.register_global_func("tvm_callback_rocm_link", link, override=True)


def _rocm_spec(arch: str | None) -> TargetSpec:
    missing = []
    lld = find_lld()
    if lld is None:
        missing.append(f"ld.lld {MIN_LLD} or newer (package lld-{MIN_LLD})")
    bitcode = rocm_bitcode_dir()
    if bitcode is None:
        missing.append("the ROCm device bitcode ocml.bc (package rocm-device-libs)")
    if missing:
        raise UserError(f"--target rocm needs {' and '.join(missing)} to link AMDGPU code objects: run "
                        f"`{ROCM_INSTALL_HINT}` (or set ROCM_PATH to a ROCm install)")
    import tvm

    _use_lld(lld)
    # TVM's bitcode lookup reads $ROCM_PATH/amdgcn/bitcode; point it at what we found.
    os.environ.setdefault("ROCM_PATH", os.path.dirname(os.path.dirname(bitcode)))
    target = tvm.target.Target({"kind": "rocm", "mcpu": arch or DEFAULT_ROCM_ARCH}, host=llvm_target())
    can_run = tvm.runtime.enabled("rocm") and tvm.rocm(0).exist
    note = "" if can_run else ("this TVM runtime cannot run ROCm code: the code object is built here; running "
                               "or tuning it needs a ROCm-enabled TVM runtime (e.g. through --rpc)")
    return TargetSpec("rocm", target, can_run, note)


def check_name(name: str) -> tuple[str, str | None]:
    """Validate the ``--target`` spelling without loading TVM (so a typo fails fast); (kind, arch)."""
    kind, arch = _split(name)
    if kind not in REGISTRY:
        raise UserError(f"unknown target {name!r}: use one of {', '.join(KINDS)} (e.g. --target llvm)")
    if kind == "llvm" and arch:
        raise UserError(f"--target {name!r}: llvm takes no architecture, it compiles for this host's CPU")
    pattern = ARCH_PATTERNS.get(kind)
    if arch and pattern and not re.fullmatch(pattern, arch):
        example = REGISTRY[kind].arch_example
        raise UserError(f"--target {name!r}: {arch!r} is not a {kind} architecture; write {kind}:{example}, e.g. "
                        f"{kind}:{DEFAULT_CUDA_ARCH if kind == 'cuda' else DEFAULT_ROCM_ARCH}")
    return kind, arch


# What an architecture after ``cuda:`` / ``rocm:`` looks like (TVM fails deep in code generation otherwise):
# NVIDIA compute capabilities sm_50 ... sm_120a, AMD GPU names gfx803 ... gfx1201.
ARCH_PATTERNS = {"cuda": r"sm_\d{2,3}[a-z]?", "rocm": r"gfx[0-9a-f]{3,4}"}


def _llvm_spec(arch: str | None, threads: int | None) -> TargetSpec:
    return TargetSpec("llvm", llvm_target(threads), True)


# Clock and FMA pipes no x86 core exceeds (boost clocks top out near 6 GHz; two FMA pipes per core), and a
# factor 2 on top: the ceiling only has to catch impossible numbers (a forged 1e6 GFLOP/s), never a real one.
_CPU_GHZ, _FMA_PIPES, _CEILING_SLACK = 6.0, 2, 2.0
# fp32 GFLOP/s no GPU reaches without tensor cores (an H100 does ~67 TFLOP/s), which our templates never use.
_GPU_CEILING = 2e5


def _cpu_ceiling(target: "tvm.target.Target") -> float:
    lanes = vector_lanes(target, "float32")
    return num_cores(target) * lanes * 2 * _FMA_PIPES * _CPU_GHZ * _CEILING_SLACK


def gflops_ceiling(target: "tvm.target.Target") -> float:
    """GFLOP/s no kernel can reach on ``target`` (fp32 FMA peak with headroom): a stored record claiming
    more is forged or corrupt and is never believed (:func:`kerneltune.tune.record_problem`)."""
    return _cpu_ceiling(target) if not kind_of(target).is_gpu else _GPU_CEILING


REGISTRY: dict[str, TargetKind] = {k.name: k for k in (
    TargetKind("llvm", "cpu", False, "cpu", _llvm_spec),
    TargetKind("cuda", "cuda", True, "gpu", lambda arch, threads: _cuda_spec(arch), "sm_XX"),
    TargetKind("rocm", "rocm", True, "gpu", lambda arch, threads: _rocm_spec(arch), "gfxNNN"),
)}
KINDS = tuple(REGISTRY)
# "llvm | cuda[:sm_XX] | rocm[:gfxNNN]", for every --target help text
TARGET_HELP = " | ".join(k.name + (f"[:{k.arch_example}]" if k.arch_example else "") for k in REGISTRY.values())


def parse_target(name: str, threads: int | None = None) -> TargetSpec:
    """Parse ``llvm``, ``cuda[:sm_XX]`` or ``rocm[:gfxNNN]``; anything else is a :class:`UserError`."""
    kind, arch = check_name(name)
    return REGISTRY[kind].build(arch, threads)


def device_for(spec: TargetSpec):
    """The TVM device that runs ``spec``'s code here; a UserError when this machine cannot."""
    import tvm

    if not spec.can_run:
        raise UserError(f"cannot run the {spec.kind} build here: {spec.note}")
    return tvm.device(REGISTRY[spec.kind].device, 0)
