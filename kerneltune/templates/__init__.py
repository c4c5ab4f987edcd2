"""Schedule templates: a config (one value per knob of :func:`space_for`) -> a scheduled PrimFunc.

API used by the searchers, the measurer and the pipeline:

* ``space_for(task, target) -> SearchSpace``: the knobs of the template for ``target``'s kind.
* ``apply(task, config, target) -> PrimFunc``: the task's fused PrimFunc scheduled by ``config``, marked
  with the ``tirx.is_scheduled`` attribute (so Relax's default pipeline leaves it alone).  Raises
  :class:`InvalidConfig` for configs rejected before building (not in the space, too many threads, too much
  shared memory).
* ``default_config(task, target) -> config``: a heuristic config used without tuning (the pipeline's
  default for every matmul/conv task).

``llvm`` -> :mod:`.cpu` (Ansor SSRSRS multi-level tiling), ``cuda``/``rocm`` -> :mod:`.gpu`.

``host_target(num_cores)``: the llvm target for this CPU (with ``mcpu``; a bare ``llvm`` target gets no
AVX/FMA code at all -- use this, or name ``mcpu`` yourself).
"""
from __future__ import annotations

import tvm

from ..space import SearchSpace
from ..task import Task
from . import cpu, cpu_nchwc, gpu
from .common import InvalidConfig
from .cpu import host_target

__all__ = ["space_for", "apply", "default_config", "InvalidConfig", "template_for", "host_target"]


def template_for(target: tvm.target.Target):
    """The template module for ``target`` (cpu or gpu); a UserError for kinds without one."""
    kind = target.kind.name
    if kind == "llvm":
        return cpu
    if kind in ("cuda", "rocm"):
        return gpu
    from graphopt.errors import UserError

    raise UserError(f"no schedule template for target kind {kind!r}; use llvm, cuda or rocm")


def _target(target) -> tvm.target.Target:
    return target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)


def _template(task: Task, t: tvm.target.Target):
    """NCHWc convolutions (a CPU layout) have their own CPU template; everything else goes by target."""
    from ..conv_nchwc import KIND

    if task.kind == KIND:
        if t.kind.name != "llvm":
            from graphopt.errors import UserError

            raise UserError(f"NCHWc convolutions are a CPU layout; no {t.kind.name} template for {task.name}")
        return cpu_nchwc
    return template_for(t)


def space_for(task: Task, target) -> SearchSpace:
    t = _target(target)
    return _template(task, t).space(task)


def apply(task: Task, config, target) -> tvm.tirx.PrimFunc:
    t = _target(target)
    return _template(task, t).apply(task, config, t)


def default_config(task: Task, target):
    t = _target(target)
    return _template(task, t).default_config(task, t)
