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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import onnx
import tvm
from tvm import relax

from graphopt.compare import Comparison, compare_runs
from graphopt.quant_tolerance import model_tolerance
from graphopt.feeds import CHECK_INPUT_SETS, feed_sets, run_ort_sets
from graphopt.fileio import atomic_path, write_bytes_atomic
from graphopt.ir import Graph
from kerneltune.machine_gate import building, serial
from kerneltune.native_log import quiet_native_stderr
from kerneltune.prepack import split_weight_packing
from kerneltune import stack_locals
from pipeline.artifact import outputs_numpy  # noqa: F401 - the one flattening of VM results; callers import it from here too
from pipeline.artifact import synced
from kerneltune.targets.registry import TargetSpec, device_for
from pipeline import cpu_pool
from pipeline.partition import FusedTask, Partition
from pipeline.passes.fold import fold_constants
from pipeline.passes.int8 import SCHEDULED_BY
from pipeline.passes.shape_cse import dedup_heap_reads
from pipeline.relax_import import ImportedModel
from pipeline.schedule_sources import ScheduleSource, schedule_sources

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


def schedule(part: Partition, spec: TargetSpec, tuned: dict[str, Any] | None = None,
             base: tvm.IRModule | None = None, replaced: dict[str, Any] | None = None,
             ) -> tuple[tvm.IRModule, dict[str, str]]:
    """Return the fused module with every kernel scheduled, and how each task was scheduled: by the first of
    :func:`pipeline.schedule_sources.schedule_sources` that has a schedule for it (``tuned``: the tuner's best
    configs by kerneltune task key; ``replaced``: the sanity floor's; the template defaults, the rules).

    ``base`` replaces the partition's module (e.g. with MetaSchedule's schedules applied); kernels it
    already marks as scheduled are kept, as are those a pass scheduled when it wrote them.
    """
    sources = schedule_sources(spec, tuned, replaced)
    target = spec.target
    mod = (base or part.mod).clone()  # never schedule the partition's own module in place
    how: dict[str, str] = {}
    for task in part.tasks:
        current = mod[task.names[0]]
        if "tirx.is_scheduled" in current.attrs and bool(current.attrs["tirx.is_scheduled"]):
            # scheduled before we got here: by a pass that wrote the kernel (pipeline.passes.int8's gathers name
            # themselves), else MetaSchedule's database
            how[task.name] = str(current.attrs.get(SCHEDULED_BY, "metaschedule"))
            continue
        func, how[task.name] = _first_schedule(task, target, sources)
        if func is None:
            continue
        func = func.with_attr("tirx.is_scheduled", True)
        for name in task.names:
            gv = mod.get_global_var(name)
            mod[gv] = func.with_attr("global_symbol", name) if "global_symbol" in task.func.attrs else func
    return mod, how


def _first_schedule(task: FusedTask, target: tvm.target.Target,
                    sources: Sequence[ScheduleSource]) -> tuple[tvm.tirx.PrimFunc | None, str]:
    """(the first source's schedule of ``task``, its label with the failures before it noted); a source that
    fails costs speed, not the build: the next one is asked."""
    note = ""
    for source in sources:
        try:
            func = source.schedule(task, target)
        except Exception as exc:  # noqa: BLE001 - a template bug must cost speed, not the build
            note += f" ({source.label} failed: {type(exc).__name__}: {str(exc).strip()[:120]})"
            log.warning("warning: %s schedule of %s failed (%s); falling back", source.label, task.name, exc)
            continue
        if func is not None:
            return func, source.label + note
    return None, "none" + note


def build(mod: tvm.IRModule, spec: TargetSpec) -> relax.VMExecutable:
    """relax.build of an already fused and scheduled module (the default pipeline only lowers it now),
    after running the kernels' weight-packing copies on the constant weights (kerneltune.prepack, folded by
    :func:`pipeline.passes.fold.fold_constants`); a served build's repeated shape objects are made once
    (:mod:`pipeline.passes.shape_cse`)."""
    kernels = {gv.name_hint for gv in mod.get_global_vars()}
    pipeline = tvm.transform.Sequential([relax.get_pipeline("default"), _helpers_noalias(kernels),
                                         dedup_heap_reads])
    with serial():
        mod = fold_constants(split_weight_packing(mod))
    # lowering and code generation: side by side with another build's (kerneltune.machine_gate); TVM's codegen
    # notes ("Unknown pragma pragma_scope") are not the user's business
    with building(), quiet_native_stderr():
        return relax.build(mod, spec.target, relax_pipeline=pipeline, tir_pipeline=stack_locals.PIPELINE)


def _helpers_noalias(kept: set[str]):
    """A pass marking ``tirx.noalias`` on the PrimFuncs Relax's lowering adds (the VM's ``shape_func`` and
    ``compute_symbolic_expr`` of a build with symbolic sizes) that take at most one pointer: trivially true
    for them, and what keeps every kernel's pointers restricted.  TVM's LLVM codegen (0.27,
    ``CodeGenLLVM::DeclareFunctionInternal``) sets its ``is_restricted_`` flag when it *declares* a function
    and returns early for one declared before, so each function of the module is compiled with the flag of
    the last one declared.  When that is a helper without the attribute, every kernel's buffers may alias:
    LLVM stores a matmul's accumulators after every FMA and reloads its operands (a served 128x3072x768
    matmul, alone in a model: 4.9 ms against 2.0 for the same kernel with the flag; Intel Xeon, 2 threads)."""
    @tvm.transform.module_pass(opt_level=0, name="HelpersNoAlias")
    def mark(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod
        for gv, func in mod.functions_items():
            if (not isinstance(func, tvm.tirx.PrimFunc) or gv.name_hint in kept or func.attrs is not None
                    and func.attrs.get("tirx.noalias")):
                continue
            if sum(not isinstance(p.ty, tvm.ir.PrimType) for p in func.params) <= 1:  # one buffer or pointer
                out[gv] = func.with_attr("tirx.noalias", True)
        return out
    return mark


def compile_partition(imported: ImportedModel, part: Partition, spec: TargetSpec,
                      tuned: dict[str, Any] | None = None, base: tvm.IRModule | None = None,
                      replaced: dict[str, Any] | None = None) -> CompiledModel:
    t0 = time.perf_counter()
    with serial():
        mod, how = schedule(part, spec, tuned, base, replaced)
    ex = build(mod, spec)
    return CompiledModel(ex, spec, imported.input_names, how, time.perf_counter() - t0)


def to_device(feeds: dict[str, np.ndarray], names: Sequence[str], dev) -> list:
    return [tvm.runtime.tensor(feeds[n], dev) for n in names]


def model_runner(compiled: CompiledModel, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    """One inference of ``compiled`` on ``feeds`` (already on the device), returning when the result is
    ready: a runner for :mod:`graphopt.timing`."""
    dev = device_for(compiled.spec)
    return synced(compiled.vm()["main"], to_device(feeds, compiled.input_names, dev), dev)



def run(vm: relax.VirtualMachine, args: list) -> list[np.ndarray]:
    return outputs_numpy(vm["main"](*args))


def check_outputs(compiled: CompiledModel, graph: Graph, reference: onnx.ModelProto, seed: int = 0,
                  threads: int = 0, samples: dict[str, np.ndarray] | None = None,
                  count: int = CHECK_INPUT_SETS) -> Comparison:
    """Run TVM and onnxruntime (on ``reference``) on the same inputs - the samples, or ``count`` seeded random
    sets drawn for ``graph`` - and compare."""
    sets = feed_sets(graph, seed, samples, count)
    refs = run_ort_sets(reference, sets, threads)
    quantized = model_tolerance(reference, sets, refs, threads)  # a quantized model: per-output allowances
    vm, dev = compiled.vm(), device_for(compiled.spec)
    check = compare_runs([(ref, run(vm, to_device(feeds, compiled.input_names, dev))) for feeds, ref in zip(sets, refs)],
                         quantized.tolerances if quantized else None)
    check.quantization = quantized.to_json() if quantized else None
    return check
