"""``--cost measured|analytic`` to a cost model."""
from __future__ import annotations

from graphopt.cost.analytic import AnalyticCost
from graphopt.cost.base import CostModel
from graphopt.cost.measured import MeasuredCost
from graphopt.cost.runners import OrtRunner, TvmRunner
from graphopt.errors import UserError

BACKENDS = {"tvm": TvmRunner, "ort": OrtRunner}


def make_cost_model(kind: str, target: str = "llvm", backend: str = "tvm", threads: int = 1) -> CostModel:
    """Measuring needs the target's hardware here: a GPU target on this CPU machine is priced analytically
    (against this machine's numbers, so only relative costs mean anything)."""
    if kind == "analytic":
        return AnalyticCost()
    if kind == "measured":
        if backend not in BACKENDS:
            raise UserError(f"unknown cost backend {backend!r}: use {' or '.join(BACKENDS)}")
        if target != "llvm":
            return AnalyticCost()
        return MeasuredCost(BACKENDS[backend](threads), target)
    raise UserError(f"unknown cost model {kind!r}: use measured or analytic")
