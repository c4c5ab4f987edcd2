"""Model inputs for checks and timings, and an onnxruntime runner: the reference every stage is checked against.

Inputs are the user's samples (``--inputs FILE.npz``) when given, else seeded random values.  A check runs
on :data:`CHECK_INPUT_SETS` input sets (one seeded draw catches less: ten BERT inputs reached 6.5e-5 where
one showed 1e-5), or on the samples alone - random values may be meaningless to a model with a control
input (a sample rate that must be 8000 or 16000).

Random integer inputs must be valid for the model (token ids below the vocabulary size, masks of 0/1), or
the reference run itself fails or compares garbage; we find the bound by following the input to the Gather
that indexes an embedding table.
"""
from __future__ import annotations

import numpy as np
import onnx

from graphopt.errors import UserError
from graphopt.ir import Graph

# Ops that pass an integer tensor through unchanged in value, so the bound of the Gather behind them applies.
_PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"}


def _index_bound(graph: Graph, n, t: str) -> int | None:
    """The exclusive bound node ``n`` puts on the values of its input ``t``, if it indexes something."""
    if n.op_type in ("Gather", "GatherElements") and len(n.inputs) > 1 and n.inputs[1] == t:
        data_shape = graph.shape(n.inputs[0])
        if data_shape:
            axis = int(n.attr("axis", 0)) % len(data_shape)
            return data_shape[axis] if isinstance(data_shape[axis], int) else None
    if n.op_type == "GatherND" and len(n.inputs) > 1 and n.inputs[1] == t:
        data_shape, idx_shape = graph.shape(n.inputs[0]), graph.shape(t)
        if data_shape and idx_shape and isinstance(idx_shape[-1], int):
            b = int(n.attr("batch_dims", 0))
            dims = data_shape[b:b + idx_shape[-1]]
            return min(dims) if dims and all(isinstance(d, int) for d in dims) else None
    if n.op_type == "OneHot" and n.inputs and n.inputs[0] == t and len(n.inputs) > 1 \
            and n.inputs[1] in graph.initializers:
        return int(np.asarray(graph.initializers[n.inputs[1]]).reshape(-1)[0])
    return None


def value_uses(graph: Graph, name: str):
    """``(node, tensor)`` for every use of tensor ``name``'s values, seen through the value-preserving ops of
    :data:`_PASS_THROUGH` (a Cast or Reshape of an input is followed to its own uses)."""
    consumers = graph.consumers()
    frontier, seen = [name], set()
    while frontier:
        t = frontier.pop()
        if t in seen:
            continue
        seen.add(t)
        for n in consumers.get(t, []):
            if n.op_type in _PASS_THROUGH and n.inputs and n.inputs[0] == t:
                frontier.extend(n.outputs)
            else:
                yield n, t


def _int_bound(graph: Graph, name: str) -> int:
    """Exclusive upper bound for a valid value of integer input ``name`` (2 when nothing tells us)."""
    bounds = [b for n, t in value_uses(graph, name) if (b := _index_bound(graph, n, t)) is not None and b > 0]
    return min(bounds) if bounds else 2


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


CHECK_INPUT_SETS = 3


def feed_sets(graph: Graph, seed: int = 0, samples: dict[str, np.ndarray] | None = None,
              count: int = CHECK_INPUT_SETS) -> list[dict[str, np.ndarray]]:
    """The input sets a check runs on: the samples (inputs they do not name drawn at random), or ``count``
    seeded random sets (seeds ``seed``, ``seed + 1``, ...)."""
    if samples:
        return [sample_feeds(graph, samples, seed)]
    return [random_inputs(graph, seed + k) for k in range(count)]


def sample_feeds(graph: Graph, samples: dict[str, np.ndarray] | None, seed: int = 0) -> dict[str, np.ndarray]:
    """The inputs a timing runs on: the samples where given, seeded random values for the rest."""
    feeds = random_inputs(graph, seed)
    feeds.update({k: v for k, v in (samples or {}).items() if k in feeds})
    return feeds


def ort_session(model: onnx.ModelProto | str, threads: int = 0, optimize: bool = True, spin: bool = True):
    """An onnxruntime CPU session; ``threads`` 0 lets ORT choose.

    ``spin=False`` is for sessions called between other work in one process (the graph stage's per-operator
    pricing): ORT's intra-op threads keep spinning after a run and steal the cores the next step needs
    (TVM's run right after ORT measured 90 ms instead of 1.3 ms on bert-tiny, 2 cores).  Spinning is
    stopped when ``run`` returns (``session.force_spinning_stop``) but kept during it: turning it off
    altogether (``allow_spinning=0``) made ORT itself 2.7x slower on NASRNN's 230 small ops (6.1 vs 2.2 ms;
    3.8 ms with the stop).  Whole-model timings leave spinning on, as ORT runs alone, and give the next
    engine an idle gap instead (:mod:`graphopt.timing`)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # errors come back as exceptions; the log would be a second copy
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
    """onnxruntime's outputs on ``feeds`` (see :func:`run_ort_sets`)."""
    return run_ort_sets(model, [feeds], threads)[0]


def run_ort_sets(model: onnx.ModelProto | str, sets: list[dict[str, np.ndarray]],
                 threads: int = 0, optimize: bool = True) -> list[list[np.ndarray]]:
    """onnxruntime's outputs on each input set, from one session (``optimize=False``: with its graph
    optimizations off).  A failure on the inputs we chose is the
    user's to fix with ``--inputs`` (a Reshape fed a random shape tensor, an index out of range), so it is
    a UserError."""
    sess = ort_session(model, threads, optimize=optimize)
    names = {i.name for i in sess.get_inputs()}
    out = []
    for feeds in sets:
        try:
            out.append(sess.run(None, {k: v for k, v in feeds.items() if k in names}))
        except Exception as exc:  # noqa: BLE001 - onnxruntime's Fail / InvalidArgument / RuntimeException
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            detail = (lines[0] if lines else type(exc).__name__)[:200]
            raise UserError(f"onnxruntime failed to run the model on its check inputs ({detail}): pass inputs "
                            "the model accepts with --inputs FILE.npz (numpy.savez(FILE, input_name=array, ...))") \
                from None
    return out
