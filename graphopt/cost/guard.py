"""A cost model that never fails: what the wrapped model cannot price is estimated, logged once, and the
search goes on.

Pricing runs real engines on one-operator models cut out of the user's graph (a TVM compile, an
onnxruntime session), and real models contain operators that do not run alone: a Reshape whose target
shape is a runtime value, an op TVM's importer lacks, a custom-domain node.  One such node must cost the
graph stage a less precise price for that node, never the whole optimization, so the stage prices through
this wrapper: a failure is priced by the roofline estimate (:class:`~graphopt.cost.analytic.AnalyticCost`;
the node is treated as opaque, which it is for the search: it never decides between candidates, see
:mod:`graphopt.cost.base`), remembered so it is not retried, and reported once per operator type on stderr
and in ``failures`` (which the stage report carries).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from graphopt.cost.analytic import AnalyticCost
from graphopt.cost.base import LAUNCH_OVERHEAD_S, CostModel, ModelTimes, Shape, params_key
from graphopt.ir import Graph, Node, array_key, attrs_key
from graphopt.verdicts import Verdicts

log = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _input_key(t: str, graph: Graph) -> tuple:
    """What of one input can decide whether pricing fails: its type, and its value if it is a weight."""
    if not t:
        return ("-",)
    if graph.is_constant(t):
        # the content hash cached by identity: hashed anew at every call, VGG-19's weights (548 MB) took 13 of
        # its cold graph stage's 91 s
        return ("c", array_key(graph.initializers[t]))
    info = graph.tensor(t)
    return ("t", info.dtype, info.shape) if info else ("?",)


class GuardedCost(CostModel):
    """``inner`` with every pricing failure turned into an estimate (see module docstring)."""

    def __init__(self, inner: CostModel):
        self.inner = inner
        self.name = inner.name
        self.fusion = inner.fusion
        self.failures: dict[str, str] = {}  # operator type -> the first failure's message, in order seen
        self._failed: dict[tuple, float] = {}  # what failed -> the estimate it got (not retried)
        self._analytic: AnalyticCost | None = None

    def _estimate(self) -> AnalyticCost:
        if self._analytic is None:
            self._analytic = AnalyticCost()
        return self._analytic

    def _fail(self, kind: str, exc: BaseException) -> None:
        if kind not in self.failures:
            self.failures[kind] = _first_line(exc)
            log.warning("warning: the %s cost model cannot price %s (%s); priced by estimate, the graph stage "
                        "goes on", self.name, kind, self.failures[kind])

    def _guarded(self, key: tuple, kind: str, price, estimate) -> float:
        if key in self._failed:
            return self._failed[key]
        try:
            return price()
        except Exception as exc:  # noqa: BLE001 - any failure of pricing is priced by estimate (module doc)
            self._fail(kind, exc)
        try:
            value = estimate()
        except Exception:  # noqa: BLE001 - not even an estimate: a launch, as the cheapest opaque node
            value = LAUNCH_OVERHEAD_S
        self._failed[key] = value
        return value

    def op_cost(self, op: str, params: dict[str, Any], in_shapes: Sequence[Shape], dtype: str = "float32") -> float:
        key = ("op", op, params_key(params), tuple(tuple(s) for s in in_shapes), dtype)
        return self._guarded(key, op, lambda: self.inner.op_cost(op, params, in_shapes, dtype),
                             lambda: self._estimate().op_cost(op, params, in_shapes, dtype))

    def opaque_cost(self, node: Node, graph: Graph) -> float:
        kind = f"{node.domain}:{node.op_type}" if node.domain else node.op_type
        key = ("node", kind, attrs_key(node.attrs), tuple(_input_key(t, graph) for t in node.inputs))
        return self._guarded(key, kind, lambda: self.inner.opaque_cost(node, graph),
                             lambda: self._estimate().opaque_cost(node, graph))

    def prefetch(self, graph: Graph) -> None:
        try:
            self.inner.prefetch(graph)
        except Exception as exc:  # noqa: BLE001 - the search prices one at a time instead
            self._fail("(operators ahead of the search)", exc)

    def flush(self) -> None:
        try:
            self.inner.flush()
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written costs a rerun's time only
            self._fail("(writing the cost cache)", exc)

    def time_models(self, graphs: Sequence[Graph], runs: int = 20) -> ModelTimes | None:
        return self.inner.time_models(graphs, runs)  # failures here are the stage's to judge (keep the input)

    def kernel_times(self, graphs: Sequence[Graph], confirm: bool = False) -> list[float] | None:
        try:
            return self.inner.kernel_times(graphs, confirm)
        except Exception as exc:  # noqa: BLE001 - no kernel price: the stage times the whole models instead
            self._fail("(kernel prices of a whole graph)", exc)
            return None

    def blocked_winograd(self) -> bool:
        return self.inner.blocked_winograd()

    def set_deadline(self, deadline: float | None) -> None:
        self.inner.set_deadline(deadline)

    @property
    def verdicts(self) -> Verdicts | None:
        return self.inner.verdicts
