"""The toolchains a build needs beyond the wheel: the cross gcc that links ``model.so`` for another CPU
architecture (:data:`CROSS_TOOLCHAINS`), and for ``rocm`` an ``ld.lld`` new enough and the ROCm device bitcode.

* ``rocm``: the wheel's LLVM emits AMDGPU code objects, but linking them needs ``ld.lld`` and the ROCm device
  bitcode (``ocml``...): Debian packages ``lld-19`` (older lld rejects the code-object ABI version TVM's
  LLVM emits) and ``rocm-device-libs``.
* another CPU architecture (an ``llvm`` target whose ``mtriple`` names one): LLVM emits the code here, the
  architecture's Debian cross gcc links ``model.so``.
"""
from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass

from graphopt.errors import UserError

from .host import arch_of, host_arch


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


def use_lld(lld: str) -> None:
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


@dataclass(frozen=True)
class CrossToolchain:
    """How ``model.so`` for another CPU architecture is linked (TVM's ``export_library(fcompile=...)``)."""

    triple: str
    compiler: str  # the cross gcc's path


# Cross gcc per CPU architecture of an LLVM triple (Debian packages, compiler name): it links model.so for
# that architecture, and needs that architecture's C library start files (crti.o), packaged apart
# (https://packages.debian.org/search?keywords=gcc-aarch64-linux-gnu).
CROSS_TOOLCHAINS = {
    "aarch64": ("gcc-aarch64-linux-gnu libc6-dev-arm64-cross", "aarch64-linux-gnu-gcc"),
    "arm": ("gcc-arm-linux-gnueabihf libc6-dev-armhf-cross", "arm-linux-gnueabihf-gcc"),
    "riscv64": ("gcc-riscv64-linux-gnu libc6-dev-riscv64-cross", "riscv64-linux-gnu-gcc"),
    "x86_64": ("gcc-x86-64-linux-gnu libc6-dev-amd64-cross", "x86_64-linux-gnu-gcc"),
}


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
