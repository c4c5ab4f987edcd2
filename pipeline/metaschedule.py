"""The baseline ``bench-model`` compares our tuning against: TVM's MetaSchedule with the same trial budget.

MetaSchedule (evolutionary search + XGBoost cost model, gradient task scheduler) tunes the same fused
module our pipeline compiles; its database is applied, and kernels it did not get to (small budgets) get
the same default schedules as ours, so the difference between the two is the tuning alone.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import tvm
from tvm import relax

from graphopt.errors import UserError
from kerneltune.targets.registry import TargetSpec
from pipeline.partition import Partition

INSTALL_HINT = "pip install 'optimize-model[metaschedule]'"


def check_installed() -> None:
    """MetaSchedule's cost model is XGBoost, an optional extra (it pulls scipy and NCCL): one line now,
    before any engine is compiled, instead of an ImportError after minutes."""
    if importlib.util.find_spec("xgboost") is None:
        raise UserError(f"the MetaSchedule engine needs XGBoost: run `{INSTALL_HINT}`, or pass --skip-metaschedule")


def tune(part: Partition, spec: TargetSpec, trials: int, work_dir: str | Path, seed: int = 0) -> tvm.IRModule:
    """Tune ``part``'s kernels with MetaSchedule (``trials`` over all tasks); return the module with the
    best schedules applied (unscheduled kernels are left for :func:`pipeline.compile.schedule`)."""
    from tvm.s_tir import meta_schedule as ms

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target = spec.target
    # Builder workers import TVM per batch: on a loaded 2-core VM that alone can exceed the 30 s default.
    db = ms.relax_integration.tune_relax(
        part.mod, {}, target, str(work), trials, num_trials_per_iter=min(64, trials), seed=seed,
        builder=ms.builder.LocalBuilder(max_workers=2, timeout_sec=600),
        # Same cold-cache timing as our tuner (kerneltune.measure): kernels run with their weights in DRAM.
        runner=ms.runner.LocalRunner(timeout_sec=120, evaluator_config=ms.runner.EvaluatorConfig(
            number=1, repeat=15, min_repeat_ms=0, enable_cpu_cache_flush=spec.kind == "llvm")),
    )
    with target, db, tvm.transform.PassContext(opt_level=3):
        return relax.transform.MetaScheduleApplyDatabase(str(work))(part.mod)
