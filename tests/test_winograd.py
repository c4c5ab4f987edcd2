"""Winograd convolution (graphopt.winograd): the transforms proven exact with Z3, the ONNX rewrite equal to the
direct convolution in onnxruntime and in the TVM build, and the stage's per-layer choice and end-to-end guard
(graphopt.stage.winograd_alternative)."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import onnx
import pytest

from graphopt import winograd as wg
from graphopt.cost.base import CostModel, ModelTimes
from graphopt.feeds import run_ort
from graphopt.onnx_io import export_onnx, import_onnx
from graphopt.search import SearchStop
from graphopt.stage import GraphStageOptions, StageClock, winograd_alternative
from models.builder import GraphBuilder


def _conv_ref(x: np.ndarray, w: np.ndarray, pads) -> np.ndarray:
    """Direct correlation in float64 (NCHW, 3x3, stride 1)."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    ho, wo = xp.shape[2] - 2, xp.shape[3] - 2
    out = np.zeros((x.shape[0], w.shape[0], ho, wo))
    for u in range(3):
        for v in range(3):
            out += np.einsum("nchw,kc->nkhw", xp[:, :, u:u + ho, v:v + wo], w[:, :, u, v].astype(np.float64))
    return out


@pytest.mark.parametrize("m", wg.TILES)
def test_transforms_are_proven_exact_by_z3(m):
    assert wg.prove(m)


def test_a_wrong_transform_is_refused_by_z3(monkeypatch):
    at, g, bt = wg.transform_matrices(4)
    bad = [list(r) for r in bt]
    bad[1][2] += Fraction(1, 8)  # one coefficient off
    monkeypatch.setattr(wg, "transform_matrices", lambda m: (at, g, tuple(map(tuple, bad))))
    assert not wg.prove(4)


@pytest.mark.parametrize("m", wg.TILES)
def test_one_tile_matches_the_correlation_numerically(m):
    at, g, bt = wg.float_matrices(m)
    rng = np.random.default_rng(m)
    d, f = rng.standard_normal((m + 2, m + 2)), rng.standard_normal((3, 3))
    y = at @ ((g @ f @ g.T) * (bt @ d @ bt.T)) @ at.T
    direct = np.array([[np.sum(d[i:i + 3, j:j + 3] * f) for j in range(m)] for i in range(m)])
    np.testing.assert_allclose(y, direct, rtol=1e-12, atol=1e-12)


def _conv(b: GraphBuilder, x: str, c: int, k: int, size: int, bias: bool, stride: int = 1) -> str:
    w = b.he("w", [k, c, size, size], c * size * size)
    ins = [x, w] + ([b.normal("b", [k], 0.1)] if bias else [])
    return b.op("Conv", ins, kernel_shape=[size, size], pads=[size // 2] * 4, strides=[stride, stride])


def _chain(c: int = 16, k: int = 24, h: int = 13, w: int = 11, bias: bool = True,
           opset: int = 17) -> onnx.ModelProto:
    """conv3x3 -> relu -> conv3x3 -> relu -> maxpool, plus a stride-2 conv and a 1x1 conv the rewrite leaves."""
    b = GraphBuilder("chain", seed=1, opset=opset)
    x = b.input("x", [1, c, h, w])
    y = b.op("Relu", [_conv(b, x, c, k, 3, bias)])
    y = b.op("Relu", [_conv(b, y, k, k, 3, bias)])
    y = b.op("MaxPool", [y], kernel_shape=[2, 2], strides=[2, 2])
    y = _conv(b, _conv(b, y, k, k, 3, bias, stride=2), k, 8, 1, bias)
    b.output(y, [1, 8, (h // 2 - 1) // 2 + 1, (w // 2 - 1) // 2 + 1])
    return b.model()


def test_sites_are_the_3x3_stride_1_convs():
    g = import_onnx(_chain())
    sites = wg.conv_sites(g)
    assert [(s.c, s.k, s.h, s.w) for s in sites] == [(16, 24, 13, 11), (24, 24, 13, 11)]
    # the first feeds the second through a Relu (their transposes cancel); the second feeds a MaxPool
    assert [wg.neighbours(g, sites)[s.node] for s in sites] == [(False, True), (True, False)]
    assert [s.tile() for s in wg.conv_sites(import_onnx(_chain(h=14, w=14)))] == [2, 2]  # 7 tiles of 2, not 4 of 4
    assert [s.tile() for s in wg.conv_sites(import_onnx(_chain(h=16, w=16)))] == [4, 4]
    # opset 9 spells Pad and Slice with attributes: the plain-operator rewrite leaves such a graph alone, while
    # a mark (the compiler's kernel, no new operator) takes its convs
    old = import_onnx(_chain(opset=9))
    assert wg.conv_sites(old) == [] and len(wg.conv_sites(import_onnx(_chain(opset=11)))) == 2
    assert len(wg.conv_sites(old, operators=False)) == 2
    assert len(wg.mark(old, {s.node: 2 for s in wg.conv_sites(old, operators=False)}).winograd) == 2


@pytest.mark.parametrize("m", wg.TILES)
@pytest.mark.parametrize("bias", [True, False])
def test_rewrite_computes_the_same_model_in_onnxruntime(m, bias):
    proto = _chain(bias=bias)
    g = import_onnx(proto)
    out = wg.rewrite(g, {s.node: m for s in wg.conv_sites(g)})
    # the two layers meet in NHWC: only the transposes into the first and out of the last are left
    layout = [n for n in out.nodes if n.op_type == "Transpose" and list(n.attrs["perm"]) in
              (wg.NCHW_TO_NHWC, wg.NHWC_TO_NCHW)]
    assert len(layout) == 2
    assert sum(n.op_type == "Conv" for n in out.nodes) == 2 and sum(n.op_type == "MatMul" for n in out.nodes) == 6
    x = {"x": np.random.default_rng(0).standard_normal((1, 16, 13, 11)).astype(np.float32)}
    ref, got = run_ort(proto, x)[0], run_ort(export_onnx(out), x)[0]
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("m", wg.TILES)
def test_fp32_error_against_the_direct_convolution_is_within_tolerance(m):
    """A wide layer (512 channels): the float32 Winograd output against a float64 direct convolution, beside
    the float32 direct convolution's own error (onnxruntime)."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("wide", seed=2)
    b.output(_conv(b, b.input("x", [1, 512, 8, 8]), 512, 64, 3, bias=False), [1, 64, 8, 8])
    proto = b.model()
    g = import_onnx(proto)
    w = next(iter(g.initializers.values()))
    feed = {"x": rng.standard_normal((1, 512, 8, 8)).astype(np.float32)}
    exact = _conv_ref(feed["x"], w, (1, 1, 1, 1))
    direct = run_ort(proto, feed)[0]
    wino = run_ort(export_onnx(wg.rewrite(g, {s.node: m for s in wg.conv_sites(g)})), feed)[0]
    scale = np.abs(exact).max()
    err_direct, err_wino = np.abs(direct - exact).max() / scale, np.abs(wino - exact).max() / scale
    # the output tolerance (graphopt.compare, float32) is 1e-4 of the largest output; measured here:
    # F(2x2) 4.6e-7 and F(4x4) 8.4e-6 against the direct conv's 3.5e-7 (F(4x4)'s transforms hold 4s and 5s)
    assert err_wino <= 1e-1 * 1e-4, (err_wino, err_direct)
    assert err_wino <= {2: 4, 4: 50}[m] * max(err_direct, 1e-7), (err_wino, err_direct)


def test_rewrite_builds_and_matches_in_tvm():
    from kerneltune.targets.parse import parse_target
    from pipeline.compile import check_outputs
    from pipeline.stages import compile_model

    proto = _chain(h=12, w=12)
    g = import_onnx(proto)
    out = export_onnx(wg.rewrite(g, {s.node: 4 for s in wg.conv_sites(g)}))
    compiled = compile_model(out, parse_target("llvm", 1))
    res = check_outputs(compiled, g, proto, seed=0)
    assert res.ok and res.max_abs_err <= 1e-4, res


class PricedCost(CostModel):
    """Prices a model by its nodes: a Conv ``conv`` ms, a MatMul ``matmul`` ms; whole-model timings given."""

    name = "priced"

    def __init__(self, conv: float, matmul: float, before_ms: float, after_ms: float):
        self.conv, self.matmul, self.ms = conv, matmul, (before_ms, after_ms)
        self.priced, self.timed = 0, 0

    def op_cost(self, op, params, in_shapes, dtype="float32"):
        return 0.0

    def opaque_cost(self, node, graph):
        return 0.0

    def kernel_times(self, graphs, confirm=False):
        self.priced += 1
        return [sum(self.conv if n.op_type == "Conv" else self.matmul if n.op_type == "MatMul" else 0.0
                    for n in g.nodes) / 1e3 for g in graphs]

    def time_models(self, graphs, runs=20):
        self.timed += 1
        return ModelTimes([(self.ms[0] if any(n.op_type == "Conv" and len(n.inputs) > 1 for n in g.nodes)
                            and not any(n.op_type == "MatMul" for n in g.nodes) else self.ms[1]) / 1e3
                           for g in graphs], self.name)


def _wide_chain() -> onnx.ModelProto:
    return _chain(c=128, k=128, h=8, w=8)


def test_stage_keeps_winograd_where_its_layers_price_cheaper_and_it_runs_faster():
    g = import_onnx(_wide_chain())
    cost = PricedCost(conv=10.0, matmul=2.0, before_ms=10.0, after_ms=8.0)
    out, alt = winograd_alternative(g, cost, GraphStageOptions(), StageClock(60.0))
    assert out is not None and alt.kept and alt.check.status == "measured"
    assert alt.applied == {"winograd F(4x4,3x3) operators": 2}
    assert [(r.c, r.k, r.h, r.w, r.tile) for r in alt.layers] == [(128, 128, 8, 8, 4)] * 2
    # both convs are 128 -> 128 on 8x8, one feeding the other: priced apart (each has one transpose the pair
    # cancels); their prices are the gate's (no second pricing of the whole models)
    assert [(r.decision, r.neighbours) for r in alt.layers] == [
        ("F(4x4,3x3)", (False, True)), ("F(4x4,3x3)", (True, False))] and cost.priced == 2
    assert (alt.check.kernels_ms_before, alt.check.kernels_ms_after) == (20.0, 12.0)
    # report.json's form: the layers' rows, then the check's fields, "kept" saying whether Winograd was kept
    info = alt.to_json()
    assert list(info) == ["layers", "applied", "kept", "e2e_check", "e2e_ms_before", "e2e_ms_after", "e2e_backend",
                          "e2e_margin", "e2e_decision", "e2e_ratios", "kernels_ms_before", "kernels_ms_after"]
    assert info["kept"] is True and info["layers"][0] == {
        "convs": [alt.layers[0].convs[0]], "n": 1, "c": 128, "k": 128, "h": 8, "w": 8, "tile": 4,
        "neighbours": [False, True], "direct_ms": 10.0, "winograd_ms": 6.0, "decision": "F(4x4,3x3)"}


def test_stage_keeps_the_direct_convs_where_winograd_prices_dearer_or_runs_slower():
    g = import_onnx(_wide_chain())
    dear = PricedCost(conv=5.0, matmul=2.0, before_ms=10.0, after_ms=8.0)  # 3 matmuls = 6 ms > 5
    out, alt = winograd_alternative(g, dear, GraphStageOptions(), StageClock(60.0))
    assert out is None and dear.timed == 0 and {r.decision for r in alt.layers} == {"direct"}
    assert alt.check is None and list(alt.to_json()) == ["layers"]
    slow = PricedCost(conv=10.0, matmul=2.0, before_ms=10.0, after_ms=12.0)
    out, alt = winograd_alternative(g, slow, GraphStageOptions(), StageClock(60.0))
    assert out is None and not alt.kept and slow.timed > 0 and alt.check.ms_after > alt.check.ms_before
    assert alt.to_json()["kept"] is False


def test_stage_prices_no_thin_layer_and_nothing_past_its_time_limit():
    thin = PricedCost(conv=10.0, matmul=2.0, before_ms=10.0, after_ms=8.0)
    out, alt = winograd_alternative(import_onnx(_chain()), thin, GraphStageOptions(), StageClock(60.0))
    assert out is None and alt.to_json() == {} and thin.priced == 0  # 16/24 channels: C*K/(C+K) < 48
    alone = PricedCost(conv=10.0, matmul=2.0, before_ms=10.0, after_ms=8.0)  # one wide conv: two transposes
    b = GraphBuilder("alone", seed=1)
    b.output(b.op("Relu", [_conv(b, b.input("x", [1, 128, 8, 8]), 128, 128, 3, True)]), [1, 128, 8, 8])
    out, alt = winograd_alternative(import_onnx(b.model()), alone, GraphStageOptions(), StageClock(60.0))
    assert out is None and alone.priced == 0 and [r.decision for r in alt.layers] == [
        "not priced: isolated (no candidate layer next to it)"]
    late = PricedCost(conv=10.0, matmul=2.0, before_ms=10.0, after_ms=8.0)
    out, alt = winograd_alternative(import_onnx(_wide_chain()), late, GraphStageOptions(), StageClock(0.0))
    assert out is None and late.priced == 0 and alt.stopped_by is SearchStop.TIME_LIMIT and alt.timed_out
    assert alt.to_json()["stopped_by"] == "time limit"


def test_stage_prices_layers_with_the_tvm_runner(tmp_path):
    """The real pricing path: each layer built by the pipeline direct (blocked layout) and as Winograd, priced
    as its kernels; whichever wins, what the stage hands back computes the input's function."""
    from graphopt.cost.measured import MeasuredCost
    from pipeline.pricing.graph_runner import TvmRunner
    from pipeline.stages import compile_graph, compile_model, kernel_times

    proto = _wide_chain()
    g = import_onnx(proto)
    cost = MeasuredCost(TvmRunner(compile_graph, 1, price_kernels=kernel_times, compile_model=compile_model),
                        path=tmp_path / "cost.json")
    out, alt = winograd_alternative(g, cost, GraphStageOptions(e2e_runs=3), StageClock(600.0))
    assert [r.neighbours for r in alt.layers] == [(False, True), (True, False)]
    # the TVM runner on llvm has the Winograd kernel: the 8x8 maps take F(2x2) (few tiles, 128 channels)
    assert all(r.direct_ms > 0 and r.winograd_ms > 0 and r.decision in ("direct", "F(2x2,3x3)")
               for r in alt.layers)
    chosen = sum(r.decision != "direct" for r in alt.layers)
    assert (out is not None) == alt.kept and (chosen > 0 or out is None)
    if out is not None:
        x = {"x": np.random.default_rng(0).standard_normal((1, 128, 8, 8)).astype(np.float32)}
        ref, got = run_ort(proto, x)[0], run_ort(export_onnx(out), x)[0]
        assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())

