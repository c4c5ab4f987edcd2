"""``graphopt roundtrip``: import -> IR -> export, then check both models compute the same outputs.

This is the guarantee every later stage builds on: if the IR cannot carry a model through unchanged, no
rewrite on top of it can be trusted.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx

from graphopt import ops
from graphopt.compare import compare_runs
from graphopt.feeds import feed_sets, run_ort_sets
from graphopt.onnx_io import InputShapes, account_nodes, export_onnx, import_onnx, load_model


def roundtrip(model: onnx.ModelProto | str | os.PathLike, input_shapes: InputShapes | None = None,
              seed: int = 0, samples: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Import and re-export ``model``, run both in onnxruntime on the same inputs (the samples, or several
    seeded random sets), compare (:mod:`graphopt.compare`)."""
    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    graph = import_onnx(proto, input_shapes)
    exported = export_onnx(graph)
    sets = feed_sets(graph, seed, samples)
    check = compare_runs(list(zip(run_ort_sets(proto, sets), run_ort_sets(exported, sets))))
    return {
        "nodes": len(graph.nodes),
        "source_nodes": len(proto.graph.node),
        "opaque_nodes": sum(1 for n in graph.nodes if not ops.understood(n, graph)),
        # source nodes neither kept, nor folded (Constant), nor bypassed (Identity): must be 0
        "dropped_nodes": account_nodes(proto, graph)["dropped_nodes"],
        **check.to_dict(),
        "outputs_equal": check.ok,
        "check_failure": check.reason(),
    }
