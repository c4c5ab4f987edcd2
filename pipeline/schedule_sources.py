"""Where a kernel's schedule comes from: an ordered list of sources, the first that schedules the kernel wins
(as MetaSchedule's ordered union of databases answers a query from the first database that has it).

The default order (:func:`schedule_sources`): the tuned configs; the sanity floor's replacements for a default
far under its roofline (:mod:`pipeline.pricing.sanity`); the template's default config; TVM's rules and ours
(:mod:`pipeline.cpu_rules`, dlight on GPUs).  A kernel a pass or MetaSchedule scheduled already is kept before
any source is asked (:func:`pipeline.compile.schedule`).  Each source names itself in report.json's
``schedules`` (``tuned``, ``sanity``, ``template``, ``cpu-rule``, ``dlight``), so a replacement no longer
passes for a tuned config.  A new kind of kernel (int8, Winograd) is a new template the template sources
reach, or a new source in the list, not a new branch in the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import tvm
from tvm.s_tir import dlight as dl

from kerneltune import templates
from kerneltune.targets.registry import TargetSpec
from pipeline.cpu_rules import Injective, LaneReduction, ParallelFallback, RowReduction
from pipeline.partition import FusedTask


class ScheduleSource(Protocol):
    """One place a schedule can come from."""

    label: str  # what report.json's ``schedules`` says for a kernel it scheduled

    def schedule(self, task: FusedTask, target: tvm.target.Target) -> tvm.tirx.PrimFunc | None:
        """The task's kernel scheduled, or None when this source has nothing for it; a source that has one but
        fails to apply it raises (the scheduler notes it and asks the next source)."""


def _template_schedule(task: FusedTask, config: Any | None, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """The template's schedule of ``config`` (None: its default), chosen on the task; a kernel with a symbolic
    extent is scheduled itself with the config of its instance (:mod:`pipeline.symbolic`)."""
    cfg = config if config is not None else templates.default_config(task.task, target)
    return templates.apply(task.scheduled_task, cfg, target)


@dataclass(frozen=True)
class Configs:
    """Template configs by kerneltune task key: the tuner's best (``tuned``), or the sanity floor's
    replacements (``sanity``)."""

    configs: Mapping[str, Any]
    label: str = "tuned"

    def schedule(self, task: FusedTask, target: tvm.target.Target) -> tvm.tirx.PrimFunc | None:
        key = getattr(task.task, "key", None)
        if task.task is None or key not in self.configs:
            return None
        return _template_schedule(task, self.configs[key], target)


@dataclass(frozen=True)
class TemplateDefault:
    """The template's default config, derived from the machine (kerneltune.templates.default_config)."""

    label: str = "template"

    def schedule(self, task: FusedTask, target: tvm.target.Target) -> tvm.tirx.PrimFunc | None:
        return None if task.task is None else _template_schedule(task, None, target)


def cpu_rules() -> list:
    # Injective first: it declines any kernel with a reduction, and dlight's rules start by inlining every
    # block (try_inline), which recomputes reused values exponentially before they decline an elementwise
    # kernel (see pipeline.cpu_rules).
    return [Injective(), LaneReduction(), RowReduction(), dl.cpu.GEMV(), dl.cpu.Reduction(), ParallelFallback()]


def gpu_rules() -> list:
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


@dataclass(frozen=True)
class Rules:
    """TVM's schedule rules (dlight) and ours, the first that applies: every kernel no template covers."""

    rules: Sequence[Any] = field(default_factory=cpu_rules)
    label: str = "cpu-rule"

    def schedule(self, task: FusedTask, target: tvm.target.Target) -> tvm.tirx.PrimFunc | None:
        with target:
            return apply_rules(task.func, target, self.rules)


def apply_rules(func: tvm.tirx.PrimFunc, target: tvm.target.Target, rules: Sequence[Any]) -> tvm.tirx.PrimFunc | None:
    """First rule that schedules ``func`` without a schedule error wins; None when none applies."""
    for rule in rules:
        try:
            sch = rule.apply(func, target, False)
        except RuntimeError:  # ScheduleError and TVM's internal errors (tvm.error.TVMError is gone in 0.27)
            continue  # a rule that matched the pattern but could not transform it: try the next one
        if sch is None:
            continue
        sch = sch[0] if isinstance(sch, list) else sch
        return sch.mod["main"]
    return None


def schedule_sources(spec: TargetSpec, tuned: Mapping[str, Any] | None = None,
                     replaced: Mapping[str, Any] | None = None) -> list[ScheduleSource]:
    """The default order (module docstring); templates on CPUs only (GPU kernels take dlight's rules)."""
    sources: list[ScheduleSource] = []
    if tuned:
        sources.append(Configs(tuned, "tuned"))
    if replaced:
        sources.append(Configs(replaced, "sanity"))
    if not spec.is_gpu:
        sources.append(TemplateDefault())
    sources.append(Rules(gpu_rules(), "dlight") if spec.is_gpu else Rules())
    return sources
