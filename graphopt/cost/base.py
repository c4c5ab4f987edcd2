"""The cost-model interface: seconds per operator on one target; a graph costs the sum over nodes that run.

Costs are asked for at two levels.  Nodes the operator library understands are priced by their *operator
view* ``(op, params, input shapes)`` from :func:`graphopt.ops.from_onnx` - the same key the search uses to
price a rule's target pattern before building it, so a node costs the same whether it came from the input
model or from a rewrite.  Opaque nodes are priced as the ONNX node they are; they are never part of a match,
so they cost the same before and after a rewrite: they count in the total but never decide.

Nodes whose inputs are all weights cost nothing: the optimizer folds them into initializers before export
(e.g. the concatenation of two matmul weights a merge rule creates), so they never run
(:mod:`graphopt.cost.analysis`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from graphopt import ops
from graphopt.cost.analysis import constant_tensors, foldable, free_targets, fused_epilogue
from graphopt.ir import Graph, Node, TensorInfo
from graphopt.match import GraphIndex
from graphopt.verdicts import Verdicts

Shape = tuple[int, ...]

LAUNCH_OVERHEAD_S = 1e-6  # per-operator dispatch cost in onnxruntime / a TVM module, order of magnitude


@dataclass
class ModelTimes:
    """Median seconds per run of each timed model, in the order given, and the engine that ran them."""

    seconds: list[float]
    backend: str


class CostModel:
    """Seconds per operator on one target; graph cost is the sum over nodes that will run."""

    name = "base"
    fusion = True  # price element-wise epilogues as fused into their producer (see analysis.fused_epilogue)

    def op_cost(self, op: str, params: dict[str, Any], in_shapes: Sequence[Shape], dtype: str = "float32") -> float:
        """Cost of one understood operator (the view :func:`graphopt.ops.from_onnx` gives of a node)."""
        raise NotImplementedError

    def opaque_cost(self, node: Node, graph: Graph) -> float:
        """Cost of a node the operator library does not understand, priced as the ONNX node it is."""
        raise NotImplementedError

    def flush(self) -> None:
        """Persist anything measured (no-op for models without a cache)."""

    def time_models(self, graphs: Sequence[Graph], runs: int = 20) -> ModelTimes | None:
        """Seconds per end-to-end run of each whole graph (one interleaved block of ``runs`` rounds), timed
        with the engine this model prices for; ``None`` when the model measures nothing (analytic), so the
        caller cannot check its predictions."""
        return None

    def kernel_times(self, graphs: Sequence[Graph], confirm: bool = False) -> list[float] | None:
        """Seconds per run of each graph as the fused kernels its engine builds, over the kernel calls the
        graphs do not all share (the price that sees fusion,
        :meth:`graphopt.cost.runners.GraphRunner.kernel_times`), or None when this model has no such engine.
        ``confirm``: those kernels timed once more, each priced at the faster of its two timings (the gate of
        :func:`graphopt.stage.check_end_to_end` confirms a pass this way before paying for two whole models)."""
        return None

    def blocked_winograd(self) -> bool:
        """Whether the engine this model prices for computes marked convolutions
        (:func:`graphopt.winograd.mark`) with a Winograd kernel of its own."""
        return False

    def prefetch(self, graph: Graph) -> None:
        """Price ``graph``'s operators ahead of a search, all at once where the engine can (no-op here)."""

    def set_deadline(self, deadline: float | None) -> None:
        """From ``deadline`` (a :func:`time.perf_counter` value) on, price what is not known yet by estimate
        instead of measuring it: the graph stage's ``--time-limit`` covers pricing (no-op here)."""

    @property
    def verdicts(self) -> Verdicts | None:
        """Where the end-to-end verdicts timed with :meth:`time_models` are kept (:mod:`graphopt.verdicts`),
        scoped to this engine, target and threads; None for a model that times nothing."""
        return None

    # ---- derived -----------------------------------------------------------------------------------------
    def node_cost(self, node: Node, graph: Graph, constants: set[str] | None = None,
                  index: GraphIndex | None = None) -> float:
        """Seconds ``node`` adds to a run: nothing if it is folded away (``constants``) or fused into its
        producer's kernel (needs ``index``, a :class:`graphopt.match.GraphIndex` of ``graph``)."""
        if constants is not None and foldable(node, graph, constants):
            return 0.0
        if self.fusion and index is not None and fused_epilogue(node, index):
            return 0.0
        view = ops.from_onnx(node, graph)
        if view is not None:
            op, params = view
            inputs = ops.op_inputs(node, graph)
            shapes = [graph.shape(t) for t in inputs]
            if all(s is not None and all(isinstance(d, int) for d in s) for s in shapes):
                dtype = (graph.tensor(inputs[0]) or TensorInfo("", "float32", None)).dtype
                return self.op_cost(op, params, [tuple(s) for s in shapes], dtype)  # type: ignore[arg-type]
        return self.opaque_cost(node, graph)

    def pattern_cost(self, pattern: Any, views: Sequence[tuple[str, dict[str, Any], Sequence[Shape]]], dtype: str,
                     weight_inputs: set[str]) -> float:
        """Seconds a rule's target ``pattern`` adds once built, priced before it is built: ``views`` are its
        nodes' ``(op, params, input shapes)`` as inferred on a match (:func:`graphopt.rewrite.target_plan`);
        ``weight_inputs`` the pattern inputs bound to weights.  Weight-only nodes and (with :attr:`fusion`)
        fused epilogues cost nothing, as :meth:`node_cost` prices them once built."""
        free = free_targets(pattern, weight_inputs, self.fusion)
        return sum(self.op_cost(op, params, shapes, dtype) for (op, params, shapes), f in zip(views, free) if not f)

    def graph_cost(self, graph: Graph) -> float:
        constants = constant_tensors(graph)
        index = GraphIndex(graph)
        total = sum(self.node_cost(n, graph, constants, index) for n in graph.nodes)
        self.flush()
        return total


def params_key(params: dict[str, Any]) -> tuple:
    """A hashable, order-independent key of operator parameters."""
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 2 if dtype == "bfloat16" else 4
