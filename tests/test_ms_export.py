"""``tune-kernels MODEL --records FILE --export-metaschedule DIR``: our tuned schedules as a MetaSchedule
JSON database, applied by TVM's own MetaScheduleApplyDatabase (pipeline.ms_export).

The records come from a real tuning run of the model's tasks with the fake measurer (tests/fake_measurer.py:
fixed latencies, nothing timed); the database is then used the way a TVM user would, with no code of ours:
``from_onnx`` on DIR/model.onnx, ``JSONDatabase(work_dir=DIR)``, ``compile_relax``.  The build must equal
onnxruntime, and the kernels the database replaced must be our template's schedule with the best record's
config."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from onnx import TensorProto, helper, numpy_helper

os.environ.setdefault("TVM_NUM_THREADS", "2")

from fake_measurer import FakeMeasurer  # noqa: E402
from graphopt.compare import compare_outputs  # noqa: E402
from graphopt.feeds import random_inputs, run_ort  # noqa: E402
from graphopt.onnx_io import import_onnx  # noqa: E402
from kerneltune import templates  # noqa: E402
from kerneltune.records import Record, RecordLog  # noqa: E402
from kerneltune.targets.parse import parse_target  # noqa: E402
from kerneltune.tune_tasks import TuningRun  # noqa: E402
from pipeline.cli import tune_kernels_main  # noqa: E402
from pipeline.ms_export import FILES, MODEL, export_metaschedule  # noqa: E402
from pipeline.partition import partition  # noqa: E402
from pipeline.relax_import import import_model  # noqa: E402
from pipeline.tuning import tune_model  # noqa: E402

BERT_TINY = Path(__file__).resolve().parents[1] / "models" / "bert_tiny.onnx"


@pytest.fixture(scope="module")
def llvm():
    return parse_target("llvm", 2)


@pytest.fixture(scope="module")
def tuned(llvm, tmp_path_factory):
    """bert_tiny's tasks tuned (60 trials, fake latencies), plus one pre-packed config recorded as the best
    of the first task whose search space offers pre-packing; (imported, partition, records path, that task)."""
    imported = import_model(str(BERT_TINY))
    part = partition(imported.mod)
    records = tmp_path_factory.mktemp("records") / "records.jsonl"
    tune_model(part.tasks, TuningRun(llvm, 60, RecordLog(records), "gradient", "random", progress=False), FakeMeasurer)
    packed = next(t for t in part.tasks if t.task is not None and "prepack" in _pack_values(t.task, llvm))
    space = templates.space_for(packed.task, llvm.target)
    default = space.as_dict(templates.default_config(packed.task, llvm.target))
    # a pre-packed config other than the default (a weight is pre-packed by default): the records keep the
    # first measurement of a config, and the tuning above measured the default
    unroll = next(v for v in next(k for k in space.knobs if k.name == "unroll").values if v != default["unroll"])
    cfg = default | {"pack": "prepack", "unroll": unroll}
    fastest = min(r.latency_s for r in RecordLog(records).load(task=packed.task.key) if r.latency_s)
    lat = fastest / 2
    with RecordLog(records) as log:
        log.append([Record(packed.task.key, str(llvm.target), cfg, packed.task.flops / lat / 1e9, lat)])
    return imported, part, records, packed


def _pack_values(task, spec) -> tuple:
    knob = next((k for k in templates.space_for(task, spec.target).knobs if k.name == "pack"), None)
    return getattr(knob, "values", ())


def _tvm_fused(mod: tvm.IRModule, target) -> tvm.IRModule:
    """What MetaSchedule's compile_relax runs before MetaScheduleApplyDatabase (written out here, not
    imported from pipeline.ms_export: the test plays a TVM user)."""
    from tvm import relax

    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target:
        return tvm.transform.Sequential(passes)(mod)


def test_cli_exports_every_tuned_task_and_says_what_replaced_the_prepacked_one(tuned, llvm, tmp_path, capsys):
    _, part, records, packed = tuned
    out = tmp_path / "db"
    assert tune_kernels_main([str(BERT_TINY), "--records", str(records), "--export-metaschedule", str(out),
                              "--threads", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    n = sum(t.task is not None for t in part.tasks)
    assert lines[-1] == f"wrote {out}/{FILES[0]}, {FILES[1]} and {MODEL}: {n} of {n} tuned tasks exported"
    line = next(ln for ln in lines if f"task {packed.index} {packed.name} " in ln)
    assert line.startswith("exported:") and "stores a weight pre-packed" in line, line
    assert all((out / f).is_file() for f in (*FILES, MODEL))


def test_tvm_applies_the_database_builds_the_model_and_matches_onnxruntime(tuned, llvm, tmp_path):
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx
    from tvm.s_tir import meta_schedule as ms

    imported, part, records, packed = tuned
    out = tmp_path / "db"
    export = export_metaschedule(imported, part, llvm, records, out)
    target = llvm.target
    by_key = {}
    for rec in RecordLog(records).load(target=str(target)):
        if rec.latency_s:
            by_key.setdefault(rec.task, []).append(rec)
    for o in export.exported:  # each exported latency is the task's best record without pre-packing
        recs = by_key[part.tasks[o.index].task.key]
        fits = [r.latency_s for r in recs if r.config.get("pack") != "prepack"]
        if o.ms is None:  # only pre-packed configs measured: their tiles exported without packing, and said so
            assert not fits and "no config without packing was measured" in o.note and o.config.get("pack") != "prepack"
            continue
        assert o.ms == pytest.approx(min(fits) * 1e3)
        best = min(recs, key=lambda r: r.latency_s)
        assert bool(o.note) == (best.config.get("pack") == "prepack"), o  # said when the best was pre-packed
    assert next(o for o in export.outcomes if o.index == packed.index).note

    # A TVM user: the static model.onnx, the database, TVM's own passes.
    mod = from_onnx(onnx.load(str(out / MODEL)), keep_params_in_input=False)
    db = ms.database.JSONDatabase(work_dir=str(out), allow_missing=False)
    fused = _tvm_fused(mod, target)
    with target, db, tvm.transform.PassContext(opt_level=3):
        applied = relax.transform.MetaScheduleApplyDatabase()(fused)
    replaced = {gv.name_hint: f for gv, f in applied.functions.items()
                if isinstance(f, tvm.tirx.PrimFunc) and "tirx.is_scheduled" in f.attrs}
    assert sorted(replaced) == sorted(o.tvm_name for o in export.exported)
    normalize = tvm.get_global_func("tvm.s_tir.meta_schedule.normalize_mod")
    for o in export.exported:  # what replaced it is our template's schedule with the exported config
        workload = normalize(fused[o.tvm_name])
        task = templates.task_for(o.tvm_name, workload["main"])
        space = templates.space_for(task, target)
        ours = templates.schedule(task, space.from_dict(o.config), target).mod["main"]
        assert tvm_ffi.structural_equal(replaced[o.tvm_name].body, ours.body, map_free_vars=True), o.tvm_name

    ex = ms.relax_integration.compile_relax(db, mod, target, params=None)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    feeds = random_inputs(import_onnx(onnx.load(str(BERT_TINY))), 0)
    result = vm["main"](*[tvm.runtime.tensor(feeds[i.name]) for i in mod["main"].params])
    got = [r.numpy() for r in result] if not hasattr(result, "numpy") else [result.numpy()]
    assert compare_outputs(run_ort(str(BERT_TINY), feeds), got).ok


def test_nchwc_convolutions_are_not_exported_and_the_cli_says_why(llvm, tmp_path, capsys):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"])], "conv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "conv.onnx"
    onnx.save(model, str(path))
    from pipeline.layout.search import partition_model

    part = partition_model(import_model(str(path)).mod, llvm, "nchwc")
    assert {t.kind for t in part.tasks if t.task is not None} == {"conv2d_nchwc"}
    records = tmp_path / "records.jsonl"
    tune_model(part.tasks, TuningRun(llvm, 8, RecordLog(records), "gradient", "random", progress=False), FakeMeasurer)
    capsys.readouterr()
    assert tune_kernels_main([str(path), "--layout", "nchwc", "--records", str(records), "--threads", "2",
                              "--export-metaschedule", str(tmp_path / "db")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "nothing could be exported" in err[0] and "NCHWc" in err[0], err
    assert "--layout nchw" in err[0] and not (tmp_path / "db" / FILES[0]).exists()


def test_export_needs_records_of_the_target(tuned, tmp_path, capsys):
    _, _, records, _ = tuned
    assert tune_kernels_main([str(BERT_TINY), "--export-metaschedule", str(tmp_path / "db")]) == 2
    assert "add --records FILE" in capsys.readouterr().err
    assert tune_kernels_main([str(BERT_TINY), "--records", str(records), "--threads", "1",
                              "--export-metaschedule", str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err
    assert "no records for target" in err and "\"num-cores\":2" in err, err
