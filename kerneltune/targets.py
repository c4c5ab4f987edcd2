"""The one target registry: target kinds, ``--target`` parsing, host detection, cross toolchains, devices.

Everything that knows what ``llvm``, ``cuda`` or ``rocm`` means lives here (:data:`REGISTRY`); the
templates, the measurer, the compiler and every CLI ask this module instead of spelling kinds themselves.

``--target`` takes what tvmc takes (https://tvm.apache.org/docs/arch/device_target_interactions.html):

* the short forms ``llvm``, ``cuda[:sm_XX]``, ``rocm[:gfxNNN]``;
* a TVM target string, ``llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72`` (TVM 0.27 itself no longer
  parses strings, so :func:`check_name` does, without loading TVM, into the dict TVM takes);
* a TVM target JSON object, ``{"kind": "llvm", "mcpu": "cortex-a72", "mtriple": "aarch64-linux-gnu"}``.

Each becomes a :class:`TargetSpec` (a TVM :class:`~tvm.target.Target` plus whether this machine can run it
and, for another CPU architecture, the cross toolchain that links ``model.so``).

TVM 0.27 takes targets as dicts, and a bare ``{"kind": "llvm"}`` compiles for a generic x86-64 (SSE2, one
core): the schedules' vector widths and the thread pool then fit no real machine.  So ``llvm`` without an
``mcpu`` gets the host's as LLVM detects it (``znver5`` here: AVX-512) when it compiles for this machine's
architecture, and ``num-cores`` the thread count the user runs with.

An ``llvm`` target whose ``mtriple`` names another architecture is a cross build: LLVM emits the code here,
the architecture's Debian cross gcc links ``model.so`` (:data:`CROSS_TOOLCHAINS`), nothing runs here (the
check falls back to the graph in onnxruntime, tuning needs ``--rpc``).  An ``mcpu`` this CPU lacks the
features of (``-mcpu=sapphirerapids`` on a Zen) builds but is not run here either: SIGILL is no error message.

GPU targets are checked up front for what their toolchain needs, so a missing piece is one line naming
the package to install rather than an error from deep inside LLVM at the end of a long compile:

* ``cuda``: the wheel emits CUDA source compiled when the module is loaded; building works without a GPU,
  running needs a GPU and NVRTC (``cuda-bindings``) or nvcc.
* ``rocm``: the wheel's LLVM emits AMDGPU code objects, but linking them needs ``ld.lld`` and the ROCm device
  bitcode (``ocml``...): Debian packages ``lld-19`` (older lld rejects the code-object ABI version TVM's
  LLVM emits) and ``rocm-device-libs``.  The wheel's runtime is built without ROCm, so it can never run ROCm
  code: running or tuning needs a ROCm-enabled TVM runtime, e.g. over RPC.
"""
from __future__ import annotations

import glob
import json
import os
import platform
import re
import shlex
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
    build: Callable[[dict, int | None], "TargetSpec"]  # (TVM attributes from --target, host threads) -> spec
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
    cross: "CrossToolchain | None" = None  # another CPU architecture: the gcc that links model.so

    @property
    def is_gpu(self) -> bool:
        return REGISTRY[self.kind].is_gpu

    @property
    def device(self) -> str:
        """TVM's device type for this target (``cpu``, ``cuda``, ``rocm``): what a loader of model.so needs."""
        return REGISTRY[self.kind].device

    @property
    def triple(self) -> str:
        """The LLVM triple the host code is built for (this machine's unless cross-compiling)."""
        return self.cross.triple if self.cross else host_triple()


@dataclass(frozen=True)
class CrossToolchain:
    """How ``model.so`` for another CPU architecture is linked (TVM's ``export_library(fcompile=...)``)."""

    triple: str
    compiler: str  # the cross gcc's path


@dataclass(frozen=True)
class TargetRequest:
    """``--target`` parsed without TVM: the kind and the TVM attributes the user gave (in their order)."""

    kind: str
    attrs: tuple[tuple[str, object], ...] = ()
    text: str = ""

    def get(self, key: str, default: object = None) -> object:
        return dict(self.attrs).get(key, default)

    @property
    def is_cross(self) -> bool:
        """An llvm target for another CPU architecture (its code cannot run, nor be timed, here)."""
        triple = str(self.get("mtriple") or "")
        return self.kind == "llvm" and bool(triple) and arch_of(triple) != host_arch()

    @property
    def cost_kind(self) -> str:
        """What the graph stage's measured cost model is told: ``llvm`` only where it can time kernels here."""
        return f"{self.kind}-cross" if self.is_cross else self.kind


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


def vector_registers(target: "tvm.target.Target") -> int:
    """Architectural vector registers: 32 with AVX-512 (zmm0-31), 16 with AVX2/SSE (ymm/xmm0-15).  The
    templates size their register tiles by it: a tile of accumulators for 32 registers spills on 16."""
    return 32 if vector_bits(target) == 512 else 16


def vector_lanes(target: "tvm.target.Target", dtype: str) -> int:
    """Lanes of ``dtype`` in the target's widest vector register."""
    import tvm

    return max(1, vector_bits(target) // tvm.DataType(dtype).bits)


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
    from graphopt.validate import check_threads

    n = check_threads(threads, option) or default_threads()
    set_num_threads(n)
    return n


def tvm_num_threads(default: int) -> int:
    """The thread count TVM's pool runs with in this process (and in workers started from it)."""
    value = os.environ.get("TVM_NUM_THREADS", "")
    return int(value) if value.isdigit() else default


def _cuda_spec(attrs: dict) -> TargetSpec:
    import tvm

    can_run, note = False, ""
    arch = attrs.get("arch")
    dev = tvm.cuda(0) if tvm.runtime.enabled("cuda") else None
    if dev is not None and dev.exist:
        can_run = True
        arch = arch or "sm_" + str(dev.compute_version).replace(".", "")
    elif not tvm.runtime.enabled("cuda"):
        note = "this TVM runtime has no CUDA support: the model compiles but cannot run here"
    else:
        note = "no CUDA GPU found: the model compiles but cannot run here"
    target = _target({**attrs, "kind": "cuda", "arch": arch or DEFAULT_CUDA_ARCH}, host=llvm_target())
    return TargetSpec("cuda", target, can_run, note)


def _target(attrs: dict, host: "tvm.target.Target | None" = None) -> "tvm.target.Target":
    """TVM's Target from a dict; an attribute TVM does not know (or of the wrong type) is a UserError."""
    import tvm

    try:
        return tvm.target.Target(attrs, host=host) if host is not None else tvm.target.Target(attrs)
    except (ValueError, TypeError, RuntimeError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"TVM rejects --target {json.dumps(attrs)} ({first}); see "
                        "https://tvm.apache.org/docs/reference/api/python/target.html for the attributes") from None


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


def _rocm_spec(attrs: dict) -> TargetSpec:
    missing = []
    lld = find_lld()
    if lld is None:
        missing.append(f"ld.lld {MIN_LLD} or newer (package lld-{MIN_LLD})")
    bitcode = rocm_bitcode_dir()
    if bitcode is None:
        missing.append("the ROCm device bitcode ocml.bc (package rocm-device-libs)")
    if missing:
        raise UserError(f"--target rocm: this TVM wheel's runtime is built without ROCm (nothing ROCm runs here) "
                        f"and building the AMDGPU code object needs {' and '.join(missing)}: run "
                        f"`{ROCM_INSTALL_HINT}` (or set ROCM_PATH to a ROCm install)")
    import tvm

    _use_lld(lld)
    # TVM's bitcode lookup reads $ROCM_PATH/amdgcn/bitcode; point it at what we found.
    os.environ.setdefault("ROCM_PATH", os.path.dirname(os.path.dirname(bitcode)))
    target = _target({**attrs, "kind": "rocm", "mcpu": attrs.get("mcpu") or DEFAULT_ROCM_ARCH}, host=llvm_target())
    can_run = tvm.runtime.enabled("rocm") and tvm.rocm(0).exist
    note = "" if can_run else ("this TVM runtime is built without ROCm: the code object is built here; running "
                               "or tuning it needs a ROCm-enabled TVM runtime (e.g. through --rpc)")
    return TargetSpec("rocm", target, can_run, note)


# What an architecture after ``cuda:`` / ``rocm:`` looks like (TVM fails deep in code generation otherwise):
# NVIDIA compute capabilities sm_50 ... sm_120a, AMD GPU names gfx803 ... gfx1201.
ARCH_PATTERNS = {"cuda": r"sm_\d{2,3}[a-z]?", "rocm": r"gfx[0-9a-f]{3,4}"}
# Which attribute carries the architecture of a short form (cuda:sm_90 -> arch, rocm:gfx90a -> mcpu).
_ARCH_ATTR = {"cuda": "arch", "rocm": "mcpu"}
# Attributes TVM takes as lists: in a target string they are comma-separated (-mattr=+neon,+fp16).
_LIST_ATTRS = ("mattr", "keys", "libs", "cl-opt")
EXAMPLES = ("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72", '{"kind": "cuda", "arch": "sm_90"}')


def _value(key: str, text: str) -> object:
    """A target-string value as TVM's dict form wants it: lists for list attributes, ints, booleans."""
    if key in _LIST_ATTRS:
        return [v for v in text.split(",") if v]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _parse_string(text: str) -> tuple[str, dict]:
    """``llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72`` -> (``llvm``, its attributes)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise UserError(f"--target {text!r}: {exc}; quote the whole target once") from None
    kind, attrs = words[0].lower(), {}
    for word in words[1:]:
        m = re.fullmatch(r"--?([A-Za-z][\w.-]*)=(.*)", word)
        if not m:
            raise UserError(f"--target {text!r}: {word!r} is not an option; write -key=value, e.g. "
                            f"'{EXAMPLES[0]}'")
        attrs[m.group(1)] = _value(m.group(1), m.group(2))
    return kind, attrs


def _parse_json(text: str) -> tuple[str, dict]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--target is not valid JSON ({exc.msg} at character {exc.pos}); e.g. "
                        f"--target '{EXAMPLES[1]}'") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise UserError(f"--target JSON needs a \"kind\" string, e.g. {EXAMPLES[1]}")
    obj = dict(obj)
    return obj.pop("kind").lower(), obj


def check_name(name: str) -> TargetRequest:
    """Parse and check ``--target`` without loading TVM (so a typo fails fast): a short form
    (``llvm``, ``cuda:sm_90``), a TVM target string or a TVM target JSON object."""
    text = str(name).strip()
    if text.startswith("{"):
        kind, attrs = _parse_json(text)
    elif " " in text or "\t" in text:
        kind, attrs = _parse_string(text)
    else:
        kind, _, arch = text.lower().partition(":")
        attrs = {}
        if arch:
            if kind == "llvm":
                raise UserError(f"--target {name!r}: llvm takes no ':architecture'; for another CPU write "
                                f"'llvm -mcpu=NAME' (and -mtriple=... for another architecture)")
            if kind in _ARCH_ATTR:
                attrs[_ARCH_ATTR[kind]] = arch
    if kind not in REGISTRY:
        raise UserError(f"unknown target {name!r}: use one of {', '.join(KINDS)} (e.g. --target llvm, or "
                        f"'{EXAMPLES[0]}')")
    pattern, key = ARCH_PATTERNS.get(kind), _ARCH_ATTR.get(kind)
    arch = attrs.get(key) if key else None
    if arch is not None and pattern and not re.fullmatch(pattern, str(arch)):
        example = REGISTRY[kind].arch_example
        raise UserError(f"--target {name!r}: {arch!r} is not a {kind} architecture; write {kind}:{example}, e.g. "
                        f"{kind}:{DEFAULT_CUDA_ARCH if kind == 'cuda' else DEFAULT_ROCM_ARCH}")
    if "host" in attrs:
        raise UserError(f"--target {name!r}: give no \"host\"; the host code is built for the llvm target of this "
                        "machine (or of the mtriple)")
    return TargetRequest(kind, tuple(attrs.items()), text)


# Cross gcc per CPU architecture of an LLVM triple (Debian packages, compiler name): it links model.so for
# that architecture, and needs that architecture's C library start files (crti.o), packaged apart
# (https://packages.debian.org/search?keywords=gcc-aarch64-linux-gnu).
CROSS_TOOLCHAINS = {
    "aarch64": ("gcc-aarch64-linux-gnu libc6-dev-arm64-cross", "aarch64-linux-gnu-gcc"),
    "arm": ("gcc-arm-linux-gnueabihf libc6-dev-armhf-cross", "arm-linux-gnueabihf-gcc"),
    "riscv64": ("gcc-riscv64-linux-gnu libc6-dev-riscv64-cross", "riscv64-linux-gnu-gcc"),
    "x86_64": ("gcc-x86-64-linux-gnu libc6-dev-amd64-cross", "x86_64-linux-gnu-gcc"),
}


def arch_of(triple: str) -> str:
    """The CPU architecture family of an LLVM triple (``armv7a-linux-gnueabihf`` -> ``arm``)."""
    arch = triple.split("-", 1)[0].lower()
    if arch in ("arm64", "aarch64"):
        return "aarch64"
    if arch.startswith(("arm", "thumb")):
        return "arm"
    if arch in ("amd64", "x86_64"):
        return "x86_64"
    return arch


def host_arch() -> str:
    """This machine's CPU architecture family (``x86_64``, ``aarch64``...)."""
    return arch_of(platform.machine())


def host_triple() -> str:
    """LLVM's triple for this machine."""
    from tvm.target import codegen

    return str(codegen.llvm_get_system_triple())


def cross_toolchain(triple: str) -> CrossToolchain | None:
    """None when ``triple`` is this machine's architecture; else the cross gcc linking for it, or a
    UserError naming the Debian package to install."""
    arch = arch_of(triple)
    if arch == host_arch():
        return None
    if "linux" not in triple.lower():
        raise UserError(f"-mtriple={triple}: only Linux targets can be linked here (a ...-linux-gnu triple); "
                        "build for other systems with their own toolchain")
    if arch not in CROSS_TOOLCHAINS:
        raise UserError(f"-mtriple={triple}: no cross toolchain known for {arch}; use one of "
                        f"{', '.join(sorted(CROSS_TOOLCHAINS))}")
    packages, compiler = CROSS_TOOLCHAINS[arch]
    for name in (f"{triple}-gcc", compiler):
        path = shutil.which(name)
        if path and _has_start_files(path):
            return CrossToolchain(triple, path)
    raise UserError(f"-mtriple={triple}: linking model.so for {arch} needs the cross compiler {compiler} and its C "
                    f"library: run `apt-get install {packages}`")


def _has_start_files(gcc: str) -> bool:
    """The cross gcc finds its C library's ``crti.o`` (gcc prints the bare name back when it cannot)."""
    import subprocess

    try:
        out = subprocess.run([gcc, "-print-file-name=crti.o"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return os.path.isabs(out.strip())


# LLVM "features" that only tune code generation (no instruction needs them): a haswell target on a Zen
# differs in these, yet runs.
_TUNING_FEATURES = ("fast-", "faster-", "slow-", "false-deps", "no-bypass", "prefer-", "tuning-", "ermsb", "fsrm",
                    "idiv", "lea-", "pad-short", "macrofusion", "branchfusion", "use-", "allow-", "avoid-",
                    "sbb-dep", "branch-hint", "fast")


def missing_cpu_features(target: "tvm.target.Target") -> list[str]:
    """Instruction-set features an llvm target for this architecture uses that this CPU lacks (its code
    would die of SIGILL here)."""
    from tvm.target import codegen

    return sorted(f for f in codegen.llvm_get_cpu_features(target) - codegen.llvm_get_cpu_features(llvm_target(1))
                  if not f.startswith(_TUNING_FEATURES))


def _llvm_spec(attrs: dict, threads: int | None) -> TargetSpec:
    """This machine's CPU by default; ``mcpu``/``mattr``/``mtriple`` as given.  Another architecture's triple
    is a cross build (its gcc found now, before any work); an ``mcpu`` with features this CPU lacks is built
    but not run here."""
    from tvm.target import codegen

    triple = str(attrs.get("mtriple") or "")
    cross = cross_toolchain(triple) if triple else None
    mcpu = attrs.get("mcpu")
    if mcpu is not None and not codegen.llvm_is_valid_cpu(str(mcpu), triple or host_triple()):
        where = triple or f"this machine's {host_arch()} (add -mtriple=... to build for another architecture)"
        raise UserError(f"-mcpu={mcpu}: LLVM knows no such CPU for {where}; e.g. cortex-a72, neoverse-n1 for "
                        "aarch64-linux-gnu, skylake-avx512, znver4 for x86_64")
    base: dict = {"kind": "llvm", "num-cores": int(threads or default_threads())}
    if mcpu is None and cross is None:
        base["mcpu"] = host_cpu()
    target = _target({**base, **attrs})
    if cross is not None:
        return TargetSpec("llvm", target, False, f"cross-compiled for {triple}: copy the output folder to such a "
                          "machine and run it there (run-model), or tune through --rpc", cross)
    missing = missing_cpu_features(target)
    if missing:
        return TargetSpec("llvm", target, False, f"this CPU ({host_cpu()}) lacks {', '.join(missing[:6])} that the "
                          "target uses: the model compiles but cannot run here")
    return TargetSpec("llvm", target, True)


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
    TargetKind("cuda", "cuda", True, "gpu", lambda attrs, threads: _cuda_spec(attrs), "sm_XX"),
    TargetKind("rocm", "rocm", True, "gpu", lambda attrs, threads: _rocm_spec(attrs), "gfxNNN"),
)}
KINDS = tuple(REGISTRY)
# For every --target help text: the short forms, then the TVM forms.
TARGET_HELP = (" | ".join(k.name + (f"[:{k.arch_example}]" if k.arch_example else "") for k in REGISTRY.values())
               + f", or a TVM target string or JSON, e.g. '{EXAMPLES[0]}'")


def parse_target(name: str, threads: int | None = None) -> TargetSpec:
    """Parse a short form, TVM target string or JSON (:func:`check_name`) into a :class:`TargetSpec`;
    anything TVM or this machine's toolchain cannot build is a :class:`UserError`."""
    req = check_name(name)
    return REGISTRY[req.kind].build(dict(req.attrs), threads)


def check_can_tune(spec: TargetSpec, rpc: str | None) -> None:
    """Tuning times kernels on the target: here, or on the ``--rpc`` device for a target this machine
    cannot run (a cross build, a GPU absent here)."""
    if not spec.can_run and not rpc:
        raise UserError(f"tuning for --target {spec.kind} needs a device: {spec.note}; pass --rpc "
                        "HOST:PORT:KEY of a TVM RPC tracker with that device, or --skip-tune")


def device_for(spec: TargetSpec):
    """The TVM device that runs ``spec``'s code here; a UserError when this machine cannot."""
    import tvm

    if not spec.can_run:
        raise UserError(f"cannot run the {spec.kind} build here: {spec.note}")
    return tvm.device(REGISTRY[spec.kind].device, 0)
