"""The on-disk cache of measured costs: one JSON object per (target, CPU, backend, threads), shared by every run.

Keyed by the CPU, not only by "llvm": a cache copied to (or shared over NFS with) another machine, or kept
across a VM migration, must not price operators with another processor's timings (:func:`cpu_id`).

Several processes may price graphs at once (a CLI run and a benchmark), so a flush merges what is on disk
with what this process measured and writes the union atomically, instead of overwriting others' entries.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from functools import lru_cache
from pathlib import Path

from graphopt.fileio import write_text_atomic


def cache_dir() -> Path:
    """Where measured costs and the machine probe live (``$OPTIMIZE_MODEL_CACHE`` overrides)."""
    return Path(os.environ.get("OPTIMIZE_MODEL_CACHE", Path.home() / ".cache" / "optimize-model"))


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


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; empty when it is missing or unreadable (a cache is never required)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class CostCache:
    """Seconds per key, loaded once and flushed (merged, atomically) when something new was measured."""

    def __init__(self, path: Path):
        self.path = path
        self._data: dict[str, float] = read_json(path)
        self._dirty = False

    def get(self, key: str) -> float | None:
        return self._data.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __getitem__(self, key: str) -> float:
        return self._data[key]

    def put(self, key: str, seconds: float) -> None:
        self._data[key] = seconds
        self._dirty = True

    def flush(self) -> None:
        if not self._dirty:
            return
        merged = read_json(self.path)
        merged.update(self._data)
        write_text_atomic(self.path, json.dumps(merged, sort_keys=True))
        self._dirty = False
