"""Our best tuned schedules as a MetaSchedule JSON database that TVM's own tools apply
(``tune-kernels MODEL --records FILE --export-metaschedule DIR``).

MetaSchedule's ``JSONDatabase`` is two files, ``database_workload.json`` (PrimFuncs, keyed by structural
hash) and ``database_tuning_record.json`` (per workload: a schedule *trace* and its run time).
``relax.transform.MetaScheduleApplyDatabase`` - run by ``meta_schedule.relax_integration.compile_relax`` and
by relax's ``zero`` pipeline - looks every PrimFunc of a fused module up by structure and replaces it by the
best record's trace replayed on it (https://tvm.apache.org/docs/reference/api/python/meta_schedule.html).
Our templates are written with ``s_tir.Schedule`` primitives (:func:`kerneltune.templates.schedule`), so
their traces are such records.

The workload must be the PrimFunc as *TVM's* flow fuses it (the target's dispatch passes, LegalizeOps,
AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR: :data:`TVM_FUSION`), and our pipeline fuses
differently (fast math, :mod:`pipeline.passes.fast_sigmoid`, the weights marked for pre-packing, the NCHWc layout),
so our tasks' PrimFuncs are not TVM's.  Each of TVM's anchor kernels (a matmul or conv a template covers) is
paired with ours by position in the model - the anchor kernels in call order, when both lists have the same
operator, shape and dtype at every position -, our template is applied to TVM's PrimFunc with our best
measured config that fits it, and that schedule's trace is the record.  DIR also gets ``model.onnx``, the
static graph TVM's importer converted, which is the module the database applies to (with a dynamic model,
its symbolic sizes fixed and shape arithmetic folded as ``--input-shape`` says).

Not everything can be expressed (the CLI says, per task, what was exported and what not, and why):

* a config that stores a weight pre-packed (``pack=prepack``, :mod:`kerneltune.prepack`) relies on our
  build splitting the packing out of the kernel and folding it into the weights, a graph rewrite
  MetaScheduleApplyDatabase does not make: the task's best config *without* pre-packing is exported;
* NCHWc convolutions exist only in our layout stage's rewritten graph (TVM's flow keeps NCHW): not
  exported (tune with ``--layout nchw`` to export convolutions);
* a kernel TVM's fusion does not make (fusion differs around it): not exported.

Every record written is read back and replayed on its workload before the files are replaced.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import tvm
from tvm import relax

from graphopt.errors import UserError
from graphopt.fileio import check_output_dir, write_bytes_atomic
from kerneltune import templates
from kerneltune.templates.conv_nchwc import KIND as NCHWC
from kerneltune.records import Record, RecordLog
from kerneltune.targets.registry import TargetSpec, gflops_ceiling
from kerneltune.task import Task
from kerneltune.tune import ResultCache
from kerneltune.space import SearchSpace
from pipeline.partition import Partition, call_sites
from pipeline.relax_import import ImportedModel, importer_output

TVM_FUSION = ("LegalizeOps", "AnnotateTIROpPattern", "FoldConstant", "FuseOps", "FuseTIR")
FILES = ("database_workload.json", "database_tuning_record.json")
MODEL = "model.onnx"
PREPACK_NOTE = ("its best config stores a weight pre-packed, a graph rewrite MetaScheduleApplyDatabase does not "
                "make")


@dataclass
class Outcome:
    """One of our tuned tasks in the export: exported (with the config and its latency) or why not."""

    index: int
    name: str
    exported: bool
    tvm_name: str = ""  # the PrimFunc in TVM's fused module
    config: dict | None = None
    ms: float | None = None
    note: str = ""  # why not exported, or what was exported instead of the best

    def line(self) -> str:
        head = f"task {self.index} {self.name}"
        if not self.exported:
            return f"not exported: {head}: {self.note}"
        text = f"exported: {head} as {self.tvm_name}" + (f" ({self.ms:.4f} ms)" if self.ms is not None else "")
        return f"{text}; {self.note}" if self.note else text


@dataclass
class Export:
    directory: Path
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def exported(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.exported]

    def summary(self) -> str:
        return (f"wrote {self.directory}/{FILES[0]}, {FILES[1]} and {MODEL}: {len(self.exported)} of "
                f"{len(self.outcomes)} tuned tasks exported")


def tvm_fusion(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """``mod`` fused as MetaSchedule's ``compile_relax`` fuses it before applying a database."""
    from tvm.relax import pipeline as relax_pipeline

    try:
        dispatch = list(relax_pipeline.library_dispatch_passes(target))
    except (ValueError, AttributeError):  # a target kind without dispatch passes
        dispatch = []
    with target:
        return tvm.transform.Sequential(dispatch + [getattr(relax.transform, p)() for p in TVM_FUSION])(mod)


def _as_tvm_imports(model: onnx.ModelProto) -> tvm.IRModule:
    """``model`` (the model.onnx written) as TVM's own ONNX importer makes it for a user, without the
    pipeline's import rewrites (constant folding, padded weights): its kernels' names are the database's."""
    from tvm.relax.frontend.onnx import from_onnx

    with importer_output():
        return from_onnx(model, keep_params_in_input=False)


def _signature(task: Task) -> tuple:
    return task.kind, tuple(task.dims.items()), task.dtype


def anchor_kernels(mod: tvm.IRModule) -> list[tuple[str, Task]]:
    """(global name, task) of every call of a kernel a template covers, in call order."""
    out = []
    for gv, _, _ in call_sites(mod):
        func = mod[gv]
        task = templates.task_for(gv.name_hint, func) if isinstance(func, tvm.tirx.PrimFunc) else None
        if task is not None:
            out.append((gv.name_hint, task))
    return out


def export_metaschedule(imported: ImportedModel, part: Partition, spec: TargetSpec, records_path: str | Path,
                        out_dir: str | Path) -> Export:
    """Write the database for ``imported`` (fused by us into ``part``) from the records at ``records_path``
    (those of ``spec``'s target) into ``out_dir``; module docstring."""
    out = check_output_dir(out_dir, "--export-metaschedule")
    target = spec.target
    records = _records_by_task(RecordLog(records_path), str(target), records_path)
    tuned = [t for t in part.tasks if t.task is not None and t.task.key in records]
    if not tuned:
        raise UserError(f"{records_path} holds no records of this model's tasks for target {target}: pass the "
                        "model (DIR/optimized.onnx with its --input-shape) and the --target/--threads the tuning "
                        "run used")
    normalize = tvm.get_global_func("tvm.s_tir.meta_schedule.normalize_mod")
    ours = anchor_kernels(part.mod)
    theirs = anchor_kernels(tvm_fusion(_as_tvm_imports(imported.converted or imported.onnx_model), target))
    aligned = [_signature(t) for _, t in ours] == [_signature(t) for _, t in theirs]
    site_of = {name: k for k, (name, _) in reversed(list(enumerate(ours)))}  # first call of each kernel
    export = Export(out)
    chosen: dict[str, tuple] = {}  # TVM kernel -> (workload module, trace, latency)
    for ft in tuned:
        outcome = Outcome(ft.index, ft.name, False)
        export.outcomes.append(outcome)
        if ft.kind == NCHWC:
            outcome.note = ("an NCHWc convolution, a layout our layout stage rewrites the graph into (TVM's flow keeps "
                            "NCHW): tune with --layout nchw to export it")
            continue
        k = next((site_of[n] for n in ft.names if n in site_of), None)
        if not aligned or k is None:
            outcome.note = "TVM's own fusion makes no kernel at its place in the model (the fusion differs around it)"
            continue
        tvm_name = theirs[k][0]
        if tvm_name in chosen:
            outcome.note = f"its kernel {tvm_name} is exported for an earlier task"
            continue
        workload = normalize(theirs[k][1].func)
        task = templates.task_for(tvm_name, workload["main"])
        space = templates.space_for(task, target)
        ours = templates.space_for(ft.task, target)
        cache = ResultCache(ours, records[ft.task.key], ft.task.flops, gflops_ceiling(target), ft.task.key)
        best, fitting = cache.best(), cache.best(lambda c: _as_theirs(c, ours, space) is not None)
        unpacked = _unpacked(best[0], ours, space) if fitting is None and best is not None else None
        if fitting is None and unpacked is None:
            outcome.note = "no measured config of it fits TVM's kernel"
            continue
        rec = (fitting or best)[1]
        config = _as_theirs(fitting[0], ours, space) if fitting else unpacked
        if fitting is None:  # only pre-packed configs measured (a matrix-vector product's default packs)
            outcome.note = (f"{PREPACK_NOTE}, and no config without packing was measured: exported its tiles "
                            f"without packing, with the pre-packed latency ({rec.latency_s * 1e3:.4f} ms)")
        elif best is not None and best[0] != fitting[0]:  # the best does not fit TVM's kernel
            prepacked = best[1].config.get("pack") == "prepack"
            why = PREPACK_NOTE if prepacked else "its best config does not fit TVM's kernel"
            outcome.note = f"{why} ({best[1].latency_s * 1e3:.4f} ms): exported the best config that fits"
        sch = templates.schedule(task, config, target)
        chosen[tvm_name] = (workload, sch.trace, rec.latency_s)
        outcome.exported, outcome.tvm_name, outcome.config = True, tvm_name, space.as_dict(config)
        outcome.ms = rec.latency_s * 1e3 if fitting else None
    if not chosen:
        raise UserError("nothing could be exported: " + "; ".join(o.line() for o in export.outcomes))
    _write(out, chosen, target)
    write_bytes_atomic(out / MODEL, imported.converted.SerializeToString())
    return export


def _as_theirs(config: tuple, ours: SearchSpace, theirs: SearchSpace) -> tuple | None:
    """Our config as a point of TVM's kernel's space, or None.  TVM's kernel takes the weight as a plain
    parameter, so its space lacks the knobs only a weight has: a matrix-vector product's ``pack`` knob
    (none/prepack) is absent there, and ``pack=none`` is the same schedule as no knob."""
    d = ours.as_dict(config)
    if "pack" not in theirs.names and d.get("pack") == "none":
        del d["pack"]
    if set(d) != set(theirs.names):
        return None
    c = theirs.from_dict(d)
    return c if theirs.contains(c) else None


def _unpacked(config: tuple, ours: SearchSpace, theirs: SearchSpace) -> tuple | None:
    """A pre-packed config of ours with ``pack=none`` instead, as a point of TVM's kernel's space (None if
    it is not pre-packed or does not fit): the same tiles, the weight read in place."""
    d = ours.as_dict(config)
    if d.get("pack") != "prepack":
        return None
    return _as_theirs(ours.from_dict(d | {"pack": "none"}), ours, theirs)


def _records_by_task(log: RecordLog, target: str, path: str | Path) -> dict[str, list[Record]]:
    """The records of ``target`` by task key, of one timing: "cold" (how optimize-model measures) where a task
    has such records, else "warm".  A UserError naming the file's targets when it has none of ``target``."""
    all_records = log.load()
    if not all_records:
        raise UserError(f"{path} holds no tuning records: tune first (optimize-model MODEL --trials N --records "
                        f"{path} -o DIR)")
    mine = [r for r in all_records if r.target == target]
    if not mine:
        targets = sorted({r.target for r in all_records})
        raise UserError(f"{path} holds no records for target {target} (it has: {'; '.join(targets)[:400]}): pass "
                        "the --target and --threads the tuning run used")
    by_task: dict[str, list[Record]] = {}
    for rec in mine:
        by_task.setdefault(rec.task, []).append(rec)
    for key, recs in by_task.items():
        cold = [r for r in recs if r.timing == "cold"]
        by_task[key] = cold or recs
    return by_task


def _write(out: Path, chosen: dict[str, tuple], target: tvm.target.Target) -> None:
    """Commit the records to a JSONDatabase in a scratch folder, read them back and replay each on its
    workload, then replace DIR's files atomically."""
    from tvm.s_tir import meta_schedule as ms

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".ms-export-") as scratch:
        db = ms.database.JSONDatabase(work_dir=scratch)
        for name in sorted(chosen):
            workload, trace, latency = chosen[name]
            entry = db.commit_workload(workload)
            db.commit_tuning_record(ms.database.TuningRecord(
                trace, entry, [latency], target, ms.arg_info.ArgInfo.from_prim_func(workload["main"])))
        again = ms.database.JSONDatabase(work_dir=scratch, allow_missing=False)
        for name in sorted(chosen):
            if again.query_schedule(chosen[name][0], target, name) is None:
                raise RuntimeError(f"the exported record of {name} does not replay on its workload")
        for f in FILES:
            write_bytes_atomic(out / f, (Path(scratch) / f).read_bytes())
