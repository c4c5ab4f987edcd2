"""Seeded random model inputs and an onnxruntime runner: the reference every stage is checked against.

Integer inputs must be valid for the model (token ids below the vocabulary size, masks of 0/1), or the
reference run itself fails or compares garbage; we find the bound by following the input to the Gather
that indexes an embedding table.
"""
from __future__ import annotations

import numpy as np
import onnx

from graphopt.errors import UserError
from graphopt.ir import Graph

# Ops that pass an integer tensor through unchanged in value, so the bound of the Gather behind them applies.
_PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"}


def _int_bound(graph: Graph, name: str) -> int:
    """Exclusive upper bound for a valid value of integer input ``name`` (2 when nothing tells us)."""
    consumers = graph.consumers()
    frontier, seen, bound = [name], set(), None
    while frontier:
        t = frontier.pop()
        if t in seen:
            continue
        seen.add(t)
        for n in consumers.get(t, []):
            if n.op_type == "Gather" and len(n.inputs) > 1 and n.inputs[1] == t:
                data_shape = graph.shape(n.inputs[0])
                axis = int(n.attr("axis", 0))
                if data_shape and isinstance(data_shape[axis], int):
                    bound = data_shape[axis] if bound is None else min(bound, data_shape[axis])
            elif n.op_type in _PASS_THROUGH and n.inputs and n.inputs[0] == t:
                frontier.extend(n.outputs)
    return bound if bound is not None else 2


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input that is not a weight: floats in [-1, 1), ints in valid range."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for inp in graph.inputs:
        if inp.name in graph.initializers:
            continue
        if not inp.is_static:
            raise UserError(f"input {inp.name!r} has unknown dimensions {inp.shape}: pass "
                            f"--input-shape {inp.name}=D1,D2,...")
        shape = tuple(int(d) for d in inp.shape)  # type: ignore[union-attr]
        dtype = np.dtype(inp.dtype)
        if dtype == np.bool_:
            feeds[inp.name] = rng.integers(0, 2, size=shape).astype(bool)
        elif np.issubdtype(dtype, np.integer):
            feeds[inp.name] = rng.integers(0, _int_bound(graph, inp.name), size=shape).astype(dtype)
        else:
            feeds[inp.name] = rng.uniform(-1, 1, size=shape).astype(dtype)
    return feeds


def ort_session(model: onnx.ModelProto | str, threads: int = 0, optimize: bool = True, spin: bool = True):
    """An onnxruntime CPU session; ``threads`` 0 lets ORT choose.

    ``spin=False`` is for timing sessions interleaved with other engines: ORT's intra-op threads keep
    spinning after a run and steal the cores the next engine needs (TVM's run after ORT measured 90 ms
    instead of 1.3 ms on bert-tiny, 2 cores).  Spinning is stopped when ``run`` returns
    (``session.force_spinning_stop``) but kept during it: turning it off altogether (``allow_spinning=0``)
    made ORT itself 2.7x slower on NASRNN's 230 small ops (6.1 vs 2.2 ms; 3.8 ms with the stop)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    if not spin:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def run_ort(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray], threads: int = 0) -> list[np.ndarray]:
    sess = ort_session(model, threads)
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def max_abs_err(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest absolute difference over all outputs (inf on a shape mismatch, which is a real failure)."""
    err = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return float("inf")
        if x.size:
            if x.dtype == np.bool_ or y.dtype == np.bool_:
                err = max(err, float(np.sum(x != y)))
            else:
                err = max(err, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
    return err
