"""Hoisted vs per-step input projection in the LSTM lowering, end to end in TVM and onnxruntime.

An unrolled LSTM computes ``x_t @ W^T`` once per step with the same W.  The lowering can either emit that
per step ("naive") and leave merging to the graph search (TASO's ``matmul(x,W), matmul(y,W) ->
split(matmul(concat0(x,y), W))``, applied pairwise), or hoist it into one GEMM over all steps before the
loop ("hoisted", what :mod:`graphopt.legalize.rnn` ships).  This script builds the ``lstm-lm`` model
(2 layers, hidden 256, seq 32, batch 1), lowers it both ways, optionally runs the graph search on each,
compiles every form with the pipeline's default schedules and times them interleaved, ``--rounds`` times,
next to onnxruntime on the original model (its native LSTM kernel) and on both lowered forms.

    python bench/rnn_projection.py --threads 2 --runs 30 --rounds 3 [--search] [--json FILE]

Prints one JSON document: per form the node/MatMul counts, the search's applied rules (with ``--search``),
and per round the median latency in ms of every engine; the summary is the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from graphopt.fileio import write_text_atomic
from graphopt.timing import time_blocks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def lowered(proto, hoist: bool):
    """``proto`` with its LSTM nodes lowered with or without the hoisted projection."""
    from graphopt import legalize as lg
    from graphopt.legalize import rnn
    from graphopt.onnx_io import export_onnx, import_onnx

    saved = dict(lg.LOWERINGS)
    try:
        for op in ("LSTM", "GRU", "RNN"):
            lg.LOWERINGS[op] = lambda node, b: rnn.lower(node, b, hoist=hoist)
        return export_onnx(lg.legalize(import_onnx(proto)).graph)
    finally:
        lg.LOWERINGS.clear()
        lg.LOWERINGS.update(saved)


def interleaved(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median ms per engine, from the project's one whole-model timer (:func:`graphopt.timing.time_blocks`)."""
    return {k: round(t.median_ms, 4) for k, t in time_blocks(fns, runs).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--search", action="store_true", help="also run the graph search on both forms")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))

    from graphopt.compare import max_abs_err
    from graphopt.feeds import ort_session, random_inputs, run_ort
    from graphopt.onnx_io import import_onnx
    from models import build
    from pipeline.compile import compile_partition, device_for, outputs_numpy, to_device
    from pipeline.partition import partition
    from pipeline.relax_import import import_model
    from kerneltune.targets.parse import parse_target

    original = build("lstm-lm", args.seed)
    feeds = random_inputs(import_onnx(original), args.seed)
    reference = run_ort(original, feeds)
    forms = {"hoisted": lowered(original, True), "naive": lowered(original, False)}
    report: dict[str, Any] = {"model": "lstm-lm", "threads": args.threads, "runs": args.runs,
                              "load_average": os.getloadavg(), "forms": {}}
    if args.search:
        from graphopt.optimize import optimize

        for name in list(forms):
            t0 = time.perf_counter()
            searched, rep = optimize(forms[name], target="llvm", threads=args.threads, seed=args.seed)
            forms[f"{name}+search"] = searched
            report["forms"][f"{name}+search"] = {"applied": rep.get("applied"), "kept": rep.get("kept"),
                                                 "candidate_applied": rep.get("candidate_applied"),
                                                 "stopped_by": rep.get("stopped_by"),
                                                 "search_s": round(time.perf_counter() - t0, 1)}
    spec = parse_target("llvm", args.threads)
    dev = device_for(spec)
    engines: dict[str, Callable[[], object]] = {}
    sess = ort_session(original, args.threads)
    engines["ort:original"] = lambda: sess.run(None, feeds)
    for name in ("hoisted", "naive"):
        s = ort_session(forms[name], args.threads)
        engines[f"ort:{name}"] = (lambda s=s: s.run(None, feeds))
    for name, proto in forms.items():
        t0 = time.perf_counter()
        imported = import_model(proto)
        compiled = compile_partition(imported, part := partition(imported.mod), spec)
        main_fn = compiled.vm()["main"]
        dev_args = to_device(feeds, compiled.input_names, dev)

        def run(main_fn=main_fn, dev_args=dev_args):
            out = main_fn(*dev_args)
            dev.sync()
            return out

        counts: dict[str, int] = {}
        for n in proto.graph.node:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
        report["forms"].setdefault(name, {}).update(
            nodes=len(proto.graph.node), matmuls=counts.get("MatMul", 0), kernels=len(part.tasks),
            build_s=round(time.perf_counter() - t0, 1), max_abs_err=max_abs_err(reference, outputs_numpy(run())))
        engines[f"tvm:{name}"] = run
    rounds = [interleaved(engines, args.runs) for _ in range(args.rounds)]
    report["rounds_ms"] = rounds
    report["median_ms"] = {k: round(statistics.median(r[k] for r in rounds), 4) for k in engines}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
