"""The builder: one config of a task scheduled, compiled and exported as a shared library.

Runs inside a build worker (:mod:`kerneltune.pool`); the measurer sends it tasks and configs.
"""
from __future__ import annotations

import time

import tvm

from kerneltune import prepack, templates
from kerneltune.task import build_func


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
