"""Sample efficiency of the searchers: OpEvo vs G-BFS vs N-A2C vs random vs TVM MetaSchedule.

Reproduces the shape of OpEvo's Figure 2 on this CPU: best GFLOPS found versus trials spent, mean line and
std band over seeds, one subplot per operator, plus a table of mean/std best GFLOPS at 64/128/256 trials.
Operators (fp32, OpEvo paper's Table 1 with the batch scaled down so a run fits on 2 cores, plus BERT-base):

    mm1      matmul (512,1024)x(1024,1024)
    bmm1     batch matmul 96x[(128,128)x(128,64)]                (paper: batch 960)
    c2       conv2d input (2,64,27,27), kernel (192,64,5,5), stride 1, pad 2   (paper: batch 512)
    r50_3x3  conv2d input (1,256,14,14), kernel (256,256,3,3), pad 1  (ResNet-50's costliest conv)
    dw       depthwise conv2d input (1,144,56,56), kernel (144,1,3,3), pad 1   (MobileNet-v2)
    bert     matmul (128,768)x(768,3072)                          (BERT-base FFN1)

The convolutions run on the NCHW[x]c template (:mod:`kerneltune.templates.cpu_nchwc`; blocks of the target's
vector width), as the pipeline runs CNN convolutions; ``c2_nchw`` is C2 on the plain NCHW conv template.

Every searcher measures through the same :class:`kerneltune.measure.Measurer` (builds in worker processes,
timing one config at a time, outputs checked) and gets the same warm start: trial 1 of each of our
searchers is the template's default config, measured, recorded and observed before the search proposes
anything (:func:`kerneltune.tune.tune`'s ``warm_start``, the path ``optimize-model`` takes), so OpEvo evolves
from it and G-BFS / N-A2C expand it instead of the untiled config.  MetaSchedule searches its own schedule
space, where our default has no equivalent: it starts cold.  G-BFS and N-A2C only move prime factors: when the
template's space also has other knobs (the CPU template's unroll depth) they search the factor knobs with the
other knobs at the template's ``default_config``, and the output says so.  MetaSchedule runs ``tune_tir``
(evolutionary search + XGBoost cost model, its own schedule space) with the same trial count; a measure
callback records every trial in order so its curve is comparable.

Records of every run go to ``--work-dir``: rerunning the same command resumes instead of re-measuring.

    python bench/tuners.py --trials 256 --seeds 3 --json bench/results/tuners.json --plot bench/results/tuners.png

On 2 cores the whole grid takes hours; ``bench/results/tuners.*`` was made an op at a time and merged:

    python bench/tuners.py --ops bert --trials 256 --seeds 3 --work-dir W --json bert.json   # likewise bmm1, mm1
    python bench/tuners.py --ops c2,r50_3x3,dw --trials 256 --seeds 3 --work-dir W --json conv.json
    python bench/tuners.py --merge bert.json bmm1.json mm1.json --json bench/results/tuners.json \
        --plot bench/results/tuners.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from graphopt.fileio import save_figure, write_text_atomic
from kerneltune.targets.host import llvm_target, num_cores, vector_lanes
from kerneltune.targets.threads import set_num_threads, tvm_num_threads

OPS: dict[str, dict[str, Any]] = {
    "mm1": {"kind": "matmul", "shape": (512, 1024, 1024)},
    "bmm1": {"kind": "batch_matmul", "shape": (96, 128, 128, 64)},
    "c2": {"kind": "conv2d_nchwc", "shape": (2, 64, 27, 27, 192, 5, 5), "pad": 2},
    "r50_3x3": {"kind": "conv2d_nchwc", "shape": (1, 256, 14, 14, 256, 3, 3), "pad": 1},
    "dw": {"kind": "conv2d_nchwc", "shape": (1, 144, 56, 56, 144, 3, 3), "pad": 1, "groups": 144},
    "c2_nchw": {"kind": "conv2d", "shape": (2, 64, 27, 27, 192, 5, 5), "pad": 2},
    "bert": {"kind": "matmul", "shape": (128, 768, 3072)},
}
OURS = ("opevo", "gbfs", "na2c", "random")
SEARCHERS = OURS + ("metaschedule",)
CHECKPOINTS = (64, 128, 256)


def make_op_task(name: str, lanes: int = 16):
    """The operator's task; NCHWc convolutions in blocks of ``lanes`` channels (input and output)."""
    spec = OPS[name]
    if spec["kind"] == "conv2d_nchwc":
        from kerneltune.templates.conv_nchwc import ConvSpec, make_task as make_nchwc_task

        n, c, h, w, f, kh, kw = spec["shape"]
        pad = spec.get("pad", 0)
        return make_nchwc_task(ConvSpec(n, c, h, w, f, kh, kw, pad=(pad,) * 4, groups=spec.get("groups", 1),
                                        ic_block=lanes, oc_block=lanes))
    from kerneltune.task import make_task

    return make_task(spec["kind"], spec["shape"], pad=spec.get("pad", 0))


def run_ours(task, target, searcher_name: str, seed: int, trials: int, records_path: Path,
             measurer) -> tuple[list[float], str]:
    """Best-so-far GFLOPS per trial for one of our searchers, and a note on how it was run."""
    from kerneltune import templates
    from kerneltune.records import RecordLog
    from kerneltune.searchers import FACTOR_ONLY, make_searcher
    from kerneltune.space import FactorKnob
    from kerneltune.tune import TaskRecords, tune

    from kerneltune.targets.registry import gflops_ceiling

    space = templates.space_for(task, target)
    default = templates.default_config(task, target)
    fixed, note = None, ""
    if searcher_name in FACTOR_ONLY and not space.factor_only:
        fixed = default
        pinned = {k.name: v for k, v in zip(space.knobs, fixed) if not isinstance(k, FactorKnob)}
        note = f"factor knobs searched; non-factor knobs fixed at default_config {pinned}"
    searcher = make_searcher(searcher_name, space, seed, fixed=fixed)
    with RecordLog(records_path) as log:
        res = tune(space, searcher, lambda cs: measurer.measure(task, cs), trials,
                   TaskRecords(task.key, str(target), log, measurer.timing, task.flops, gflops_ceiling(target)),
                   progress=True, desc=f"{searcher_name} s{seed}", warm_start=default)
    return res.curve[:trials], note


def _ms_build(mod, target, _params):
    """MetaSchedule's default_build minus ``import tvm.s_tir.tensor_intrin``.

    The default imports the tensor intrinsics in every build worker, and LocalBuilder restarts its workers
    for every batch: 12-19 s per batch on a quiet machine, minutes on this shared one (we measured builds
    of 4 samples still unfinished after 5 minutes vs 16 s without it).  The intrinsics are only used by
    tensorizing schedule rules (int8 VNNI/AMX), never by fp32 on llvm, so the kernels are the same.
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def run_metaschedule(task, target, seed: int, trials: int, work_dir: Path) -> list[float]:
    """Best-so-far GFLOPS per trial of MetaSchedule's default tuner (``tune_tir``) on the task's PrimFunc."""
    done = work_dir / "curve.json"   # MetaSchedule cannot resume our way: keep its finished curve instead
    if done.exists() and len(json.loads(done.read_text())) >= trials:
        return json.loads(done.read_text())[:trials]
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms

    gflops: list[float] = []

    @derived_object
    class RecordTrials(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            for b, r in zip(builder_results, runner_results):
                secs = [float(x) for x in (r.run_secs or [])]
                ok = b.error_msg is None and r.error_msg is None and secs
                gflops.append(task.flops / statistics.mean(secs) / 1e9 if ok else 0.0)

    work_dir.mkdir(parents=True, exist_ok=True)
    # Build workers start per batch: on a loaded 2-core VM that alone can exceed the 30 s default timeout.
    ms.tune_tir(task.func, target, str(work_dir), trials, num_trials_per_iter=min(64, trials), seed=seed,
                builder=ms.builder.LocalBuilder(max_workers=2, timeout_sec=600, f_build=_ms_build),
                runner=ms.runner.LocalRunner(timeout_sec=120),
                measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"), RecordTrials()],
                num_tuning_cores=num_cores(target))
    best, curve = 0.0, []
    for g in gflops[:trials]:
        best = max(best, g)
        curve.append(best)
    write_text_atomic(done, json.dumps(curve))  # a resumed run reads it: whole or absent
    return curve


def summarize(curves: list[list[float]], trials: int) -> dict[str, Any]:
    """Mean/std of the best GFLOPS at each checkpoint (a short curve, e.g. an exhausted space, holds its last)."""
    padded = [c + [c[-1]] * (trials - len(c)) if c else [0.0] * trials for c in curves]
    out = {}
    for t in sorted({t for t in CHECKPOINTS if t <= trials} | {trials}):
        vals = [c[t - 1] for c in padded]
        out[str(t)] = {"mean": statistics.mean(vals), "std": statistics.pstdev(vals) if len(vals) > 1 else 0.0}
    return out


def plot(results: dict[str, Any], trials: int, path: str, peak: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ops = list(results)
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        trials = results[op].get("trials", trials)
        for name, r in results[op]["searchers"].items():
            curves = [c + [c[-1]] * (trials - len(c)) for c in r["curves"] if c]
            if not curves:
                continue
            a = np.array(curves)
            x = np.arange(1, trials + 1)
            mean, std = a.mean(0), a.std(0)
            line, = ax.plot(x, mean, label=name)
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        if results[op].get("numpy_gflops"):
            ax.axhline(results[op]["numpy_gflops"], color="gray", ls="--", label="numpy (OpenBLAS)")
        if peak:
            ax.axhline(peak, color="black", ls=":", label="peak FMA")
        ax.set_title(f"{op}: {results[op]['task']}", fontsize=8)
        ax.set_xlabel("trials")
        ax.set_ylabel("best GFLOP/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def print_table(results: dict[str, Any], peak: float | None = None) -> None:
    cols = sorted({t for op in results.values() for r in op["searchers"].values() for t in r["summary"]}, key=int)
    print(f"{'op':8} {'searcher':13} " + " ".join(f"{'@' + c:>16}" for c in cols), file=sys.stderr)
    for op, res in results.items():
        for name, r in res["searchers"].items():
            cells = [f"{r['summary'][c]['mean']:8.1f}+-{r['summary'][c]['std']:<6.1f}" if c in r["summary"] else
                     " " * 16 for c in cols]
            print(f"{op:8} {name:13} " + " ".join(cells), file=sys.stderr)
        if res.get("numpy_gflops"):
            print(f"{op:8} {'numpy':13} {res['numpy_gflops']:8.1f}", file=sys.stderr)
    if peak:
        print(f"peak fp32 FMA throughput (bench/peak.py): {peak:.1f} GFLOP/s", file=sys.stderr)


def report(doc: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    """Table on stderr, JSON on stdout (and in ``json_path``), plot in ``plot_path``."""
    results = doc["results"]
    print_table(results, doc["peak_gflops"])
    for op, res in results.items():
        for name, r in res["searchers"].items():
            if "note" in r:
                print(f"note: {op} {name}: {r['note']}", file=sys.stderr)
        for name, why in res.get("failed", {}).items():
            print(f"note: {op} {name} failed and is left out: {why}", file=sys.stderr)
    text = json.dumps(doc, indent=1)
    print(text)
    if json_path:
        write_text_atomic(json_path, text + "\n")
    if plot_path:
        plot(results, doc["trials"], plot_path, doc["peak_gflops"])


def merge(paths: list[str], json_path: str | None, plot_path: str | None) -> int:
    """One report from several runs: on 2 cores the whole benchmark does not fit in one sitting, so it is
    run an operator (or a searcher) at a time, each run resuming from the shared ``--work-dir``."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    results: dict[str, Any] = {}
    for doc in docs:
        for op, res in doc["results"].items():
            res = {"trials": doc["trials"], **res}   # seeds: each searcher's number of curves
            if op in results:
                results[op]["searchers"].update(res["searchers"])
            else:
                results[op] = res
    peaks = [d["peak_gflops"] for d in docs if d.get("peak_gflops")]
    doc = {"trials": max(r["trials"] for r in results.values()), "target": docs[0]["target"],
           "peak_gflops": max(peaks) if peaks else None, "wall_s": sum(d["wall_s"] for d in docs),
           "merged_from": [Path(p).name for p in paths], "results": results}
    report(doc, json_path, plot_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=256)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--ops", default=",".join(o for o in OPS if o != "c2_nchw"),
                   help=f"comma list of {', '.join(OPS)} (default: all but c2_nchw)")
    p.add_argument("--searchers", default=",".join(SEARCHERS), help=f"comma list of {', '.join(SEARCHERS)}")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all usable cores)")
    p.add_argument("--workers", type=int, default=None, help="build processes for our measurer")
    p.add_argument("--work-dir", default=None, help="records and MetaSchedule databases (default: a temp dir)")
    p.add_argument("--json", help="write the results JSON here")
    p.add_argument("--plot", help="write the Figure-2-style PNG here")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="measure nothing: combine the JSON of earlier runs (one op or searcher each; a later "
                        "file's searcher replaces an earlier one's) into one JSON, table and plot")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.json, args.plot)
    ops = [o for o in args.ops.split(",") if o]
    names = [s for s in args.searchers.split(",") if s]
    bad = [o for o in ops if o not in OPS] + [s for s in names if s not in SEARCHERS]
    if bad:
        p.error(f"unknown op/searcher {bad}")

    target = llvm_target(args.threads)
    set_num_threads(tvm_num_threads(num_cores(target)))
    from peak import fma_peak_gflops

    from kerneltune.baseline import numpy_baseline
    from kerneltune.measure import Measurer

    # The baselines are measured before the Measurer starts: its worker processes import TVM at start-up,
    # and OpenBLAS sharing the two cores with them measured 27 instead of ~180 GFLOP/s.
    peak = fma_peak_gflops(num_cores(target))
    tasks = {op: make_op_task(op, vector_lanes(target, "float32")) for op in ops}
    numpy = {op: numpy_baseline(t.dims["M"], t.dims["K"], t.dims["N"], num_cores(target)).gflops
             for op, t in tasks.items() if t.kind == "matmul"}
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench-tuners-"))
    results: dict[str, Any] = {}
    t_start = time.time()
    with Measurer(target, workers=args.workers) as measurer:
        for op, task in tasks.items():
            entry: dict[str, Any] = {"task": task.key, "flops": task.flops, "trials": args.trials, "searchers": {}}
            if op in numpy:
                entry["numpy_gflops"] = numpy[op]
            for name in names:
                curves, note = [], ""
                for seed in range(args.seeds):
                    t0 = time.time()
                    if name == "metaschedule":
                        try:
                            curve = run_metaschedule(task, target, seed, args.trials, work / f"{op}-ms-s{seed}")
                        except Exception as e:  # noqa: BLE001 - TVM's tuner failing must not lose the others' curves
                            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}"
                            entry.setdefault("failed", {})[name] = why
                            print(f"{op} {name} seed {seed}: failed ({why}); left out", file=sys.stderr)
                            break
                    else:
                        curve, note = run_ours(task, target, name, seed, args.trials,
                                               work / f"{op}-{name}-s{seed}.jsonl", measurer)
                    curves.append(curve)
                    print(f"{op} {name} seed {seed}: best {curve[-1] if curve else 0:.1f} GFLOP/s after "
                          f"{len(curve)} trials ({time.time() - t0:.0f} s)", file=sys.stderr)
                if name in entry.get("failed", {}):
                    continue
                entry["searchers"][name] = {"curves": curves, "summary": summarize(curves, args.trials),
                                            **({"note": note} if note else {})}
            results[op] = entry
    doc = {"trials": args.trials, "seeds": args.seeds, "target": str(target), "work_dir": str(work),
           "peak_gflops": peak["peak_gflops"] if peak else None, "wall_s": time.time() - t_start,
           "results": results}
    report(doc, args.json, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
