"""``bench-model DIR``: the model.so optimize-model shipped into DIR, timed against onnxruntime and OpenVINO.

Why a path of its own: ``bench-model MODEL`` compiles its engines again, and a rebuild is not the build a user
ships (another graph-stage verdict, other tuning records, maybe another TVM), so "how fast is what I ship"
got the figure of something else.  Here model.so is loaded as run-model and :func:`pipeline.load` load it
(:class:`pipeline.artifact.Model`: its size and hash checked against report.json first), and the peers run
DIR/optimized.onnx: the ONNX file the folder records as the graph model.so was compiled from.  It is always in
the folder (the input model report.json names may not be on this machine, or may have changed since), and for
an int8 build it is the quantized graph, so every runtime runs the same model; same inputs, same threads,
timed together by :func:`graphopt.timing.time_blocks` as the rebuilt engines are.

model.so's outputs are checked against onnxruntime's on the timed inputs first, as every rebuilt engine is:
a wrong build's latency means nothing.  A peer that cannot run (onnxruntime failing on optimized.onnx,
OpenVINO missing or disagreeing) is named with the reason (:attr:`pipeline.benchmark.BenchResult.skipped`).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from graphopt.compare import Comparison, compare_runs
from graphopt.errors import UserError
from graphopt.feeds import ort_session
from graphopt.quant_tolerance import model_tolerance
from graphopt.timing import Plan
from pipeline.artifact import GRAPH, Model
from pipeline.benchmark import BenchResult, Peer, add_peer, first_line, openvino_peer, time_plan


def bench_shipped(model: Model, plan: Plan, threads: int, inputs: str | None = None,
                  seed: int = 0, profile: bool = False, sizes: dict[str, int] | None = None) -> BenchResult:
    """A loaded folder's model.so against onnxruntime and OpenVINO on its optimized.onnx (module docstring), on
    ``inputs`` (an .npz, checked against the signature) or seeded random inputs of the compiled shapes (a
    served dimension at ``sizes``)."""
    feeds = model.read_inputs(inputs, seed) if inputs else model.random_feeds(seed, sizes)  # sizes: --dim
    graph = model.graph_path()
    ort, reference = ort_peer(graph, threads, feeds)
    engines: dict = {}
    checks: dict[str, Comparison] = {}
    skipped = add_peer(engines, checks, "ort", ort)
    proto = tolerance = None
    if reference is not None:
        from graphopt.onnx_io import load_model

        proto = load_model(graph)
        quantized = model_tolerance(proto, [feeds], [reference], threads)
        tolerance = quantized.tolerances if quantized else None
        checks["shipped"] = check_shipped(model, feeds, reference, tolerance)
    skipped |= add_peer(engines, checks, "openvino", openvino_for(model, proto, threads, feeds, reference,
                                                                   tolerance))
    engines["shipped"] = model.runner(feeds)
    times = time_plan(engines, plan)
    if profile:  # after the timing: the per-call instrument and onnxruntime's profiler slow what they time
        from pipeline.pricing import layer_profile

        layers = layer_profile.profile_shipped(model, feeds)
        layers = layer_profile.with_ort(layers, graph, feeds, int(model.threads or threads))
    return BenchResult(os.path.basename(str(model.report.get("model", model.directory))), str(model.report["target"]),
                       int(model.threads or threads), plan.runs, times, checks, warmup=plan.warmup,
                       duration_s=plan.duration_s, shipped=str(model.directory), skipped=skipped,
                       heading=heading(model.directory, model.report),
                       layers=layers if profile else None, sizes=dict(sizes or {}))


def ort_peer(path: Path, threads: int, feeds: dict[str, np.ndarray]) -> tuple[Peer, list[np.ndarray] | None]:
    """onnxruntime on ``path`` (by path: it reads a weights file beside it), and its outputs on ``feeds``, the
    reference model.so and OpenVINO are checked against; onnxruntime failing is a skipped peer, named, and
    model.so is then timed unchecked (it was checked when it was built)."""
    try:
        sess = ort_session(str(path), threads)
        names = {i.name for i in sess.get_inputs()}
        ort_feeds = {k: v for k, v in feeds.items() if k in names}
        reference = [np.asarray(o) for o in sess.run(None, ort_feeds)]
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own failure: named, model.so still timed
        return Peer(skipped=f"could not run {GRAPH} ({first_line(exc)}); model.so timed unchecked"), None
    return Peer(lambda: sess.run(None, ort_feeds)), reference


def check_shipped(model: Model, feeds: dict[str, np.ndarray], reference: list[np.ndarray], tolerance) -> Comparison:
    """model.so's outputs against onnxruntime's on the timed inputs; a UserError when they differ."""
    check = compare_runs([(reference, list(model.run(feeds).values()))], tolerance)
    if not check.ok:
        raise UserError(f"{model.directory}/model.so differs from onnxruntime on {GRAPH}: {check.reason()}; no latency "
                        f"of a wrong build is reported - run-model {model.directory} --check to see it, or rebuild")
    return check


def openvino_for(model: Model, proto, threads: int, feeds: dict[str, np.ndarray],
                 reference: list[np.ndarray] | None, tolerance=None) -> Peer:
    """OpenVINO on optimized.onnx (:func:`pipeline.benchmark.openvino_peer`), or why it is not compared."""
    if model.device_type != "cpu":
        return Peer(skipped=f"not compared: model.so runs on {model.device_type}, OpenVINO on the CPU here")
    if reference is None or proto is None:
        return Peer(skipped="not compared: no onnxruntime reference to check its outputs against")
    return openvino_peer(proto, threads, [feeds], [reference], feeds, tolerance)


def heading(directory: Path, report: dict) -> str:
    """The first line bench-model DIR prints: which build is timed, against what, on which file."""
    return (f"bench-model times {directory}/model.so as shipped (built from {report.get('model', '?')} for "
            f"{report.get('target', '?')}) against onnxruntime and OpenVINO on {directory}/{GRAPH}, the graph it "
            "was compiled from; same inputs, same threads")
