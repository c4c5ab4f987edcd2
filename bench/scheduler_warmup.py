"""Does the gradient task scheduler still need Ansor's round-robin warm-up when every task starts from its
measured default?  A simulation on ResNet-50's real task list (weights and FLOPs from our partition of a
torchvision ResNet-50 with random weights): no kernel is built, so it takes seconds and isolates the
scheduling rule from measurement noise.

Model of a task: its default runs at d ~ U(15, 90) GFLOP/s; tuning can reach a, shared by the whole model
within +-15% (a ~ A * U(0.85, 1.15), A ~ U(100, 200): similar kernels reach similar speeds, the premise of
Ansor's similar-task term); each round (one batch of 8 trials) closes U(5%, 40%) of the remaining gap with
probability 1/2.  ``--independent`` draws a per task instead (a ~ d * U(1, 3.5), capped at 220).  The budget
counts the 25 defaults of round 0.  Reported: the mean fraction of the default-to-attainable gap (sum of
weight x latency) left after the budget, over seeds; lower is better.

    python bench/scheduler_warmup.py [--independent] [--seeds 200] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from graphopt.fileio import write_text_atomic
from kerneltune.scheduler import GradientScheduler, RoundRobinScheduler, TaskInfo

BUDGETS = (200, 400, 800, 2000)
BATCH = 8


class WarmupGradient(GradientScheduler):
    """Ansor's original start: one round-robin round before the gradient rule (for comparison only)."""

    def next_task(self) -> int:
        if self._cursor < len(self.states):
            return self._round_robin()
        return super().next_task()


VARIANTS = {"round-robin": RoundRobinScheduler, "gradient + warm-up": WarmupGradient, "gradient": GradientScheduler}


def resnet50_tasks() -> list[dict]:
    """(name, kind, weight, flops) of ResNet-50's tunable tasks, from a torchvision export."""
    import torch

    lib = torch.library.Library("torchvision", "DEF")  # torchvision's CUDA wheel needs its op schemas on CPU
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    import onnx

    from pipeline.chain import ChainRequest, Until, run_chain
    from pipeline.context import BuildContext

    path = Path(tempfile.mkdtemp(prefix="sched-warmup-")) / "resnet50.onnx"
    torch.onnx.export(torchvision.models.resnet50().eval(), (torch.randn(1, 3, 224, 224),), str(path), dynamo=False,
                      opset_version=17)
    ctx = BuildContext.create("llvm", skip_graph=True)  # the kernels optimize-model --skip-graph builds
    part = run_chain(ctx, ChainRequest(onnx.load(str(path)), until=Until.PARTITION)).lowered.part
    del lib
    return [{"name": t.name, "kind": t.kind, "weight": t.weight, "flops": t.flops} for t in part.tasks
            if t.task is not None]


def instance(tasks: list[dict], seed: int, independent: bool) -> list[tuple[dict, float, float]]:
    rng = random.Random(seed)
    shared = rng.uniform(100, 200)
    out = []
    for t in tasks:
        d = rng.uniform(15, 90)
        a = min(220.0, d * rng.uniform(1.0, 3.5)) if independent else shared * rng.uniform(0.85, 1.15)
        out.append((t, d, max(a, d)))
    return out


def gap_left(inst, variant: str, budget: int, seed: int) -> float:
    rng = random.Random(seed * 7 + 1)
    speed = [d for _, d, _ in inst]
    lat = lambda t, s: t["flops"] / (s * 1e9)  # noqa: E731
    sched = VARIANTS[variant]([TaskInfo(t["name"], t["weight"], t["flops"], t["kind"], lat(t, d)) for t, d, _ in inst])
    for _ in range((budget - len(inst)) // BATCH):
        i = sched.next_task()
        t, _, a = inst[i]
        if rng.random() < 0.5:
            speed[i] += (a - speed[i]) * rng.uniform(0.05, 0.4)
        sched.update(i, lat(t, speed[i]))
    total = lambda speeds: sum(t["weight"] * lat(t, s) for (t, _, _), s in zip(inst, speeds))  # noqa: E731
    start, floor = total([d for _, d, _ in inst]), total([a for _, _, a in inst])
    return (total(speed) - floor) / (start - floor)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--independent", action="store_true", help="attainable speeds drawn per task")
    p.add_argument("--json")
    args = p.parse_args(argv)
    tasks = resnet50_tasks()
    out = {"tasks": len(tasks), "seeds": args.seeds, "independent": args.independent, "gap_left": {}}
    for budget in BUDGETS:
        row = {}
        for v in VARIANTS:
            row[v] = round(statistics.mean(gap_left(instance(tasks, s, args.independent), v, budget, s)
                                           for s in range(args.seeds)), 3)
        out["gap_left"][budget] = row
        print(f"{budget:5d} trials: " + ", ".join(f"{k} {x:.3f}" for k, x in row.items()), file=sys.stderr)
    print(json.dumps(out, indent=1))
    if args.json:
        write_text_atomic(args.json, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
