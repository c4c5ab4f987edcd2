"""The graph stage on what real models and real machines throw at it (issue 13 items 3 and 7): weights listed
as graph inputs (opset-9 model zoo), a cost model that cannot price an operator, a time limit that covers
pricing and the end-to-end check, a cost cache keyed by CPU and threads, and a keep/reject decision that a
rerun does not flip."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import fresh_cache
from graphopt.console import version
from graphopt.cost import measured as measured_mod
from graphopt.cost.cache import cpu_id
from graphopt.cost.measured import MeasuredCost
from graphopt.cost.runners import OrtRunner, timing_feeds
from graphopt.feeds import random_inputs, run_ort
from graphopt.ir import Graph
from graphopt.onnx_io import import_onnx
from graphopt.stage import GraphStageOptions, optimize_graph, optimize_onnx
from graphopt.timing import decide
from pipeline.cli import graphopt_main, optimize_model_main
from test_e2e_check import TimedLaunchCost
from test_match import merge_bias, merge_matmul, three_projections

ROOT = Path(__file__).resolve().parents[1]
HAND = [merge_matmul(2), merge_matmul(3), merge_bias(2), merge_bias(3)]


def zoo_opset9(ir_version: int = 3) -> onnx.ModelProto:
    """An opset-9 classifier in the old convention: every initializer is also a graph input (required
    before IR 4), among them the target shape of a Reshape."""
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
               "b": rng.standard_normal(8).astype(np.float32) * 0.1,
               "shape": np.array([1, -1], np.int64),
               "fw": rng.standard_normal((8 * 6 * 6, 10)).astype(np.float32) * 0.05,
               "fb": rng.standard_normal(10).astype(np.float32) * 0.1}
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Reshape", ["p", "shape"], ["f"]),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])] + [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "zoo9", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = ir_version
    onnx.checker.check_model(m, full_check=True)
    return m


def _ort_equal(a: onnx.ModelProto, b: onnx.ModelProto, seed: int = 0) -> None:
    feeds = random_inputs(import_onnx(a), seed)
    for x, y in zip(run_ort(a, feeds), run_ort(b, feeds)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)


# ---- item 3: initializers listed as inputs, pricing failures ------------------------------------------------

def test_opset9_weights_listed_as_inputs_are_constants(tmp_path):
    """The stage makes them weights (the Reshape's shape is known, the pricing model is built with it) and the
    result runs like the input in onnxruntime; the exported model is valid at IR 4."""
    proto = zoo_opset9()
    cost = MeasuredCost(OrtRunner(1), path=tmp_path / "cost.json")
    out, rep = optimize_onnx(proto, cost, GraphStageOptions(time_limit=30))
    assert rep["outputs_equal"] and rep["frozen_weights"] == 5 and rep["pricing_failures"] == {}
    assert rep["stop_reason"] == "complete" and cost.measured > 0
    if out is not proto:
        assert [i.name for i in out.graph.input] == ["x"] and out.ir_version >= 4
        onnx.checker.check_model(out, full_check=True)
    _ort_equal(proto, out)
    res = optimize_graph(import_onnx(proto), cost, GraphStageOptions(time_limit=30))
    assert [i.name for i in res.graph.inputs] == ["x"] and res.graph.is_constant("shape")


def test_weights_kept_as_inputs_when_asked_and_unpriceable_nodes_do_not_abort(tmp_path, caplog):
    """``--weights-as-inputs``: the Reshape's shape is a runtime input, so its one-node pricing model fails in
    onnxruntime (fed zeros: the old crash); that node is priced by estimate, logged once, and the stage
    completes with a correct model that keeps every input."""
    src, out = tmp_path / "zoo9.onnx", tmp_path / "out.onnx"
    onnx.save(zoo_opset9(), str(src))
    js = tmp_path / "r.json"
    with caplog.at_level(logging.WARNING, logger="graphopt.cost.guard"):
        assert graphopt_main(["optimize", str(src), "-o", str(out), "--backend", "ort", "--weights-as-inputs",
                              "--no-progress", "--time-limit", "30", "--json", str(js)]) == 0
    rep = json.loads(js.read_text())
    assert rep["outputs_equal"] and rep["frozen_weights"] == 0 and "Reshape" in rep["pricing_failures"]
    assert sum("Reshape" in r.getMessage() for r in caplog.records) == 1
    model = onnx.load(str(out))
    assert [i.name for i in model.graph.input] == ["x", "w", "b", "shape", "fw", "fb"]
    _ort_equal(zoo_opset9(), model)


class FailingRunner(OrtRunner):
    """onnxruntime, except that a one-operator model of ``op`` raises: a cost runner that cannot run one op."""

    def __init__(self, op: str, threads: int = 1):
        super().__init__(threads)
        self.op = op
        self.refused = 0

    def prepare(self, graph: Graph):
        if len(graph.nodes) == 1 and graph.nodes[0].op_type == self.op:
            self.refused += 1
            raise RuntimeError(f"cannot build {self.op} alone")
        return super().prepare(graph)


@pytest.mark.parametrize("op", ["MatMul"])
def test_a_cost_runner_failing_on_one_op_does_not_abort_the_stage(tmp_path, op, caplog):
    proto = three_projections()
    runner = FailingRunner(op)
    cost = MeasuredCost(runner, path=tmp_path / "cost.json")
    with caplog.at_level(logging.WARNING, logger="graphopt.cost.guard"):
        out, rep = optimize_onnx(proto, cost, GraphStageOptions(rules=HAND, budget=60, time_limit=30))
    assert rep["outputs_equal"] and rep["max_abs_err"] <= 1e-5
    failures = rep["pricing_failures"]  # per operator kind (the operator-view name: matmul)
    assert failures and all(f"cannot build {op}" in why for why in failures.values())
    assert len([r for r in caplog.records if "cannot build" in r.getMessage()]) == len(failures)  # once each
    assert runner.refused >= 1 and rep["cost_before"] > 0
    _ort_equal(proto, out)


# ---- item 7: the time limit, the cache key, the same decision on a rerun -------------------------------------

class SlowRunner(OrtRunner):
    """onnxruntime that takes ``delay`` seconds to build each model (a TVM compile, in miniature)."""

    def __init__(self, delay: float):
        super().__init__(1)
        self.delay = delay
        self.prepared = 0

    def prepare(self, graph: Graph):
        time.sleep(self.delay)
        self.prepared += 1
        return super().prepare(graph)


def many_ops(width: int = 12) -> onnx.ModelProto:
    """A chain of ``width`` element-wise ops of distinct kinds and sizes: each prices as a new operator."""
    kinds = ["Relu", "Sigmoid", "Tanh", "Abs", "Neg", "Exp"]
    nodes, t = [], "x"
    for i in range(width):
        nodes.append(helper.make_node(kinds[i % len(kinds)], [t], [f"t{i}"]))
        t = f"t{i}"
    nodes.append(helper.make_node("Identity", [t], ["y"]))
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_a_tiny_time_limit_stops_pricing_and_keeps_a_correct_graph(tmp_path):
    """Twelve operators, each 1 s to build alone: unbounded, pricing alone takes 12 s.  With a 1 s limit the
    stage stops measuring at its pricing deadline, estimates the rest, and says so."""
    runner = SlowRunner(1.0)
    cost = MeasuredCost(runner, path=tmp_path / "cost.json")
    proto = many_ops()
    start = time.perf_counter()
    out, rep = optimize_onnx(proto, cost, GraphStageOptions(time_limit=1.0, rules=HAND))
    elapsed = time.perf_counter() - start
    assert rep["stop_reason"].startswith("time limit") and "pricing" in rep["stop_reason"]
    assert rep["estimated_prices"] > 0 and cost.measured <= 3 and runner.prepared <= 4
    assert elapsed < 8.0  # far below the 12 s that measuring every operator takes
    assert rep["outputs_equal"]
    _ort_equal(proto, out)
    # nothing estimated went into the cache: a later run with time measures it
    assert len(json.loads((tmp_path / "cost.json").read_text())) == cost.measured + 1  # + the baseline


class SlowTimedCost(TimedLaunchCost):
    """Merging pays per operator; each whole-model timing block takes ``delay`` seconds."""

    def __init__(self, delay: float):
        super().__init__(1.0, 0.5)
        self.delay = delay

    def time_models(self, graphs, runs=20):
        time.sleep(self.delay)
        return super().time_models(graphs, runs)


def test_time_limit_covers_the_end_to_end_check():
    """The search applies a merge; each timing block takes 1 s; with a 1.5 s limit the check stops after
    two of its three blocks and keeps the input (undecided), and the merge alternative is not tried."""
    cost = SlowTimedCost(1.0)
    start = time.perf_counter()
    res = optimize_graph(import_onnx(three_projections()), cost, GraphStageOptions(rules=HAND, budget=60,
                                                                                     time_limit=1.5))
    elapsed = time.perf_counter() - start
    assert res.search.applied and res.kept == "original" and len(cost.timed) == 2
    assert "time limit" in res.check.decision
    assert res.stop_reason == "time limit: end-to-end check (input kept); merge alternative (not tried)"
    assert elapsed < 4.0  # unbounded: 3 blocks here, 3 more for the merge alternative
    unbounded = SlowTimedCost(0.0)
    res = optimize_graph(import_onnx(three_projections()), unbounded, GraphStageOptions(rules=HAND, budget=60))
    assert res.kept == "optimized" and res.stop_reason == "complete" and len(unbounded.timed) == 3


def test_cost_cache_is_keyed_by_cpu_target_engine_threads_and_version(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_MODEL_CACHE", str(tmp_path))
    v = version()
    names = {MeasuredCost(OrtRunner(t)).cache.path.name for t in (1, 2)}
    assert names == {f"cost-llvm-{cpu_id()}-ort-t1-v{v}.json", f"cost-llvm-{cpu_id()}-ort-t2-v{v}.json"}
    monkeypatch.setattr(measured_mod, "cpu_id", lambda: "other-cpu-0000")
    assert MeasuredCost(OrtRunner(1)).cache.path.name == f"cost-llvm-other-cpu-0000-ort-t1-v{v}.json"
    assert cpu_id() and "/" not in cpu_id() and " " not in cpu_id()
    # Another release of the tool: a fresh cache, whose costs never come from the old one.
    first = MeasuredCost(OrtRunner(1)).cache
    first.put("op|Relu|x", 1.0)
    first.flush()
    assert MeasuredCost(OrtRunner(1)).cache.get("op|Relu|x") == 1.0  # on disk for this version
    monkeypatch.setattr(measured_mod, "version", lambda: "99.0.0")
    new = MeasuredCost(OrtRunner(1))
    assert new.cache.path.name.endswith("-v99.0.0.json") and new.cache.get("op|Relu|x") is None


def test_cost_cache_of_tvm_is_keyed_by_the_cpu_the_code_is_built_for():
    """TVM code built with -mcpu=X runs at X's speed on this CPU: its costs are cached apart."""
    from kerneltune.targets.parse import parse_target
    from pipeline.pricing.graph_runner import TvmRunner
    from pipeline.stages import compile_graph

    def tag(target: str) -> str:
        return TvmRunner(compile_graph, 1, parse_target(target, 1)).cache_tag

    assert TvmRunner(compile_graph, 1).cache_tag == tag("llvm") == "tvm"
    assert tag("llvm -mcpu=skylake-avx512") == "tvm-mcpu-skylake-avx512"
    assert tag('{"kind": "llvm", "mcpu": "znver4"}') == "tvm-mcpu-znver4"
    assert OrtRunner(1).cache_tag == "ort"


def test_the_graphopt_command_builds_for_its_target_cpu():
    """``graphopt optimize --backend tvm --target 'llvm -mcpu=X -mattr=...'``: its runner builds for that CPU (the
    spec made from the parsed request, as optimize-model's BuildContext makes its own), not this machine's,
    and caches its timings apart; onnxruntime's runner runs here whatever the target."""
    from kerneltune.targets.parse import parse_target
    from pipeline.cli import GRAPHOPT_COMPONENTS
    from pipeline.pricing.graph_runner import TvmRunner
    from pipeline.stages import compile_graph

    text = "llvm -mcpu=skylake-avx512 -mattr=+avx2"
    runner = GRAPHOPT_COMPONENTS.runners["tvm"](1, text)
    assert runner.cache_tag == TvmRunner(compile_graph, 1, parse_target(text, 1)).cache_tag
    assert runner.cache_tag.startswith("tvm-mcpu-skylake-avx512-mattr")
    spec = runner._target()  # built on first use
    assert spec.target.attrs["mcpu"] == "skylake-avx512" and list(spec.target.attrs["mattr"]) == ["+avx2"]
    # the threads TVM's pool really has (sized once per process: an earlier test may have made it 2)
    assert spec.request.text == text and spec.threads == runner.threads
    assert GRAPHOPT_COMPONENTS.runners["tvm"](1).cache_tag == "tvm"  # bench/graphopt_models.py's call
    assert GRAPHOPT_COMPONENTS.runners["ort"](1, text).cache_tag == "ort"


def test_two_runs_with_the_same_cache_give_the_same_graph(tmp_path):
    """Real onnxruntime timings: whatever the first run decides is recorded with the costs, and the second
    run (same command, same cache) reuses both, so it hands back the same graph."""
    results = []
    for _ in range(2):
        cost = MeasuredCost(OrtRunner(1), path=tmp_path / "cost.json")
        res = optimize_graph(import_onnx(three_projections()), cost,
                             GraphStageOptions(budget=60, e2e_runs=5))
        results.append((res, cost.measured))
    (first, measured_first), (second, measured_second) = results

    def statuses(r):  # the search's check and the merge alternative's
        return {r.check.status, r.merge_all.check and r.merge_all.check.status}

    assert measured_first > 0 and measured_second == 0
    assert "measured" in statuses(first) and "recorded" in statuses(second) and "measured" not in statuses(second)
    assert second.kept == first.kept and second.graph.structural_hash() == first.graph.structural_hash()


def test_decision_is_a_sign_test_on_blocks_beyond_the_margin():
    calls = []

    def block(ratios):
        def run(b):
            calls.append(b)
            return 10.0, 10.0 * ratios[b % len(ratios)]
        return run

    d = decide(block([0.9]), 0.02)
    assert d.faster and d.comparison.ratios == (0.9, 0.9, 0.9) and calls == [0, 1, 2]
    assert not decide(block([0.99]), 0.02).faster  # inside the margin: the input stays
    d = decide(block([0.9, 0.9, 1.05]), 0.02)  # 5 of 7 (p = 0.23): more blocks, then the input stays
    assert not d.faster and len(d.comparison.ratios) == 7 and d.reason.startswith("undecided")
    # the ResNet-50 case (6 of 7 under the old every-block rule, undecided): the first block inside the margin,
    # then faster: decided after 5 of 6 (p = 0.11)
    d = decide(block([0.986, 0.945, 0.941, 0.818, 0.913, 0.899, 0.853]), 0.02)
    assert d.faster and len(d.comparison.ratios) == 6 and "5 of 6" in d.reason
    d = decide(block([0.99, 0.9, 0.9, 0.9, 0.9, 0.99, 0.99]), 0.02)  # 4 of 7 at most: kept
    assert not d.faster
    d = decide(block([1.1, 0.9, 0.9]), 0.02, max_blocks=7)
    assert not d.faster
    d = decide(block([0.9]), 0.02, deadline=time.perf_counter() - 1)  # past the deadline after one block
    assert not d.faster and "time limit" in d.reason and len(d.comparison.ratios) == 1


def test_optimize_model_time_limit_is_checked_in_one_line(capsys):
    assert optimize_model_main(["m.onnx", "-o", "out", "--time-limit", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--time-limit" in err[0]


def test_optimize_model_on_an_opset9_zoo_graph(tmp_path, monkeypatch, capsys):
    """The whole pipeline (graph stage priced with TVM, compile, check against onnxruntime) on the old
    convention; it crashed in the cost model before (a Reshape fed a zero shape)."""
    monkeypatch.setenv("OPTIMIZE_MODEL_CACHE", str(fresh_cache(tmp_path / "cache")))
    src, out = tmp_path / "zoo9.onnx", tmp_path / "out"
    onnx.save(zoo_opset9(), str(src))
    assert optimize_model_main([str(src), "-o", str(out), "--skip-tune", "--no-progress", "--threads", "1",
                                "--time-limit", "60"]) == 0
    graph = json.loads((out / "report.json").read_text())["stages"]["graph"]
    assert graph["frozen_weights"] == 5 and graph["pricing_failures"] == {} and graph["stop_reason"] == "complete"
    _ort_equal(zoo_opset9(), onnx.load(str(out / "optimized.onnx")))


# ---- integer division by a tensor (issue 25 item 1): SIGFPE killed the process, exit 136, no message --------
def int_division_model() -> onnx.ModelProto:
    """c = a / b and d = a mod b on int64 inputs, beside a float MatMul-Relu the graph stage prices."""
    w = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)
    nodes = [helper.make_node("Div", ["a", "b"], ["c"]), helper.make_node("Mod", ["a", "b"], ["d"]),
             helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, [4]) for n in ("a", "b", "c", "d")]
    g = helper.make_graph(nodes, "intdiv", [*ints[:2], helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [*ints[2:], helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_timing_inputs_are_never_zero_divisors_and_indices_stay_valid():
    """The cost model times each operator alone on :func:`timing_feeds`: all-zero integers made every
    integer Div a division by zero (SIGFPE in TVM's code, an error in onnxruntime's)."""
    table = numpy_helper.from_array(np.ones((1, 4), np.float32), "table")  # an axis of size 1: only 0 indexes it
    nodes = [helper.make_node("Div", ["a", "b"], ["c"]), helper.make_node("Gather", ["table", "ids"], ["e"])]
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, [3]) for n in ("a", "b", "ids")]
    g = helper.make_graph(nodes, "g", ints,
                          [helper.make_tensor_value_info("c", TensorProto.INT64, [3]),
                           helper.make_tensor_value_info("e", TensorProto.FLOAT, [3, 4])], [table])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    graph = import_onnx(m)
    feeds = timing_feeds(graph)
    assert (feeds["b"] != 0).all() and (feeds["ids"] == 0).all()
    OrtRunner(1).prepare(graph)()  # raised "Integer division by zero" before


def test_integer_division_by_an_input_through_the_graph_stage_and_the_build(tmp_path):
    """optimize-model in a process of its own (SIGFPE kills it: exit 136, no message) with a fresh cost cache,
    so that the graph stage times the Div: the graph it keeps and the built model equal onnxruntime, and the
    built model survives a zero divisor, where onnxruntime raises."""
    src = tmp_path / "intdiv.onnx"
    onnx.save(int_division_model(), str(src))
    samples = {"a": np.array([7, -7, 9, -9]), "b": np.array([2, 2, -4, -4]),
               "x": np.random.default_rng(6).standard_normal((2, 8)).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **samples)
    np.savez(tmp_path / "zero.npz", **dict(samples, b=np.array([2, 0, -4, 0])))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), TVM_NUM_THREADS="1", OPTIMIZE_MODEL_CACHE=str(fresh_cache(tmp_path / "cache")))

    def run(command: str, *args: str) -> None:
        main = {"optimize-model": "optimize_model_main", "run-model": "run_model_main"}
        code = f"import sys; from pipeline.cli import {main[command]}; sys.exit({main[command]}())"
        p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, (command, p.returncode, p.stderr[-2000:])

    expected = run_ort(int_division_model(), samples)
    run("optimize-model", str(src), "-o", str(tmp_path / "out"), "--inputs", str(tmp_path / "in.npz"),
        "--skip-tune", "--no-progress", "--threads", "1")
    for got, want in zip(run_ort(onnx.load(str(tmp_path / "out" / "optimized.onnx")), samples), expected):
        np.testing.assert_array_equal(got, want)

    def built_outputs(inputs: str) -> dict[str, np.ndarray]:
        out = tmp_path / f"got-{inputs}"
        run("run-model", str(tmp_path / "out"), "--inputs", str(tmp_path / inputs), "--repeat", "1", "--outputs", str(out))
        with np.load(out) as got:
            return {k: got[k] for k in got.files}

    got = built_outputs("in.npz")
    np.testing.assert_array_equal(got["c"], expected[0])
    np.testing.assert_array_equal(got["d"], expected[1])
    np.testing.assert_allclose(got["y"], expected[2], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(built_outputs("zero.npz")["c"], [3, -7, -2, -9])  # b = 0: divided by 1
