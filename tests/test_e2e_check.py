"""The graph stage's end-to-end guard: a search result that is not measurably faster as a whole model than
the input is rejected, and the input handed back unchanged (graphopt.stage.check_end_to_end)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from graphopt.cost.analytic import AnalyticCost
from graphopt.cost.base import ModelTimes
from graphopt.cost.measured import MeasuredCost
from graphopt.cost.runners import OrtRunner
from graphopt.timing import time_blocks
from graphopt.errors import UserError
from graphopt.onnx_io import import_onnx
from graphopt.stage import check_end_to_end
from models.builder import GraphBuilder
from pipeline.cli import graphopt_main as main
from test_match import merge_bias, merge_matmul, three_projections
from test_optimize import graph_stage, optimize
from test_search import LaunchCost

HAND = [merge_matmul(2), merge_matmul(3), merge_bias(2), merge_bias(3)]


class TimedLaunchCost(LaunchCost):
    """LaunchCost (under which merging the three projections pays) whose whole-model "timings" are given:
    stands in for a backend on which the merged graph fuses worse than the per-operator sum predicts."""

    def __init__(self, before_ms: float, after_ms: float):
        super().__init__(1.0, 1.5, 2.0)
        self.ms = (before_ms, after_ms)
        self.timed: list[list[int]] = []  # MatMul count of each graph timed, per call

    def time_models(self, graphs, runs=20):
        """The first graph ever timed (the stage's input) takes ``before_ms``, any other ``after_ms``."""
        self.timed.append([sum(n.op_type == "MatMul" for n in g.nodes) for g in graphs])
        hashes = [g.structural_hash() for g in graphs]
        self.first = getattr(self, "first", None) or hashes[0]
        return ModelTimes([(self.ms[0] if h == self.first else self.ms[1]) / 1e3 for h in hashes], "fake")


def _matmuls(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "MatMul" for n in model.graph.node)


class PricedLaunchCost(TimedLaunchCost):
    """TimedLaunchCost whose engine also prices graphs by the kernels they do not share: the input's at 1.0
    (LaunchCost's units), any other graph's ``cheaper_by`` less."""

    def __init__(self, cheaper_by: float, after_ms: float = 0.8, confirmed_by: float | None = None):
        super().__init__(1.0, after_ms)
        self.cheaper_by = cheaper_by
        self.confirmed_by = cheaper_by if confirmed_by is None else confirmed_by  # timed again (confirm)
        self.priced: list[list[int]] = []  # MatMul count of each graph priced, per call
        self.confirmed = 0

    def kernel_times(self, graphs, confirm=False):
        self.priced.append([sum(n.op_type == "MatMul" for n in g.nodes) for g in graphs])
        self.confirmed += confirm
        return [1.0] + [1.0 - (self.confirmed_by if confirm else self.cheaper_by)] * (len(graphs) - 1)


def test_a_candidate_whose_kernels_price_no_cheaper_is_not_timed():
    """The input prices at 3.3 whole (three projections and biases); the merged projections' kernels 0.02
    cheaper than the input's are not half the 2% margin of 3.3 (0.033), so the input is kept without compiling
    or timing either whole model; 0.04 cheaper, both are timed, and the merge is kept (0.8 ms against 1.0)."""
    proto = three_projections()
    cost = PricedLaunchCost(cheaper_by=0.02)
    out, rep = optimize(proto, cost=cost, rules=HAND, budget=60)
    assert cost.priced[0] == [3, 1] and cost.timed == []
    assert rep["kept"] == "original" and rep["e2e_check"] == "priced" and _matmuls(out) == 3
    assert rep["kernels_ms_before"] == 1000.0 and rep["kernels_ms_after"] == 980.0 and rep["e2e_ms_before"] is None
    assert cost.confirmed == 0  # a price that does not pass is not taken again
    cost = PricedLaunchCost(cheaper_by=0.04)
    out, rep = optimize(proto, cost=cost, rules=HAND, budget=60)
    assert cost.timed and rep["kept"] == "optimized" and rep["e2e_check"] == "measured" and _matmuls(out) == 1
    assert cost.confirmed == 1


def test_a_gate_pass_is_confirmed_before_whole_models_are_built():
    """The merged projections price 0.04 cheaper (a pass), but timed again only 0.01 cheaper (the first price
    of the input was taken beside an interruption): the input is kept at the gate with the confirmed prices,
    and neither whole model is built or timed."""
    cost = PricedLaunchCost(cheaper_by=0.04, confirmed_by=0.01)
    out, rep = optimize(three_projections(), cost=cost, rules=HAND, budget=60)
    assert cost.confirmed == 1 and cost.timed == [] and _matmuls(out) == 3
    assert rep["kept"] == "original" and rep["e2e_check"] == "priced" and rep["kernels_ms_after"] == 990.0


def test_merges_that_price_slower_are_not_merged_everywhere():
    """The search merges the projections (cheaper per operator under LaunchCost), and their kernels price
    slower than the input's: the input is kept at the gate, and merging every group - more of the same
    rewrites - is not tried (no second search, no second price).  Priced cheaper, though short of the gate,
    the merge-everything alternative is still tried."""
    cost = PricedLaunchCost(cheaper_by=-0.5)
    out, rep = optimize(three_projections(), cost=cost, rules=None, budget=60)
    assert rep["candidate_applied"] and rep["kept"] == "original" and rep["e2e_check"] == "priced"
    assert len(cost.priced) == 1 and cost.timed == [] and _matmuls(out) == 3
    assert "merges priced 1500.000 ms" in rep["merge_all"]["skipped"] and "applied" not in rep["merge_all"]
    cost = PricedLaunchCost(cheaper_by=0.02)
    out, rep = optimize(three_projections(), cost=cost, rules=None, budget=60)
    assert rep["kept"] == "original" and "skipped" not in rep["merge_all"] and rep["merge_all"]["applied"]
    assert len(cost.priced) == 2  # the search's result, then the merge-everything graph


def test_slower_end_to_end_hands_back_the_input():
    proto = three_projections()
    cost = TimedLaunchCost(before_ms=1.0, after_ms=1.1)
    out, rep = optimize(proto, cost=cost, rules=HAND, budget=60)
    # the input and the merged candidate, in 3 blocks (order swapped in the second): all say slower
    assert cost.timed == [[3, 1], [1, 3], [3, 1]]
    assert rep["candidate_applied"] and rep["candidate_cost_after"] < rep["cost_before"]
    assert out is proto and _matmuls(out) == 3
    assert rep["kept"] == "original" and rep["applied"] == {} and rep["cost_after"] == rep["cost_before"]
    assert rep["e2e_check"] == "measured" and (rep["e2e_ms_before"], rep["e2e_ms_after"]) == (1.0, 1.1)
    assert rep["outputs_equal"] and rep["nodes_after"] == rep["nodes_before"]


def test_faster_end_to_end_keeps_the_optimized_graph():
    proto = three_projections()
    out, rep = optimize(proto, cost=TimedLaunchCost(1.0, 0.8), rules=HAND, budget=60)
    assert rep["kept"] == "optimized" and rep["applied"] == rep["candidate_applied"] != {}
    assert _matmuls(out) == 1 and rep["outputs_equal"]


def test_a_gain_inside_the_margin_is_not_enough():
    proto = three_projections()
    _, rep = optimize(proto, cost=TimedLaunchCost(1.0, 0.99), rules=HAND, budget=60)
    assert rep["kept"] == "original"
    _, rep = optimize(proto, cost=TimedLaunchCost(1.0, 0.99), rules=HAND, budget=60, e2e_margin=0.0)
    assert rep["kept"] == "optimized"
    with pytest.raises(UserError):
        optimize(proto, cost=TimedLaunchCost(1.0, 0.99), rules=HAND, e2e_margin=1.5)


def test_disabled_check_times_nothing():
    cost = TimedLaunchCost(1.0, 2.0)
    out, rep = optimize(three_projections(), cost=cost, rules=HAND, budget=60, e2e_check=False)
    assert cost.timed == [] and rep["e2e_check"] == "disabled" and rep["kept"] == "optimized"
    assert _matmuls(out) == 1 and rep["e2e_ms_before"] is None


def test_pipeline_entry_point_is_guarded_too():
    """``graphopt.stage.optimize_graph`` (what pipeline/ calls) hands back the input graph when it is slower."""
    g = import_onnx(three_projections())
    res = graph_stage(g, cost=TimedLaunchCost(1.0, 1.2), rules=HAND, budget=60)
    assert res.applied == {} and res.cost_after == res.cost_before
    assert [n.op_type for n in res.graph.nodes] == [n.op_type for n in g.nodes]
    assert res.kept == "original" and res.search.applied
    res = graph_stage(g, cost=TimedLaunchCost(1.0, 0.5), rules=HAND, budget=60)
    assert res.kept == "optimized" and sum(n.op_type == "MatMul" for n in res.graph.nodes) == 1


def test_analytic_cost_model_skips_the_check_and_says_so():
    g = import_onnx(three_projections())
    check = check_end_to_end(g, g, AnalyticCost(1e11, 1e10), {"merge_matmul_r2": 1})
    assert check.kept == "optimized" and check.status.startswith("skipped") and "analytic" in check.status
    assert check.ms_before is None
    check = check_end_to_end(g, g, TimedLaunchCost(1.0, 2.0), {})
    assert check.status == "skipped: no substitution applied"


def test_cli_flags_reach_the_json(tmp_path):
    path, js = tmp_path / "in.onnx", tmp_path / "r.json"
    onnx.save(three_projections(), str(path))
    args = ["optimize", str(path), "-o", str(tmp_path / "o.onnx"), "--cost", "analytic", "--budget", "20",
            "--no-progress", "--json", str(js)]
    assert main(args + ["--no-e2e-check"]) == 0
    rep = json.loads(js.read_text())
    assert rep["e2e_check"] == "disabled" and rep["kept"] == "optimized"
    assert main(args) == 0
    assert json.loads(js.read_text())["e2e_check"].startswith("skipped")


def _matmul_model(n: int) -> onnx.ModelProto:
    b = GraphBuilder(f"mm{n}", seed=0)
    x = b.input("x", (n, n))
    b.op("MatMul", [x, b.normal("w", (n, n), 0.1)], "mm", out="y")
    b.output("y", (n, n))
    return b.model()


def test_measured_cost_times_whole_models_with_its_backend(tmp_path):
    """Real onnxruntime timing of two whole models, interleaved: a 256^3 matmul is slower than an 8^3 one."""
    cost = MeasuredCost(OrtRunner(threads=1), path=tmp_path / "cost.json")
    times = cost.time_models([import_onnx(_matmul_model(8)), import_onnx(_matmul_model(256))], runs=9)
    assert times.backend == "ort" and 0 < times.seconds[0] < times.seconds[1]


def test_blocks_alternate_with_idle_gaps_and_medians_are_per_runner():
    calls: list[str] = []
    gaps: list[float] = []
    times = time_blocks({"a": lambda: calls.append("a"), "inv": lambda: (calls.append("inv"), np.linalg.inv(np.eye(200)))},
                        runs=6, warmup=1, rounds=3, gap_s=0.25, sleep=gaps.append)
    # 3 rounds; each block = 1 warm-up + 2 timed calls; the order is reversed every other round
    assert calls == ["a"] * 3 + ["inv"] * 3 + ["inv"] * 3 + ["a"] * 3 + ["a"] * 3 + ["inv"] * 3
    assert gaps == [0.25] * 4  # an idle gap before every block but a runner's second in a row
    assert times["a"].median_ms < times["inv"].median_ms and times["a"].min_ms <= times["a"].median_ms
    assert len(times["inv"].blocks_ms) == 3 and min(times["inv"].blocks_ms) >= times["inv"].min_ms


def test_blocks_take_at_least_one_timed_call_each():
    n = []
    times = time_blocks({"x": lambda: n.append(1)}, runs=2, warmup=0, rounds=5, sleep=lambda s: None)
    assert len(n) == 2 and len(times["x"].blocks_ms) == 2  # rounds capped by runs


def test_merge_everything_wins_when_the_whole_model_says_so():
    """Per operator, merging the projections looks worse (a merged matmul costs more than the ones it
    replaces), so the search keeps nothing; timed whole, the merged graph is faster: it is kept, through
    both entry points, and the outputs still match."""
    cost = TimedLaunchCost(1.0, 0.8)
    cost.table = {1: 1.0, 2: 2.5, 3: 4.0}
    out, rep = optimize(three_projections(), cost=cost, rules=None, budget=60)
    assert rep["candidate_applied"] == {} and rep["kept"] == "merged" and rep["outputs_equal"]
    assert rep["merge_all"]["applied"] and rep["applied"] == rep["merge_all"]["applied"]
    merged = _matmuls(out)
    assert merged < 3 and {tuple(sorted(t)) for t in cost.timed} == {(merged, 3)}  # only the input and merged
    res = graph_stage(import_onnx(three_projections()), cost=cost, rules=None, budget=60)
    assert res.kept == "merged" and sum(n.op_type == "MatMul" for n in res.graph.nodes) == merged
    slower = TimedLaunchCost(1.0, 1.2)
    slower.table = cost.table
    out, rep = optimize(three_projections(), cost=slower, rules=None, budget=60)
    assert rep["kept"] == "optimized" and rep["merge_all"]["e2e_ms_after"] == 1.2 and _matmuls(out) == 3
