"""NCHWc convolutions vs the NCHW template vs onnxruntime, one conv at a time, interleaved in one process.

For each shape a one-node ONNX model (Conv, random weights) is run by

* ``ort``: onnxruntime (2 threads; its NCHWc transformer reorders the input/output around MLAS' kernel);
* ``tvm_nchw``: our pipeline with the NCHW conv template's default config;
* ``tvm_nchwc``: our pipeline after :func:`pipeline.layout.nchwc.to_nchwc` (transforms at the model's edges, which
  a one-conv model is all edge: this is the pessimistic number; narrow groups stay NCHW there);
* ``nchwc_kernel``: the NCHWc kernel alone on blocked tensors (what it costs inside a blocked graph; narrow
  groups merged to fill the blocks);

in alternating blocks (:func:`graphopt.timing.time_blocks`), and the FMA peak is measured in the same
run (``bench/peak.py``).  GFLOP/s count the convolution's useful FLOPs (merged groups compute more).

    python bench/conv_nchwc.py [--shapes r50_3x3,mbv2_dw] [--runs 50] [--json out.json]
    python bench/conv_nchwc.py --models resnet18.onnx,mobilenet_v2.onnx [--runs 50]   # whole models

With ``--tune SHAPE`` the shape's NCHWc task (16-channel blocks) is tuned instead (``--trials``, ``--searcher``,
measured through kerneltune's Measurer, warm caches), starting with the default config for reference.

With ``--models`` each ONNX model runs end to end instead: onnxruntime vs our pipeline with NCHW convs vs
our pipeline after the NCHWc layout pass (all default configs, no tuning), with the number of layout
transforms the pass left.

Shapes (batch 1): ResNet-50's 3x3 (64x56x56, 64 filters), a 1x1 (256x56x56 -> 64), ResNeXt-50's grouped 3x3
(128x56x56, 32 groups), MobileNet-v2's depthwise 3x3 (144x56x56), Inception-v3's 80->192 3x3 on a 71-wide map
(its heaviest conv; 64 trials found 291 GFLOP/s against the default's 247 on an Intel Xeon, 2 threads).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from graphopt.fileio import write_text_atomic

SHAPES = {
    "r50_3x3": dict(c=64, hw=56, f=64, k=3, stride=1, pad=1, groups=1),
    "r50_1x1": dict(c=256, hw=56, f=64, k=1, stride=1, pad=0, groups=1),
    "rx_grouped": dict(c=128, hw=56, f=128, k=3, stride=1, pad=1, groups=32),
    "mbv2_dw": dict(c=144, hw=56, f=144, k=3, stride=1, pad=1, groups=144),
    "i3_3x3": dict(c=80, hw=73, f=192, k=3, stride=1, pad=0, groups=1),
}


def conv_model(c: int, hw: int, f: int, k: int, stride: int, pad: int, groups: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.uniform(-0.1, 0.1, (f, c // groups, k, k)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[k, k], strides=[stride, stride],
                            pads=[pad] * 4, group=groups)
    oh = (hw + 2 * pad - k) // stride + 1
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, f, oh, oh])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    flops = 2 * f * oh * oh * (c // groups) * k * k
    return model, flops


def peak_gflops(threads: int) -> float:
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("peak.py")), "--threads", str(threads)],
                         capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_gflops"])


def kernel_runner(name: str, spec):
    """The shape's NCHWc kernel (16-channel blocks; narrow groups merged) on blocked inputs, packed weights."""
    import tvm

    from kerneltune import prepack, templates
    from kerneltune.task import build_func

    task = nchwc_task(name)
    func, packings = prepack.strip(templates.apply(task, templates.default_config(task, spec.target), spec.target))
    lib = build_func(func, spec.target)
    inputs = prepack.pack_inputs(task.make_inputs(0), packings)
    args = [tvm.runtime.tensor(x) for x in inputs] + [tvm.runtime.empty(o.shape, o.dtype) for o in task.outputs]
    return lambda: lib["main"](*args), task


def bench_shape(name: str, runs: int, threads: int) -> dict:
    from graphopt.compare import max_abs_err
    from graphopt.feeds import ort_session, random_inputs
    from graphopt.timing import time_blocks
    from kerneltune.targets.host import vector_lanes
    from kerneltune.targets.parse import parse_target
    from kerneltune.targets.registry import device_for
    from pipeline.layout import nchwc
    from pipeline.compile import compile_partition, outputs_numpy, to_device
    from pipeline.partition import partition
    from pipeline.relax_import import import_model

    model, flops = conv_model(**SHAPES[name])
    imported = import_model(model)
    spec = parse_target("llvm", threads=threads)
    feeds = random_inputs(imported.graph, 0)
    sess = ort_session(model, threads)
    ref = sess.run(None, feeds)
    engines = {"ort": lambda: sess.run(None, feeds)}
    errors = {}
    blocked, report = nchwc.to_nchwc(imported.mod, vector_lanes(spec.target, "float32"))
    for key, part in (("tvm_nchw", partition(imported.mod)), ("tvm_nchwc", partition(blocked))):
        cm = compile_partition(imported, part, spec)
        main, dev = cm.vm()["main"], device_for(spec)
        args = to_device(feeds, cm.input_names, dev)
        engines[key] = lambda main=main, args=args: main(*args)
        errors[key] = max_abs_err(ref, outputs_numpy(main(*args)))
    engines["nchwc_kernel"], task = kernel_runner(name, spec)
    times = time_blocks(engines, runs)
    return {"shape": SHAPES[name], "useful_gflop": flops / 1e9, "executed_gflop": task.flops / 1e9,
            "transforms": report.transforms, "errors": errors,
            "ms": {k: t.median_ms for k, t in times.items()}, "min_ms": {k: t.min_ms for k, t in times.items()},
            "gflops": {k: flops / (t.median_ms * 1e-3) / 1e9 for k, t in times.items()}}


def bench_model(path: str, runs: int, threads: int) -> dict:
    from kerneltune.targets.host import vector_lanes
    from pipeline.layout import nchwc
    from pipeline.benchmark import bench
    from pipeline.compile import compile_partition
    from pipeline.context import BuildContext
    from pipeline.partition import partition
    from pipeline.relax_import import import_model
    from kerneltune.targets.parse import parse_target

    imported = import_model(path)
    spec = parse_target("llvm", threads=threads)
    blocked, report = nchwc.to_nchwc(imported.mod, vector_lanes(spec.target, "float32"))
    compiled = {"tvm_nchw": compile_partition(imported, partition(imported.mod), spec),
                "tvm_nchwc": compile_partition(imported, partition(blocked), spec)}
    ctx = BuildContext.create(spec.request, threads=threads)
    res = bench(imported, compiled, ctx, runs, model_name=Path(path).stem)
    return {"ms": {k: t.median_ms for k, t in res.timings.items()},
            "min_ms": {k: t.min_ms for k, t in res.timings.items()}, "errors": res.errors,
            "convs": report.convs, "blocked": report.blocked, "merged_groups": report.merged_groups,
            "transforms": report.transforms}


def nchwc_task(name: str, block: int = 16):
    """The standalone NCHWc task of a shape (grouped convs with their groups merged to fill the block)."""
    from kerneltune.templates.conv_nchwc import ConvSpec, make_task, merge_factor

    s = SHAPES[name]
    groups = s["groups"]
    if 1 < groups < s["c"]:
        groups //= merge_factor(s["c"], s["f"], groups, block, block)
    spec = ConvSpec(1, s["c"], s["hw"], s["hw"], s["f"], s["k"], s["k"], stride=(s["stride"],) * 2,
                    pad=(s["pad"],) * 4, groups=groups, ic_block=block, oc_block=block)
    return make_task(spec)


def tune_shape(name: str, trials: int, searcher: str, threads: int, seed: int = 0) -> dict:
    from kerneltune import templates
    from kerneltune.measure import MeasureOptions, Measurer
    from kerneltune.searchers import make_searcher
    from kerneltune.tune import TaskRecords, tune
    from kerneltune.targets.parse import parse_target

    task = nchwc_task(name)
    useful = conv_model(**SHAPES[name])[1]  # the grouped conv's own FLOPs, not those of merged groups
    target = parse_target("llvm", threads=threads).target
    space = templates.space_for(task, target)
    default = templates.default_config(task, target)
    with Measurer(target, MeasureOptions(number=10, repeat=3)) as m:
        (d,) = m.measure(task, [default])
        s = make_searcher(searcher, space, seed=seed, fixed=default)
        res = tune(space, s, lambda cs: m.measure(task, cs), trials, TaskRecords(task.key, str(target)),
                   progress=False)
    scale = useful / task.flops  # GFLOP/s on useful FLOPs
    return {"task": task.key, "space_size": space.size(), "default_gflops": d.gflops * scale,
            "best_gflops": res.best_gflops * scale, "best_config": space.as_dict(res.best_config),
            "curve": [g * scale for g in res.curve], "failures": res.failures, "trials": res.trials}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", help="comma-separated ONNX files to run end to end instead of single convs")
    p.add_argument("--tune", help="tune this shape's NCHWc task instead")
    p.add_argument("--trials", type=int, default=64)
    p.add_argument("--searcher", default="opevo")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    out = {"load_before": os.getloadavg(), "peak_gflops_before": peak_gflops(args.threads), "shapes": {},
           "models": {}}
    if args.tune:
        out["tune"] = tune_shape(args.tune, args.trials, args.searcher, args.threads)
    elif args.models:
        for path in args.models.split(","):
            out["models"][path] = r = bench_model(path, args.runs, args.threads)
            print(path, json.dumps({k: {e: round(v, 3) for e, v in r[k].items()} for k in ("ms", "min_ms")}),
                  flush=True)
    else:
        for name in args.shapes.split(","):
            out["shapes"][name] = r = bench_shape(name, args.runs, args.threads)
            print(name, json.dumps({k: {e: round(v, 1) for e, v in r[k].items()} for k in ("gflops",)}),
                  flush=True)
    out["peak_gflops_after"] = peak_gflops(args.threads)
    out["load_after"] = os.getloadavg()
    text = json.dumps(out, indent=1)
    if args.json:
        write_text_atomic(args.json, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
