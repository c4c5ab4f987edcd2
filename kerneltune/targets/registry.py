"""The one target registry (:data:`REGISTRY`): what each ``--target`` kind means to every stage (device,
template family, how its :class:`TargetSpec` is built from the TVM attributes), and the checks a spec
answers (can it be tuned here, which device runs it, the GFLOP/s no kernel can reach on it).

TVM 0.27 takes targets as dicts, and a bare ``{"kind": "llvm"}`` compiles for a generic x86-64 (SSE2, one
core): the schedules' vector widths and the thread pool then fit no real machine.  So ``llvm`` without an
``mcpu`` gets the host's as LLVM detects it (``znver5`` here: AVX-512) when it compiles for this machine's
architecture, and ``num-cores`` the thread count the user runs with.

An ``llvm`` target whose ``mtriple`` names another architecture is a cross build: LLVM emits the code here,
the architecture's cross gcc links ``model.so`` (:mod:`.toolchains`), nothing runs here (the check falls
back to the graph in onnxruntime, tuning needs ``--rpc``).  An ``mcpu`` this CPU lacks the features of
(``-mcpu=sapphirerapids`` on a Zen) builds but is not run here either: SIGILL is no error message.

GPU targets are checked up front for what their toolchain needs, so a missing piece is one line naming
the package to install rather than an error from deep inside LLVM at the end of a long compile:

* ``cuda``: the wheel emits CUDA source compiled when the module is loaded; building works without a GPU,
  running needs a GPU and NVRTC (``cuda-bindings``) or nvcc.
* ``rocm``: linking needs ``ld.lld`` and the ROCm device bitcode (:mod:`.toolchains`).  The wheel's runtime
  is built without ROCm, so it can never run ROCm code: running or tuning needs a ROCm-enabled TVM runtime,
  e.g. over RPC.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from graphopt.errors import UserError

from .host import (arch_of, default_threads, host_arch, host_cpu, host_triple, llvm_target, missing_cpu_features,
                   num_cores, vector_lanes)
from .toolchains import MIN_LLD, ROCM_INSTALL_HINT, CrossToolchain, cross_toolchain, find_lld, rocm_bitcode_dir, use_lld

# TVM is imported inside the functions that need it (see kerneltune.targets).
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



@dataclass(frozen=True)
class TargetSpec:
    """A parsed ``--target``: the TVM target plus what this machine can do with it."""

    kind: str
    target: "tvm.target.Target"
    can_run: bool  # the local TVM runtime can execute code for this target (device present and supported)
    note: str = ""  # why it cannot run, for messages and report.json
    cross: "CrossToolchain | None" = None  # another CPU architecture: the gcc that links model.so
    request: TargetRequest | None = None  # the --target it was built from (kerneltune.targets.parse.build_spec)

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

    @property
    def threads(self) -> int | None:
        """The CPU threads the target's code runs with (its ``num-cores``; 0 when unset); None for a GPU
        target, whose kernels do not run on the host's thread pool (report.json ``threads``)."""
        return num_cores(self.target, default=0) if self.kind == "llvm" else None


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

    use_lld(lld)
    # TVM's bitcode lookup reads $ROCM_PATH/amdgcn/bitcode; point it at what we found.
    os.environ.setdefault("ROCM_PATH", os.path.dirname(os.path.dirname(bitcode)))
    target = _target({**attrs, "kind": "rocm", "mcpu": attrs.get("mcpu") or DEFAULT_ROCM_ARCH}, host=llvm_target())
    can_run = tvm.runtime.enabled("rocm") and tvm.rocm(0).exist
    note = "" if can_run else ("this TVM runtime is built without ROCm: the code object is built here; running "
                               "or tuning it needs a ROCm-enabled TVM runtime (e.g. through --rpc)")
    return TargetSpec("rocm", target, can_run, note)


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
