"""Gradient (Ansor) vs round-robin task scheduling on one model: objective over trials and end-to-end latency.

Both schedulers tune the same tasks with the same searcher, seed and budget, each into its own records
file (rerunning resumes).  The objective curve -- sum over tasks of weight x best latency so far, the model's
kernel time as the tuner sees it -- is rebuilt from each records file in measurement order, starting from
every task's default-config latency measured in this run.  The question issue 6 asks: how many trials does
the gradient scheduler need to reach round-robin's final objective?  Both final models are also compiled
and timed end to end, interleaved with onnxruntime, because kernel sums and model latency can disagree.

    python bench/schedulers.py --model bert-base --trials 2000 --work-dir /tmp/sched \
        --json bench/results/schedulers_bert_base.json --png bench/results/schedulers_bert_base.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from graphopt.fileio import save_figure, write_text_atomic
from kerneltune.targets.parse import parse_target
from kerneltune.targets.threads import set_num_threads

SCHEDULERS = ("gradient", "round-robin")


def objective_curve(records_path: Path, tasks, timing: str = "cold") -> list[tuple[int, float]]:
    """(trials, objective ms) after each measured record of ``tasks``, in file order.

    ``tasks`` are :class:`kerneltune.tune_tasks.TaskTuning` reports; a task's latency starts at its default
    config's and drops whenever a record beats it.
    """
    from kerneltune.records import RecordLog

    by_key = {t.key: t for t in tasks}
    best = {t.key: (t.default_ms if t.default_ms is not None else float("inf")) for t in tasks}
    total = lambda: sum(by_key[k].weight * v for k, v in best.items())  # noqa: E731
    curve = [(0, total())]
    n = 0
    for rec in RecordLog(records_path).load(timing=timing):
        if rec.task not in by_key:
            continue
        n += 1
        if rec.latency_s and rec.gflops > 0 and rec.latency_s * 1e3 < best[rec.task]:
            best[rec.task] = rec.latency_s * 1e3
        curve.append((n, total()))
    return _steps(curve)


def _steps(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Only the points where the objective changes, plus the last one (a step plot needs no more)."""
    out = [p for i, p in enumerate(curve) if i == 0 or p[1] != curve[i - 1][1]]
    return out if out[-1] == curve[-1] else out + [curve[-1]]


def trials_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((n for n, v in curve if v <= target), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert-base", help="a name from `python -m models list`, or an .onnx file")
    p.add_argument("--trials", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=20, help="timed end-to-end runs per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="records per scheduler (resumable); default: a temporary directory")
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args(argv)
    set_num_threads(args.threads)

    from kerneltune.records import RecordLog
    from kerneltune.tune_tasks import TuningRun
    from pipeline.benchmark import bench
    from pipeline import stages
    from pipeline.chain import ChainRequest, Until, run_chain
    from pipeline.context import BuildContext, TuneOptions
    from pipeline.tuning import tune_model

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="schedulers-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model.endswith(".onnx"):
        import onnx

        from models.registry import build

        path = work / f"{model}.onnx"
        if not path.exists():
            onnx.save(build(model, args.seed), str(path))
        model = str(path)
    spec = parse_target("llvm", args.threads)
    import onnx

    chain_ctx = BuildContext.create("llvm", threads=args.threads, skip_graph=True)  # optimize-model's kernels
    lowered = run_chain(chain_ctx, ChainRequest(onnx.load(model), until=Until.PARTITION)).lowered
    imported, part = lowered.imported, lowered.part
    out: dict = {"model": os.path.basename(model), "trials": args.trials, "threads": args.threads,
                 "seed": args.seed, "schedulers": {}}
    compiled = {}
    for sched in SCHEDULERS:
        records = work / f"{sched}.jsonl"
        res = tune_model(part.tasks, TuningRun(spec, args.trials, RecordLog(records), sched, "opevo", args.seed))
        curve = objective_curve(records, res.tasks)
        compiled[sched] = stages.build(lowered, spec, res.best_configs)
        out["schedulers"][sched] = {
            "final_objective_ms": curve[-1][1], "curve": curve,
            "trials_per_task": {t.name: t.trials for t in res.tasks},
        }
        print(f"{sched}: objective {curve[0][1]:.2f} -> {curve[-1][1]:.2f} ms over {curve[-1][0]} trials",
              file=sys.stderr)
    rr_final = out["schedulers"]["round-robin"]["final_objective_ms"]
    reach = trials_to_reach(out["schedulers"]["gradient"]["curve"], rr_final)
    out["gradient_trials_to_reach_round_robin_final"] = reach
    out["gradient_fraction_of_round_robin_trials"] = (
        reach / out["schedulers"]["round-robin"]["curve"][-1][0] if reach is not None else None)
    ctx = BuildContext.create(spec.request, threads=args.threads, seed=args.seed, tuning=TuneOptions(args.trials))
    res = bench(imported, compiled, ctx, args.runs, out["model"])
    out["e2e_ms"] = {k: t.median_ms for k, t in res.timings.items()}
    out["max_abs_err"] = res.max_abs_err
    if args.json:
        write_text_atomic(args.json, json.dumps(out, indent=1))
    summary = {k: v for k, v in out.items() if k != "schedulers"}
    summary["final_objective_ms"] = {k: v["final_objective_ms"] for k, v in out["schedulers"].items()}
    print(json.dumps(summary, indent=1))
    if args.png:
        _plot(out, rr_final, reach, args.png)
    return 0


def _plot(out: dict, rr_final: float, reach: int | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for sched, d in out["schedulers"].items():
        xs, ys = zip(*d["curve"])
        ax.plot(xs, ys, label=f"{sched} (final {d['final_objective_ms']:.1f} ms)")
    ax.axhline(rr_final, color="grey", ls=":", lw=1)
    if reach is not None:
        ax.axvline(reach, color="grey", ls="--", lw=1)
        ax.annotate(f"gradient reaches it at {reach} trials", (reach, rr_final), textcoords="offset points",
                    xytext=(5, 10), fontsize=8)
    e2e = ", ".join(f"{k} {v:.1f} ms" for k, v in out["e2e_ms"].items())
    ax.set(xlabel="trials", ylabel="sum of weight x kernel latency (ms)",
           title=f"{out['model']}: task schedulers (end to end: {e2e})")
    ax.title.set_fontsize(8)
    ax.set_ylim(top=min(ax.get_ylim()[1], 2.0 * max(d["curve"][-1][1] for d in out["schedulers"].values())))
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
