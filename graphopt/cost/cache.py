"""The on-disk caches of measured numbers: one JSON object per (target, CPU, backend, threads), shared by every
run; the one home of their IO (cost, kernel and layout prices, calibration, the machine probe, the verdicts).

Keyed by the CPU, not only by "llvm": a cache copied to (or shared over NFS with) another machine, or kept
across a VM migration, must not price operators with another processor's timings (:func:`cpu_id`).

Several processes may price graphs at once (a CLI run and a benchmark), so a flush merges what is on disk
with what this process measured and writes the union atomically, instead of overwriting others' entries.

A cache only saves time, so it is never required and never trusted.  An entry that is not the number its
reader expects (:data:`Valid`: a string, NaN, a list, a negative time, a verdict of 0.7) is ignored, and the
next flush writes the file without it.  A cache file that is not a regular file is never opened (a FIFO's
read blocks until a writer comes, a device may never end); such a file, or a folder that cannot be read or
written (read-only, not a folder, a symlink loop, a full disk), leaves the cache in memory for this process,
with one warning per process naming the path and ``$OPTIMIZE_MODEL_CACHE``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import stat
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from graphopt.errors import UserError
from graphopt.fileio import write_text_atomic

log = logging.getLogger(__name__)

VARIABLE = "OPTIMIZE_MODEL_CACHE"

# Whether a cached number (already known finite and not negative) is what its reader expects.
Valid = Callable[[float], bool]


def positive(value: float) -> bool:
    """A measured time or rate: above zero (a zero time would make every rewrite look free)."""
    return value > 0


def non_negative(value: float) -> bool:
    """A price over the kernels two graphs do not share: zero when one graph has none of its own."""
    return value >= 0


def flag(value: float) -> bool:
    """A yes/no kept as 1.0/0.0: an end-to-end verdict, a price confirmed."""
    return value in (0.0, 1.0)


def whole(value: float) -> bool:
    """A count or a calibrated template choice: a whole number, at least 1."""
    return value >= 1 and value.is_integer()


def user_cache_home() -> Path:
    """The user's cache folder: ``$XDG_CACHE_HOME`` where set (the XDG Base Directory specification,
    https://specifications.freedesktop.org/basedir-spec/latest/), else ``~/.cache``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def cache_dir() -> Path:
    """Where measured costs and the machine probe live: ``$OPTIMIZE_MODEL_CACHE`` (a relative one from the
    current folder); unset or empty, ``optimize-model`` in the user's cache folder (:func:`user_cache_home`;
    an empty value in a script means "no override", not "write cache files here")."""
    return Path(os.environ.get(VARIABLE) or user_cache_home() / "optimize-model")


@lru_cache(maxsize=1)
def cpu_id() -> str:
    """This machine's processor as a file-name-safe key: its model name and a hash of the model name and the
    instruction-set flags (VMs often report a generic name such as "AMD EPYC"; the flags tell AVX2 from
    AVX-512 hosts apart).  From /proc/cpuinfo on Linux, else from :mod:`platform`."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown-cpu"
    slug = re.sub(r"[^A-Za-z0-9]+", "-", model).strip("-").lower()[:40] or "cpu"
    digest = hashlib.sha1(f"{model}|{flags}|{platform.machine()}".encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


_warned = False  # the unusable-cache warning is given once per process


def _unusable(path: Path, why: str) -> None:
    """Say, once per process, that the cache at ``path`` is not used: the build goes on with what it
    measures kept in memory."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("warning: cache %s is unusable (%s); building without it (%s chooses the cache folder)",
                    path, why, VARIABLE)


def _reason(exc: Exception) -> str:
    """The OS's words for a failed read or write (write_text_atomic wraps the OSError in a sentence of its own)."""
    cause = exc if isinstance(exc, OSError) else exc.__context__
    return (cause.strerror or str(cause)) if isinstance(cause, OSError) else str(exc)


def _number(value: object) -> float | None:
    """A cached JSON value as a finite, non-negative float; None for anything else JSON can hold (a string,
    NaN, a list, an object, a boolean, an integer too large for a float): no cache stores anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _read_bytes(path: Path) -> bytes | None:
    """The bytes of the regular file ``path`` (b"" when there is none); None, warned, when it cannot be used.
    The type is checked before the open (opening a FIFO or a device can block or act), and the open is
    non-blocking and checked again, in case the file was replaced in between."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            _unusable(path, "not a regular file")
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    except OSError as exc:
        _unusable(path, _reason(exc))
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                _unusable(path, "not a regular file")
                return None
            return f.read()
        except OSError as exc:
            _unusable(path, _reason(exc))
            return None


# What an entry of a cache file is read as, or None when it is not one (:func:`_number`: a time, a count ...).
Entry = Callable[[object], Any]


def _read(path: Path, entry: Entry = _number) -> tuple[dict[str, Any], bool] | None:
    """The valid entries of the cache file ``path`` (each read by ``entry``) and whether it held anything else
    (then a flush rewrites it); None when the file cannot be used."""
    raw = _read_bytes(path)
    if raw is None:
        return None
    if not raw:
        return {}, False
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
        return {}, True
    if not isinstance(data, dict):
        return {}, True
    entries = {key: read for key, value in data.items() if (read := entry(value)) is not None}
    return entries, len(entries) < len(data)


class CostCache:
    """Numbers per key (seconds, counts, calibrated choices: each reader says which, :data:`Valid`), loaded
    once and flushed (merged, atomically) when something changed; in memory only when its file or folder
    cannot be used.  ``entry`` reads a stored value: a number by default; the verdict store
    (:mod:`graphopt.verdicts`) keeps lists of numbers."""

    def __init__(self, path: Path, entry: Entry = _number):
        self.path = path
        self._entry = entry
        loaded = _read(path, entry)
        self._usable = loaded is not None
        self._data, self._dirty = loaded or ({}, False)
        self._dropped: set[str] = set()  # keys whose number was not what its reader expects

    def get(self, key: str, valid: Valid = positive) -> float | None:
        """The number under ``key`` when it is ``valid`` (default: a measured time), else None; an invalid one
        is forgotten, and left out of the file at the next flush."""
        value = self._data.get(key)
        if value is None or valid(value):
            return value
        del self._data[key]
        self._dropped.add(key)
        self._dirty = True
        return None

    def put(self, key: str, value: float | list[float]) -> None:
        self._data[key] = [float(v) for v in value] if isinstance(value, list) else float(value)
        self._dirty = True

    def flush(self) -> None:
        """Merge with the file (other processes' entries kept, invalid ones dropped) and write it atomically;
        when that fails the cache stays in memory, warned once."""
        if not (self._dirty and self._usable):
            return
        on_disk = _read(self.path, self._entry)
        if on_disk is None:
            self._usable = False
            return
        merged = {key: value for key, value in on_disk[0].items() if key not in self._dropped} | self._data
        try:
            write_text_atomic(self.path, json.dumps(merged, sort_keys=True))
        except (OSError, UserError) as exc:
            self._usable = False
            _unusable(self.path, _reason(exc))
            return
        self._dirty = False
