"""Schedule templates: a config (one value per knob of :func:`space_for`) -> a scheduled PrimFunc.

API used by the searchers, the measurer and the pipeline:

* ``space_for(task, target) -> SearchSpace``: the knobs of the template for ``target``'s kind.
* ``apply(task, config, target) -> PrimFunc``: the task's fused PrimFunc scheduled by ``config``, marked
  with the ``tirx.is_scheduled`` attribute (so Relax's default pipeline leaves it alone).  Raises
  :class:`InvalidConfig` for configs rejected before building (not in the space, too many threads, too much
  shared memory).  ``schedule(task, config, target)`` is the same as the ``s_tir.Schedule``, whose trace
  records the primitives (the MetaSchedule export, :mod:`pipeline.ms_export`, stores it).
* ``default_config(task, target) -> config``: a heuristic config used without tuning (the pipeline's
  default for every matmul/conv task).
* ``task_for(name, func) -> Task | None``: a fused PrimFunc as a tuning task, when it has a matmul/conv
  anchor (:func:`kerneltune.task.classify_primfunc`) *and* the CPU template can schedule it with its default
  config, so callers such as the pipeline never meet a schedule error later.

Which family a target kind uses is the ``template`` of its entry in :mod:`kerneltune.targets.registry` (``llvm`` ->
:mod:`.cpu`, Ansor SSRSRS multi-level tiling; ``cuda``/``rocm`` -> :mod:`.gpu`); NCHWc convolutions
(:mod:`kerneltune.templates.conv_nchwc`, llvm only) -> :mod:`.cpu_nchwc`; their Winograd kernel
(:mod:`.winograd_nchwc`) -> :mod:`.cpu_winograd`; u8 x s8 matmuls and implicit-GEMM
NHWC convs by a weight on an x86 CPU (VNNI, or exact 16-bit multiply-adds on AVX2) -> :mod:`.int8`.  For CPU code use
:func:`kerneltune.targets.host.llvm_target` (a bare ``llvm`` target gets no AVX/FMA code at all).
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from ..space import SearchSpace
from ..task import IMPLICIT_CONV, Task, classify_primfunc
from ..targets.registry import kind_of
from . import conv_nchwc, cpu, cpu_nchwc, cpu_winograd, gpu, int8, winograd_nchwc
from .common import InvalidConfig

__all__ = ["space_for", "apply", "schedule", "default_config", "InvalidConfig", "template_for", "task_for"]

FAMILIES = {"cpu": cpu, "gpu": gpu}  # TargetKind.template -> module


def template_for(target: tvm.target.Target):
    """The template module for ``target`` (cpu or gpu); a UserError for kinds without one."""
    return FAMILIES[kind_of(target).template]


def _target(target) -> tvm.target.Target:
    return target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)


def _template(task: Task, t: tvm.target.Target):
    """NCHWc convolutions (a CPU layout, :mod:`kerneltune.templates.conv_nchwc`) have their own CPU template."""
    if task.kind in (conv_nchwc.KIND, winograd_nchwc.KIND):
        if t.kind.name != "llvm":
            from graphopt.errors import UserError

            raise UserError(f"NCHWc convolutions are a CPU layout; no {t.kind.name} template for {task.name}")
        return cpu_nchwc if task.kind == conv_nchwc.KIND else cpu_winograd
    if int8.applies(task, t):  # u8 x s8 products by a weight, where the CPU has a dot-product instruction
        return int8
    return template_for(t)


def space_for(task: Task, target) -> SearchSpace:
    t = _target(target)
    template = _template(task, t)
    return template.space(task, t) if template in (cpu_nchwc, cpu_winograd, int8) else template.space(task)


def schedule(task: Task, config, target) -> s_tir.Schedule:
    """``task.func`` scheduled by ``config``, as the schedule itself: its ``trace`` is the list of primitives
    that made it, which replays on the same PrimFunc (what a MetaSchedule tuning record stores)."""
    t = _target(target)
    return _template(task, t).schedule(task, config, t)


def apply(task: Task, config, target) -> tvm.tirx.PrimFunc:
    t = _target(target)
    template = _template(task, t)
    if hasattr(template, "apply"):   # a template that adds what no schedule primitive expresses (cpu: prefetch)
        return template.apply(task, config, t)
    return template.schedule(task, config, t).mod["main"].with_attr("tirx.is_scheduled", True)


def default_config(task: Task, target):
    t = _target(target)
    return _template(task, t).default_config(task, t)


def task_for(name: str, func: tvm.tirx.PrimFunc) -> Task | None:
    """A fused PrimFunc as a tuning task, or None when it has no anchor or the CPU template cannot schedule
    it (e.g. an epilogue that cannot follow the tiles)."""
    task = (conv_nchwc.classify(name, func) or winograd_nchwc.classify(name, func)
            or classify_primfunc(name, func))
    if task is None:
        return None
    # an implicit-GEMM conv exists only where the int8 pass found a dot-product instruction: checked with the
    # least of them (AVX2's); every other task with the plain CPU template
    target = int8.LEAST_TARGET if task.kind == IMPLICIT_CONV else tvm.target.Target({"kind": "llvm"})
    template = _template(task, target)
    try:
        template.schedule(task, template.default_config(task, target), target)
    except (RuntimeError, ValueError, IndexError):  # ScheduleError and TVM internal errors are RuntimeErrors
        return None
    return task
