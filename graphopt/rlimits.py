"""This process's own resource limits (``ulimit -v``, ``ulimit -f``): read, checked before the long work, and
named when one ends a run.

Why a module of its own: a limit set by the shell does not fail where it is exceeded in words anyone can act
on.  Under ``ulimit -v`` TVM's and LLVM's allocations fail deep inside (a protobuf "Failed to serialize", an
``AttributeError`` from a half-registered TVM module, a ``MemoryError``); under ``ulimit -f`` LLVM says
"File too large" or a linker dies silently.  So the command-line entry (:func:`graphopt.errors.cli_entry`)
asks :func:`explain` whether a limit accounts for an error, and the commands refuse up front a limit below
what they surely need (:func:`shortfall`).  No graphopt imports: the error module below everything uses it.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass

try:
    import resource
except ImportError:  # not POSIX: no such limits
    resource = None  # type: ignore[assignment]

# Address space a TVM build surely needs, measured as VmPeak (/proc/self/status) on an Intel Xeon, 2 threads:
# optimize-model of a 64-128-10 MLP peaked at 1.66 GB, loading and running it at 1.31 GB (TVM's and LLVM's
# libraries, onnxruntime, a stack and a malloc arena per thread).  Somewhat under those, so that an up-front
# refusal is never wrong; a limit between these and what the model needs is named when the run fails.
BUILD_ADDRESS_SPACE = 3 * 2**29  # 1.61 GB
RUN_ADDRESS_SPACE = 2**30 + 2**27  # 1.21 GB
# What a tool says when it hit the file-size limit: EFBIG's text (LLVM), SIGXFSZ's (gcc's collect2 on its ld)
FILE_SIZE_WORDS = ("File too large", "File size limit exceeded")
NEAR = 0.8  # a run whose peak came this close to the address-space limit failed for want of it


@dataclass(frozen=True)
class Limit:
    """One resource limit: its ``resource`` constant's name, the ulimit option that sets it, in words."""

    name: str
    option: str
    words: str

    def soft(self) -> int | None:
        """The soft limit in bytes; None when unlimited (or on a system without it)."""
        if resource is None or not hasattr(resource, self.name):
            return None
        value = resource.getrlimit(getattr(resource, self.name))[0]
        return None if value == resource.RLIM_INFINITY or value < 0 else int(value)

    def message(self, what: str) -> str:
        return (f"{what} under this process's {self.words} limit (ulimit {self.option}: {_size(self.soft() or 0)}): "
                f"raise it (ulimit {self.option} unlimited) and rerun; a previous build in the output folder is kept")


ADDRESS_SPACE = Limit("RLIMIT_AS", "-v", "address-space (virtual memory)")
FILE_SIZE = Limit("RLIMIT_FSIZE", "-f", "file-size")


def shortfall(address_bytes: int = 0, file_bytes: int = 0) -> str | None:
    """The one line refusing a run whose limits are below what it surely needs: ``address_bytes`` of address
    space, a file of ``file_bytes``; None when they allow it."""
    space = ADDRESS_SPACE.soft()
    if space is not None and space < address_bytes:
        return ADDRESS_SPACE.message(f"this run needs at least {_size(address_bytes)} of address space, more than "
                                     "it may have")
    size = FILE_SIZE.soft()
    if size is not None and size < file_bytes:
        return FILE_SIZE.message(f"this run writes a file of about {_size(file_bytes)}, larger than it may")
    return None


def explain(exc: BaseException) -> str | None:
    """The one line for an error a limit of this process accounts for, else None: a file write refused for its
    size (EFBIG, LLVM's "File too large", a linker killed by SIGXFSZ), or any failure once the process came close to its address-space
    limit (what fails first there is whatever allocated next)."""
    if FILE_SIZE.soft() is not None and (getattr(exc, "errno", None) == errno.EFBIG
                                         or any(words in str(exc) for words in FILE_SIZE_WORDS)):
        return FILE_SIZE.message("a file reached its size limit")
    space, peak = ADDRESS_SPACE.soft(), vm_peak()
    if space is not None and (isinstance(exc, MemoryError) or "bad_alloc" in str(exc)
                              or (peak is not None and peak >= NEAR * space)):
        return ADDRESS_SPACE.message("out of memory")
    return None


def vm_peak() -> int | None:
    """This process's peak address space (Linux's VmPeak), in bytes; None where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmPeak:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _size(n: int) -> str:
    """graphopt.limits.format_bytes's words, not imported from there: limits imports errors, which imports this."""
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"
