"""Schedule every fused kernel, build the model for the target, export it and run it on the Relax VM.

Which schedule a kernel gets, in order of preference:

1. a tuned config (from the tuning records) for its task, applied with the kernel template;
2. on ``llvm``, a matmul/conv kernel gets the template's heuristic ``default_config`` (tiling + vectorize +
   parallel) - TVM's unscheduled loops are scalar and single-threaded, ~100x slower on BERT;
3. on GPUs, dlight's default rules (an unscheduled PrimFunc built for cuda silently becomes a CPU loop);
4. on ``llvm``, everything else gets dlight's CPU rules (reductions such as softmax / layer norm) or
   :mod:`pipeline.cpu_rules` (elementwise and layout kernels: parallel + vectorize).

The result is checked against onnxruntime before anything is written (:func:`check_outputs`, with
:mod:`graphopt.compare`), because a wrong schedule is worse than a slow one.
"""
from __future__ import annotations

import logging
import os
import struct
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from graphopt.compare import Comparison, compare_runs
from graphopt.quant_tolerance import model_tolerance
from graphopt.feeds import feed_sets, run_ort_sets
from graphopt.fileio import atomic_path, write_bytes_atomic
from graphopt.ir import Graph
from kerneltune import templates
from kerneltune.native_log import quiet_native_stderr
from kerneltune.prepack import fold_weight_packing
from pipeline.artifact import outputs_numpy  # noqa: F401 - the one flattening of VM results; callers import it from here too
from kerneltune.targets.registry import TargetSpec, device_for
from pipeline import cpu_pool
from pipeline.cpu_rules import Injective, LaneReduction, ParallelFallback, RowReduction
from pipeline.partition import FusedTask, Partition
from pipeline.int8 import SCHEDULED_BY
from pipeline.relax_import import ImportedModel

log = logging.getLogger(__name__)

@dataclass
class CompiledModel:
    """A built model plus how each kernel was scheduled (for report.json)."""

    executable: relax.VMExecutable
    spec: TargetSpec
    input_names: list[str]
    schedules: dict[str, str] = field(default_factory=dict)  # task name -> tuned|template|dlight|cpu-rule|none
    build_s: float = 0.0

    def vm(self) -> relax.VirtualMachine:
        return relax.VirtualMachine(self.executable, device_for(self.spec))

    def export(self, path: str | os.PathLike) -> Path:
        """Write the shared library atomically (linked by the cross gcc for another CPU architecture); for rocm also the AMDGPU code object next to it (``.hsaco``),
        which is what a ROCm runtime loads and what shows the build really targeted an AMD GPU."""
        p = Path(path)
        fcompile = None
        compiler = self.spec.cross.compiler if self.spec.cross is not None else None
        if compiler is not None:  # another CPU architecture: its gcc links (LLVM emitted the objects)
            from tvm.support import cc

            fcompile = cc.cross_compiler(compiler)
        with tempfile.TemporaryDirectory() as work, atomic_path(p) as tmp, quiet_native_stderr():
            # a CPU library carries its own parallel launcher (pipeline.cpu_pool): tail latency on shared cores
            launcher = cpu_pool.object_file(Path(work), compiler) if self.spec.kind == "llvm" else None
            self.executable.export_library(str(tmp), fcompile=fcompile, addons=[str(launcher)] if launcher else None)
        if self.spec.kind == "rocm":
            objs = amdgpu_code_objects(p.read_bytes())
            if objs:
                write_bytes_atomic(p.with_suffix(".hsaco"), objs[0])
        return p


EM_AMDGPU = 224  # ELF e_machine of AMD GPU code objects


def amdgpu_code_objects(blob: bytes) -> list[bytes]:
    """The AMDGPU ELF code objects embedded in a host library (found by their ELF header and cut at the
    end of their section header table, which the AMDGPU linker puts last)."""
    out, i = [], blob.find(b"\x7fELF", 1)
    while i >= 0:
        if len(blob) >= i + 64 and struct.unpack_from("<H", blob, i + 18)[0] == EM_AMDGPU:
            shoff = struct.unpack_from("<Q", blob, i + 0x28)[0]
            shentsize, shnum = struct.unpack_from("<HH", blob, i + 0x3A)
            end = i + shoff + shentsize * shnum
            if end <= len(blob):
                out.append(blob[i:end])
        i = blob.find(b"\x7fELF", i + 4)
    return out


def _cpu_rules() -> list:
    # Injective first: it declines any kernel with a reduction, and dlight's rules start by inlining every
    # block (try_inline), which recomputes reused values exponentially before they decline an elementwise
    # kernel (see pipeline.cpu_rules).
    return [Injective(), LaneReduction(), RowReduction(), dl.cpu.GEMV(), dl.cpu.Reduction(), ParallelFallback()]


def _gpu_rules() -> list:
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def _apply_rules(func: tvm.tirx.PrimFunc, target: tvm.target.Target, rules: list) -> tvm.tirx.PrimFunc | None:
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


def _template_schedule(task: FusedTask, config: Any | None, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """The template's schedule of ``config`` (None: its default), chosen on the task; a kernel with a symbolic
    extent is scheduled itself with the config of its instance (:mod:`pipeline.symbolic`)."""
    cfg = config if config is not None else templates.default_config(task.task, target)
    return templates.apply(replace(task.task, func=task.func) if task.symbolic else task.task, cfg, target)


def schedule(part: Partition, spec: TargetSpec, tuned: dict[str, Any] | None = None,
             base: tvm.IRModule | None = None) -> tuple[tvm.IRModule, dict[str, str]]:
    """Return the fused module with every kernel scheduled, and how each task was scheduled.

    ``tuned`` maps a kerneltune task key to its best config; tasks without an entry get the defaults.
    ``base`` replaces the partition's module (e.g. with MetaSchedule's schedules applied); kernels it
    already marks as scheduled are kept.
    """
    tuned = tuned or {}
    target = spec.target
    mod = (base or part.mod).clone()  # never schedule the partition's own module in place
    how: dict[str, str] = {}
    rules = _gpu_rules() if spec.is_gpu else _cpu_rules()
    for task in part.tasks:
        current = mod[task.names[0]]
        if "tirx.is_scheduled" in current.attrs and bool(current.attrs["tirx.is_scheduled"]):
            # scheduled before we got here: by a pass that wrote the kernel (pipeline.int8's gathers name
            # themselves), else MetaSchedule's database
            how[task.name] = str(current.attrs.get(SCHEDULED_BY, "metaschedule"))
            continue
        func, source, note = None, "none", ""
        key = getattr(task.task, "key", None)
        attempts = []
        if task.task is not None and key in tuned:
            attempts.append(("tuned", tuned[key]))
        if task.task is not None and not spec.is_gpu:
            attempts.append(("template", None))
        for label, config in attempts:
            try:
                func, source = _template_schedule(task, config, target), label
                break
            except Exception as exc:  # noqa: BLE001 - a template bug must cost speed, not the build
                note += f" ({label} failed: {type(exc).__name__}: {str(exc).strip()[:120]})"
                log.warning("warning: %s schedule of %s failed (%s); falling back", label, task.name, exc)
        if func is None:
            with target:
                func = _apply_rules(task.func, target, rules)
            source = ("dlight" if spec.is_gpu else "cpu-rule") if func is not None else "none"
        how[task.name] = source + note
        if func is None:
            continue
        func = func.with_attr("tirx.is_scheduled", True)
        for name in task.names:
            gv = mod.get_global_var(name)
            mod[gv] = func.with_attr("global_symbol", name) if "global_symbol" in task.func.attrs else func
    return mod, how


def build(mod: tvm.IRModule, spec: TargetSpec) -> relax.VMExecutable:
    """relax.build of an already fused and scheduled module (the default pipeline only lowers it now),
    after running the kernels' weight-packing copies on the constant weights (kerneltune.prepack)."""
    with quiet_native_stderr():  # TVM's codegen notes ("Unknown pragma pragma_scope"): not the user's business
        return relax.build(fold_weight_packing(mod), spec.target)


def compile_partition(imported: ImportedModel, part: Partition, spec: TargetSpec,
                      tuned: dict[str, Any] | None = None, base: tvm.IRModule | None = None) -> CompiledModel:
    t0 = time.perf_counter()
    mod, how = schedule(part, spec, tuned, base)
    ex = build(mod, spec)
    return CompiledModel(ex, spec, imported.input_names, how, time.perf_counter() - t0)


def to_device(feeds: dict[str, np.ndarray], names: Sequence[str], dev) -> list:
    return [tvm.runtime.tensor(feeds[n], dev) for n in names]


def model_runner(compiled: CompiledModel, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    """One inference of ``compiled`` on ``feeds`` (already on the device), returning when the result is
    ready: a runner for :mod:`graphopt.timing`."""
    dev = device_for(compiled.spec)
    main = compiled.vm()["main"]
    args = to_device(feeds, compiled.input_names, dev)

    def run() -> object:
        out = main(*args)
        dev.sync()
        return out

    return run



def run(vm: relax.VirtualMachine, args: list) -> list[np.ndarray]:
    return outputs_numpy(vm["main"](*args))


def check_outputs(compiled: CompiledModel, graph: Graph, reference: onnx.ModelProto, seed: int = 0,
                  threads: int = 0, samples: dict[str, np.ndarray] | None = None) -> Comparison:
    """Run TVM and onnxruntime (on ``reference``) on the same inputs - the samples, or
    :data:`~graphopt.feeds.CHECK_INPUT_SETS` seeded random sets drawn for ``graph`` - and compare."""
    sets = feed_sets(graph, seed, samples)
    refs = run_ort_sets(reference, sets, threads)
    quantized = model_tolerance(reference, sets, refs, threads)  # a quantized model: per-output allowances
    vm, dev = compiled.vm(), device_for(compiled.spec)
    check = compare_runs([(ref, run(vm, to_device(feeds, compiled.input_names, dev))) for feeds, ref in zip(sets, refs)],
                         quantized.tolerances if quantized else None)
    check.quantization = quantized.to_json() if quantized else None
    return check
