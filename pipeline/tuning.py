"""The tuning stage of ``optimize-model`` and ``bench-model``: the model's fused tasks handed to kerneltune's
multi-task tuner (:func:`kerneltune.tune_tasks.tune_tasks`), and the plot of how the tuning went.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from graphopt.errors import UserError
from kerneltune.opkinds import KINDS as OP_KINDS
from kerneltune.targets import TargetSpec
from kerneltune.tune_tasks import TuningResult, TuningTask, tune_tasks
from pipeline.partition import FusedTask


def tune_model(tasks: list[FusedTask], spec: TargetSpec, trials: int, records_path: str | Path,
               scheduler: str = "gradient", searcher: str = "opevo", seed: int = 0, rpc: str | None = None,
               measure_factory: Callable | None = None, progress: bool = True) -> TuningResult:
    """Tune ``tasks`` (those with a template) with ``trials`` measurements in total; see
    :func:`kerneltune.tune_tasks.tune_tasks` for the loop and ``measure_factory``."""
    tunable = [TuningTask(t.task, t.weight, t.index) for t in tasks if t.task is not None]
    if not tunable:
        raise UserError(f"no selected task has a kernel template ({', '.join(OP_KINDS)}): nothing to tune")
    return tune_tasks(tunable, spec, trials, records_path, scheduler, searcher, seed, rpc, measure_factory,
                      progress)


def plot_tuning(result: TuningResult, path: str | Path) -> None:
    """Each task's best latency (weighted share of the objective) and the objective over global trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for t in result.tasks:
        if t.curve:
            xs = [0] + [x for x, _ in t.curve]
            ys = [t.default_ms if t.default_ms is not None else t.curve[0][1]] + [y for _, y in t.curve]
            xs.append(result.trials)  # flat until the end: the task got no more rounds
            ys.append(ys[-1])
            ax1.step(xs, ys, where="post", label=f"{t.index}: {t.name[:28]}")
    ax1.set_xlabel("trials (all tasks)")
    ax1.set_ylabel("best latency per call, ms")
    ax1.set_yscale("log")
    ax1.set_title("task latency over trials")
    ax1.legend(fontsize=6)
    ax2.plot([x for x, _ in result.objective], [y for _, y in result.objective], marker=".")
    ax2.set_xlabel("trials (all tasks)")
    ax2.set_ylabel("sum weight x latency, ms")
    ax2.set_title(f"objective ({result.scheduler}, {result.searcher})")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
