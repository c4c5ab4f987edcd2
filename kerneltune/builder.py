"""The builder: configs of a task scheduled, compiled and exported as shared libraries.

One small interface, as MetaSchedule has it: ``Builder.build(list[BuilderInput]) -> list[BuilderResult]``
(same order), plus ``close()``.  :class:`LocalBuilder` is the default: a pool of spawned worker processes
(:mod:`kerneltune.pool`) that each run :func:`build` on one config; a build that hangs past its timeout or
crashes its process becomes a failed result and the worker is replaced.  A test or a remote setup hands
its own builder to :class:`kerneltune.measure.Measurer`.

:func:`warm` and :func:`build` run inside a build worker (called by name: ``"kerneltune.builder:build"``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import tvm

from kerneltune import prepack, templates
from kerneltune.pool import WorkerPool
from kerneltune.task import build_func


@dataclass(frozen=True)
class BuilderInput:
    """One config of a task to build."""

    task: object  # kerneltune.task.Task
    config: tuple


@dataclass(frozen=True)
class BuilderResult:
    """A built library (``artifact_path``, with the ``packings`` its inputs need) or ``error``: one of
    ``"invalid config: ..."``, ``"build failed: ..."``, ``"build timeout"``.  ``build_s``: the seconds the
    build took (the worker's own count when it succeeded, the wait for it when it failed)."""

    artifact_path: str | None
    error: str | None
    build_s: float
    packings: tuple = ()


class Builder(Protocol):
    def build(self, inputs: Sequence[BuilderInput]) -> list[BuilderResult]: ...

    def close(self) -> None: ...


# How a worker call's status reads as a build error.
_BUILD_ERRORS = {"invalid": "invalid config: {}", "error": "build failed: {}", "timeout": "build timeout",
                 "crash": "build failed: {}"}


class LocalBuilder:
    """Builds configs in parallel, in ``workers`` spawned processes started once and reused (importing TVM
    costs seconds; ``tvm.s_tir.tensor_intrin`` is never imported).  Libraries go to a private temporary
    folder, removed by :meth:`close`; whoever runs one may delete it after."""

    def __init__(self, target, workers: int, env: dict[str, str], timeout: float = 60.0):
        self.target_json = str(target)
        self.timeout = timeout  # seconds one config's build may take
        self._tmp = tempfile.mkdtemp(prefix="kerneltune-")
        self.pool = WorkerPool(workers, env, "kerneltune.builder:warm")
        self._counter = 0
        self._lock = threading.Lock()

    def _lib_path(self) -> str:
        with self._lock:
            self._counter += 1
            return os.path.join(self._tmp, f"k{self._counter}.so")

    def _build_one(self, item: BuilderInput) -> BuilderResult:
        path = self._lib_path()
        t0 = time.perf_counter()
        status, value = self.pool.call("kerneltune.builder:build", (item.task, item.config, self.target_json, path),
                                       self.timeout)
        waited = time.perf_counter() - t0
        if status != "ok":
            return BuilderResult(None, _BUILD_ERRORS[status].format(value), waited)
        path, build_s, packings = value
        return BuilderResult(path, None, build_s, tuple(packings))

    def build(self, inputs: Sequence[BuilderInput]) -> list[BuilderResult]:
        return self.pool.map(self._build_one, inputs)

    def close(self) -> None:
        self.pool.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


# --- in the build worker ---------------------------------------------------------------------------------

def warm() -> None:
    """Run at worker start: the imports above (TVM, the templates) are done, so timeouts measure work, not
    TVM's import (seconds).  ``tvm.s_tir.tensor_intrin`` (12-19 s) is never imported."""


def build(task, config, target_json: str, out_path: str) -> tuple[str, float, list]:
    """Schedule, compile and export one config; returns (library path, seconds spent, packings).

    A weight-packing copy (``pack = prepack``) is stripped before the build: in the model it runs once at
    build time, so the timed kernel takes the packed weight; the packings say how to pack the inputs.
    """
    t0 = time.perf_counter()
    target = tvm.target.Target(target_json)
    func, packings = prepack.strip(templates.apply(task, config, target))
    lib = build_func(func, target)
    lib.export_library(out_path)
    return out_path, time.perf_counter() - t0, packings
