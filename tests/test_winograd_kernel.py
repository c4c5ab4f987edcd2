"""The Winograd NCHW[x]c kernel: F(2x2), F(4x4) and F(6x6) equal the direct convolution in numpy (within each
tile size's measured rounding), for any of its template's configs, every epilogue and maps that are not whole
tiles; the graph stage marks the layers it chooses, the mark survives ONNX export, and the pipeline builds a
marked conv with the kernel and still matches onnxruntime."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import tvm

from graphopt import winograd as wg
from graphopt.onnx_io import WINOGRAD_METADATA, export_onnx, import_onnx
from graphopt.stage import GraphStageOptions, StageClock, winograd_alternative
from kerneltune import templates
from kerneltune.templates import winograd_nchwc as W
from kerneltune.templates.conv_nchwc import ConvSpec, from_blocked, to_blocked
from tests.test_conv_nchwc import LLVM, np_conv, np_epilogue, opevo_trials, run_config
from tests.test_winograd import PricedCost, _chain, _wide_chain


def _task_inputs(spec: W.WinogradSpec, epilogue: str, seed: int = 1):
    """The task, its inputs with U made from a real weight, and numpy's conv + epilogue of them."""
    task = W.make_task(spec, epilogue)
    assert task.kind == W.KIND
    rng = np.random.default_rng(seed)
    conv = spec.conv
    x = np.maximum(rng.standard_normal((conv.n, conv.c, conv.h, conv.w)), 0).astype(np.float32)
    w = (rng.standard_normal((conv.f, conv.c, 3, 3)) * np.sqrt(2 / (9 * conv.c))).astype(np.float32)
    inputs = task.make_inputs(seed)
    named = {s.name: a for s, a in zip(task.inputs, inputs)}
    named["data"], named["weight"] = to_blocked(x, conv.ic_block), W.transform_weight(w, spec)
    inputs = [named[s.name] for s in task.inputs]
    want = np_epilogue(np_conv(x, w, conv), epilogue, named)
    return task, inputs, want


def _error(task, config, inputs, want, channels: int) -> float:
    got = from_blocked(run_config(task, config, inputs), channels)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


# The largest error each tile size may have, relative to the largest output (graphopt.compare's float32
# tolerance is 1e-4 of it).  Measured on ResNet-like layers (ReLU inputs, He-scaled weights, Intel Xeon):
# the direct conv 0.6-2.2e-6; F(2x2) 0.3-1e-6; F(4x4) 0.5-1.2e-5 (its transforms hold 4s and 5s); F(6x6)
# 0.8-2.2e-5 (B^T holds 5.25 and 4.25): one F(6x6) layer takes a fifth of the model's tolerance, so the graph
# stage offers it only where its tiles fit the map (graphopt.winograd.ConvSite.kernel_tile) and the model's
# output check against onnxruntime judges the whole.
BOUND = {2: 3e-6, 4: 3e-5, 6: 6e-5}


@pytest.mark.parametrize("m", W.TILES)
@pytest.mark.parametrize("conv", [
    ConvSpec(1, 32, 13, 11, 32, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16),  # not whole tiles
    ConvSpec(2, 16, 8, 8, 32, 3, 3, pad=(0, 0, 0, 0), ic_block=8, oc_block=16),     # batch 2, no padding
    ConvSpec(1, 64, 12, 12, 48, 3, 3, pad=(2, 1, 0, 1), ic_block=16, oc_block=16),  # asymmetric padding
    ConvSpec(1, 16, 4, 26, 16, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16),  # 13 tiles of 2 (a prime)
], ids=["13x11", "batch2-valid", "asym-pad", "prime-tiles"])
def test_every_tile_size_and_sampled_configs_match_numpy(m, conv):
    task, inputs, want = _task_inputs(W.WinogradSpec(conv, m), "bias_relu")
    space = templates.space_for(task, LLVM)
    rng = random.Random(m)
    configs = [templates.default_config(task, LLVM)]
    while len(configs) < 2:
        c = space.sample(rng)
        try:
            templates.apply(task, c, LLVM)
        except templates.InvalidConfig:
            continue
        configs.append(c)
    for config in configs:
        assert _error(task, config, inputs, want, conv.f) <= BOUND[m], space.as_dict(config)


@pytest.mark.parametrize("epilogue", ["none", "bn_relu_residual", "relu6"])
def test_epilogues_match_numpy_with_channel_chunks_outside_the_rows(epilogue):
    conv = ConvSpec(1, 64, 10, 10, 32, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16)
    task, inputs, want = _task_inputs(W.WinogradSpec(conv, 4), epilogue)
    space = templates.space_for(task, LLVM)
    values = space.as_dict(templates.default_config(task, LLVM))
    values.update(tile_c=(4, 16), c_order="outer", tile_fb=(2, 1, 1))  # the cores split channels too
    assert _error(task, space.from_dict(values), inputs, want, conv.f) <= BOUND[4]


def test_default_chunks_split_tiles_or_output_channels_by_what_outweighs_the_other():
    def default(c: int, hw: int, m: int) -> dict:
        task = W.make_task(W.WinogradSpec(ConvSpec(1, c, hw, hw, c, 3, 3, pad=(1, 1, 1, 1), ic_block=16,
                                                   oc_block=16), m))
        return templates.space_for(task, LLVM).as_dict(templates.default_config(task, LLVM))

    wide = default(64, 56, 4)  # 14x14 tiles: chunks of tile rows, every core reads the small U
    assert wide["tile_fb"][0] == 1 and wide["tile_ty"][0] >= 4 and wide["tile_tx"][2] == 7
    deep = default(512, 7, 4)  # 2x2 tiles, 37.7 MB of U: the cores take half the output channels each
    assert deep["tile_fb"][0] == 2 and deep["c_order"] == "outer"
    # AVX2's 16 registers: a row of 7 tiles (28x28 in F(4x4)) takes one output block by 7 tiles, not two by 1
    avx2 = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 2})
    task = W.make_task(W.WinogradSpec(ConvSpec(1, 64, 28, 28, 64, 3, 3, pad=(1, 1, 1, 1), ic_block=8,
                                               oc_block=8), 4))
    tiles = templates.space_for(task, avx2).as_dict(templates.default_config(task, avx2))
    assert tiles["tile_tx"][2] * tiles["tile_ty"][2] == 7 and tiles["tile_fb"][2] == 1
    # 13 tile columns of F(2x2) on 26 columns are computed as 14: a register tile of 7, not 1
    assert W.WinogradSpec(ConvSpec(1, 16, 4, 26, 16, 3, 3, pad=(1, 1, 1, 1)), 2).tiles_w == 14


def test_the_kernel_takes_only_what_it_computes():
    ok = ConvSpec(1, 32, 8, 8, 32, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16)
    assert W.unsupported(ok) is None
    for bad in (ConvSpec(1, 32, 8, 8, 32, 3, 3, stride=(2, 2), ic_block=16, oc_block=16),
                ConvSpec(1, 32, 8, 8, 32, 1, 1, ic_block=16, oc_block=16),
                ConvSpec(1, 24, 8, 8, 32, 3, 3, ic_block=16, oc_block=16),
                ConvSpec(1, 32, 8, 8, 32, 3, 3, groups=2, ic_block=16, oc_block=16)):
        assert W.unsupported(bad) is not None
        with pytest.raises(ValueError):
            W.WinogradSpec(bad, 4).check()


def test_f6_is_proven_exact_and_its_tile_is_chosen_only_where_it_fits_the_map():
    assert wg.prove(6)
    site = lambda hw: wg.ConvSite("y", 1, 64, 64, hw, hw, (1, 1, 1, 1), False)  # noqa: E731
    # many tiles (224, 112: 1444 and 361 of 6x6) take the largest tile; 56 and 28 F(4x4), where F(6x6)'s
    # larger U outweighs its 9% fewer multiplies; 14x14 and 7x7 (16 and 4 tiles of 4x4) F(2x2), whose U is
    # 16/36 of F(4x4)'s: there the weights' bytes cost more than the multiplies
    assert [site(hw).kernel_tile() for hw in (224, 112, 56, 28, 14, 7)] == [6, 6, 4, 4, 2, 2]


class KernelPriced(PricedCost):
    """PricedCost for an engine with its own Winograd kernel: a marked conv prices ``wino`` ms."""

    def __init__(self, conv: float, wino: float, before_ms: float, after_ms: float):
        super().__init__(conv, 0.0, before_ms, after_ms)
        self.wino = wino

    def blocked_winograd(self) -> bool:
        return True

    def kernel_times(self, graphs, confirm=False):
        self.priced += 1
        return [sum(self.wino if n.op_type == "Conv" and n.inputs[1] in g.winograd else
                    self.conv if n.op_type == "Conv" else 0.0 for n in g.nodes) / 1e3 for g in graphs]

    def time_models(self, graphs, runs=20):
        self.timed += 1
        from graphopt.cost.base import ModelTimes
        return ModelTimes([(self.ms[1] if g.winograd else self.ms[0]) / 1e3 for g in graphs], self.name)


def test_with_an_engine_kernel_the_stage_marks_convs_instead_of_rewriting_them():
    g = import_onnx(_wide_chain())
    cost = KernelPriced(conv=10.0, wino=6.0, before_ms=10.0, after_ms=8.0)
    out, alt = winograd_alternative(g, cost, GraphStageOptions(), StageClock(60.0))
    # 8x8 maps of 128 channels: 16 tiles of F(2x2), whose U is smaller than F(4x4)'s (ConvSite.kernel_tile)
    assert out is not None and alt.kept and alt.applied == {"winograd F(2x2,3x3) kernel": 2}
    # the operators are the input's: only the marks differ, and they travel in the ONNX file's metadata
    assert [n.op_type for n in out.nodes] == [n.op_type for n in g.nodes]
    weights = {s.weight for s in wg.conv_sites(g)}  # the two 3x3 stride-1 convs, not the stride-2 or 1x1
    assert out.winograd == {w: 2 for w in weights} and not g.winograd
    proto = export_onnx(out)
    assert json.loads({p.key: p.value for p in proto.metadata_props}[WINOGRAD_METADATA]) == out.winograd
    assert import_onnx(proto).winograd == out.winograd
    assert out.structural_hash() != g.structural_hash()  # priced and cached apart from the direct graph
    old = import_onnx(_chain(c=128, k=128, h=8, w=8, opset=9))  # opset 9: marked all the same
    out, alt = winograd_alternative(old, KernelPriced(conv=10.0, wino=6.0, before_ms=10.0, after_ms=8.0),
                                    GraphStageOptions(), StageClock(60.0))
    assert out is not None and len(out.winograd) == 2
    dear = KernelPriced(conv=10.0, wino=9.8, before_ms=10.0, after_ms=8.0)  # 2% cheaper: under the 5% gain
    out, alt = winograd_alternative(g, dear, GraphStageOptions(), StageClock(60.0))
    assert out is None and dear.timed == 0 and {r.decision for r in alt.layers} == {"direct"}


def test_a_marked_model_builds_with_the_kernel_and_matches_onnxruntime():
    """An opset-9 export (the model zoo's): marks need no operator its opset lacks."""
    from kerneltune.targets.parse import parse_target
    from pipeline.compile import check_outputs
    from pipeline.stages import compile_model, lower

    proto = _chain(c=128, k=128, h=8, w=8, opset=9)
    g = import_onnx(proto)
    marked = export_onnx(wg.mark(g, {s.node: 4 for s in wg.conv_sites(g, operators=False)}))
    spec = parse_target("llvm", 1)

    def kinds(model):
        part = lower(model, spec, "nchwc").part
        return [t.task.kind for t in part.tasks if t.task is not None], part.layout

    got, layout = kinds(marked)
    # both 128 -> 128 convs lowered to the kernel: one task (the same kernel, two weights)
    assert got.count(W.KIND) == 1 and layout["winograd"] == 2, (got, layout)
    assert W.KIND not in kinds(export_onnx(g))[0]
    res = check_outputs(compile_model(marked, spec), g, proto, seed=0)
    assert res.ok, res


def _small_task():
    return W.make_task(W.WinogradSpec(ConvSpec(1, 32, 12, 12, 32, 3, 3, pad=(1, 1, 1, 1), ic_block=16,
                                               oc_block=16), 4), "bias_relu")


def test_a_winograd_task_reads_as_its_conv_and_its_kernel():
    from kerneltune.describe import describe

    assert describe(_small_task()) == ("conv 1x32x12x12 * 32x32x3x3 (N,C,H,W * O,I,KH,KW) stride 1 pad 1 -> "
                                       "1x32x12x12, NCHW16c -> NCHW16c, Winograd F(4x4,3x3)")


@pytest.mark.slow
def test_opevo_tunes_a_winograd_task():
    result = opevo_trials(_small_task())
    assert result.trials == 6 and result.best_gflops > 0 and result.failures < 6
