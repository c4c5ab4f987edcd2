"""What runs a graph for the measured cost model: the runner interface, and the onnxruntime runner.

A :class:`GraphRunner` turns a graph into a callable that runs it once (synchronised, so a timer around
the call measures the whole run).  The measured cost model times tiny one-operator graphs and whole models
with it; it never knows which engine is behind it.  graphopt ships the onnxruntime runner; the pipeline
injects one that compiles with TVM (:mod:`pipeline.pricing.graph_runner`), so graphopt never imports TVM or the
pipeline (the layering rule in docs/architecture.md).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

import numpy as np

from graphopt.feeds import ort_session, value_uses
from graphopt.ir import Graph
from graphopt.onnx_io import export_onnx


class GraphRunner(ABC):
    """Builds, per graph, a callable that runs it once on this machine with ``threads`` threads."""

    name: str = "base"  # the engine, e.g. "ort" or "tvm": part of the cost cache's file name and reports
    # whether the engine computes the convolutions graphopt.winograd.mark marks with a Winograd kernel of
    # its own (else a Winograd layer is priced, and shipped, as graphopt.winograd.rewrite's plain operators)
    blocked_winograd: bool = False

    def __init__(self, threads: int = 1):
        self.threads = threads

    @property
    def cache_tag(self) -> str:
        """The engine in the cost cache's file name, with whatever else of its set-up changes its timings
        (a compiler's CPU options); by default the engine's name."""
        return self.name

    @abstractmethod
    def prepare(self, graph: Graph) -> Callable[[], object]:
        """A callable that runs ``graph`` once on fixed inputs; raises when the engine cannot run it."""

    def prepare_model(self, graph: Graph) -> Callable[[], object]:
        """:meth:`prepare` for a whole model, built the way the product builds it where that differs from how
        one operator is timed (TVM: the blocked conv layouts); by default :meth:`prepare`.  The end-to-end
        check times candidates through this, so its verdict is on the code that ships."""
        return self.prepare(graph)

    def prepare_many(self, graphs: Sequence[Graph]) -> list[Callable[[], object] | Exception]:
        """:meth:`prepare` of each graph, in order, a failure in its place; an engine that can build several at
        once overrides it (TVM: side by side on the cores)."""
        return [self.prepare_or_failure(g) for g in graphs]

    def prepare_or_failure(self, graph: Graph) -> Callable[[], object] | Exception:
        """:meth:`prepare`, or the exception it raised (the caller prices that graph another way)."""
        try:
            return self.prepare(graph)
        except Exception as exc:  # noqa: BLE001 - see above
            return exc

    def prepare_models(self, graphs: Sequence[Graph]) -> list[Callable[[], object]]:
        """:meth:`prepare_model` of each graph, in order; an engine that can build several at once overrides
        it (TVM: side by side on the cores, :mod:`kerneltune.machine_gate`)."""
        return [self.prepare_model(g) for g in graphs]

    def kernel_times(self, graphs: Sequence[Graph], confirm: bool = False) -> list[float] | None:
        """Seconds per run of each graph priced as the kernels this engine builds for it (each distinct fused
        kernel timed alone, times its calls: the graph stage's fusion-aware price), over the kernel calls the
        graphs do not all share (of one graph: all of them), so differences between the prices are exact; or
        None where the engine cannot split a model into its kernels (onnxruntime).  ``confirm``: those kernels
        timed again, each at the faster of its timings (:meth:`graphopt.cost.base.CostModel.kernel_times`)."""
        return None


# Operand positions that index into another tensor: 0 is a valid index for any axis, 1 is not (size 1).
_INDEX_OPERANDS = {"Gather": 1, "GatherElements": 1, "GatherND": 1, "ScatterElements": 1, "Scatter": 1,
                  "ScatterND": 1, "OneHot": 0}


def _only_indexes(graph: Graph, name: str) -> bool:
    """Whether integer input ``name`` (directly or through value-preserving ops) is used as an index and
    as nothing else: only then is 0 a safe timing value (any other integer may be a divisor)."""
    uses = list(value_uses(graph, name))
    return bool(uses) and all((p := _INDEX_OPERANDS.get(n.op_type)) is not None and len(n.inputs) > p
                              and n.inputs[p] == t for n, t in uses)


def timing_feeds(graph: Graph) -> dict[str, np.ndarray]:
    """Fixed inputs for timing runs: seeded floats in [-1, 1); integers 1, or 0 where they only index (a
    valid index for any axis).  Never 0 elsewhere: an integer Div or Mod by a zero tensor kills the process
    with SIGFPE in TVM's code (the measured cost model times every Div it prices).  Values do not matter
    for timing, only that every run sees the same ones."""
    rng = np.random.default_rng(0)
    feeds = {}
    for i in graph.inputs:
        dt = np.dtype(i.dtype)
        if np.issubdtype(dt, np.floating):
            feeds[i.name] = rng.uniform(-1, 1, size=i.shape).astype(dt)
        else:
            feeds[i.name] = np.full(i.shape, 0 if _only_indexes(graph, i.name) else 1, dtype=dt)
    return feeds


class OrtRunner(GraphRunner):
    """One call of the graph in an onnxruntime CPU session (spinning stopped after runs, see ort_session)."""

    name = "ort"

    def prepare(self, graph: Graph) -> Callable[[], object]:
        sess = ort_session(export_onnx(graph, check=False), threads=self.threads, spin=False)
        feeds = timing_feeds(graph)
        return lambda: sess.run(None, feeds)

