"""``--cost measured|analytic`` to a cost model (the composition root hands in the engine's runner)."""
from __future__ import annotations

from graphopt.cost.analytic import AnalyticCost
from graphopt.cost.base import CostModel
from graphopt.cost.measured import MeasuredCost
from graphopt.cost.runners import GraphRunner
from graphopt.errors import UserError

COST_KINDS = ("measured", "analytic")


def make_cost_model(kind: str, target: str, runner: GraphRunner) -> CostModel:
    """Measuring needs the target's hardware here: a GPU target on this CPU machine is priced analytically
    (against this machine's numbers, so only relative costs mean anything)."""
    if kind == "analytic":
        return AnalyticCost()
    if kind == "measured":
        if target != "llvm":
            return AnalyticCost()
        return MeasuredCost(runner, target)
    raise UserError(f"unknown cost model {kind!r}: use {' or '.join(COST_KINDS)}")
