"""NCHWc convolutions: computes and template equal numpy for dense / grouped / depthwise convs with strides,
padding, dilation, channel counts that are not multiples of the block and every fused epilogue; the search
space's configs stay correct; the measurer and a searcher run on the tasks."""
from __future__ import annotations

import random

import numpy as np
import pytest
import tvm

from kerneltune import prepack, templates
from kerneltune.templates.conv_nchwc import (EPILOGUES, KIND, ConvSpec, from_blocked, make_task, merge_factor,
                                   merge_groups, to_blocked)
from kerneltune.targets.host import llvm_target
from kerneltune.task import build_func, run_func

LLVM = llvm_target(2)
AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})  # rules that name a tile


def np_conv(x, w, spec: ConvSpec) -> np.ndarray:
    """Grouped conv2d in float64 numpy (NCHW, OIHW), any stride / padding / dilation."""
    top, left, bottom, right = spec.pad
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    sh, sw = spec.stride
    dh, dw = spec.dilation
    oh, ow = spec.out_h, spec.out_w
    out = np.zeros((x.shape[0], spec.f, oh, ow))
    cg, fg = spec.cg, spec.fg
    for g in range(spec.groups):
        xs = xp[:, g * cg:(g + 1) * cg]
        ws = w[g * fg:(g + 1) * fg].astype(np.float64)
        for ry in range(spec.kh):
            for rx in range(spec.kw):
                win = xs[:, :, ry * dh:ry * dh + sh * (oh - 1) + 1:sh, rx * dw:rx * dw + sw * (ow - 1) + 1:sw]
                out[:, g * fg:(g + 1) * fg] += np.einsum("nchw,fc->nfhw", win, ws[:, :, ry, rx])
    return out


def np_epilogue(y, epilogue: str, extra: dict) -> np.ndarray:
    """The epilogue on NCHW ``y`` (per-channel params arrive blocked, as the task takes them)."""
    chan = lambda name: from_blocked(extra[name], y.shape[1])  # noqa: E731
    for part in ([] if epilogue == "none" else epilogue.split("_")):
        if part == "bias":
            y = y + chan("bias")
        elif part == "bn":
            y = y * chan("scale") + chan("shift")
        elif part == "relu":
            y = np.maximum(y, 0)
        elif part == "relu6":
            y = np.clip(y, 0, 6)
        elif part == "silu":
            y = y / (1 + np.exp(-y))
        elif part == "hardswish":
            y = y * np.clip(y + 3, 0, 6) / 6
        elif part == "residual":
            y = y + from_blocked(extra["residual"], y.shape[1])
    return y


def run_config(task, config, inputs):
    func, packings = prepack.strip(templates.apply(task, config, LLVM))
    lib = build_func(func, LLVM)
    return run_func(lib, task, prepack.pack_inputs(inputs, packings), tvm.cpu())[0]


def check_against_numpy(spec: ConvSpec, epilogue: str = "none", n_random: int = 2, seed: int = 0):
    task = make_task(spec, epilogue)
    assert task.kind == KIND
    inputs = task.make_inputs(seed=1)
    named = {s.name: x for s, x in zip(task.inputs, inputs)}
    x, w = from_blocked(named["data"], spec.c), named["weight"]
    want = np_epilogue(np_conv(x, w, spec), epilogue, named)
    space = templates.space_for(task, LLVM)
    rng = random.Random(seed)
    configs = [templates.default_config(task, LLVM)]
    while len(configs) < 1 + n_random:
        c = space.sample(rng)
        try:
            templates.apply(task, c, LLVM)
        except templates.InvalidConfig:
            continue  # register tile over the limit: refused before building, by design
        configs.append(c)
    scale = max(1.0, float(np.abs(want).max()))
    for config in configs:
        got = from_blocked(run_config(task, config, inputs), spec.f)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=str(space.as_dict(config)))
    return task


@pytest.mark.parametrize("spec", [
    ConvSpec(1, 16, 10, 10, 32, 3, 3, pad=(1, 1, 1, 1), ic_block=8, oc_block=16),
    ConvSpec(1, 32, 9, 11, 16, 3, 3, stride=(2, 2), pad=(1, 1, 1, 1), ic_block=16, oc_block=8),
    ConvSpec(2, 16, 12, 12, 16, 3, 3, pad=(2, 2, 2, 2), dilation=(2, 2), ic_block=8, oc_block=8),
    ConvSpec(1, 32, 7, 7, 48, 1, 1, ic_block=16, oc_block=16),
    ConvSpec(1, 8, 9, 9, 16, 5, 3, stride=(2, 1), pad=(2, 0, 1, 1), ic_block=8, oc_block=16),
], ids=["3x3", "stride2", "dilation2-batch2", "1x1", "asymmetric"])
def test_dense_matches_numpy(spec):
    task = check_against_numpy(spec)
    assert task.dims["useful_flops"] == spec.flops == task.flops


@pytest.mark.parametrize("spec", [
    ConvSpec(1, 16, 19, 19, 16, 3, 3, ic_block=16, oc_block=16),  # 17 wide: split as 18
    ConvSpec(1, 16, 17, 17, 16, 1, 7, pad=(0, 3, 0, 3), ic_block=16, oc_block=8),  # Inception's 1x7
    ConvSpec(1, 8, 13, 13, 16, 3, 3, pad=(1, 1, 1, 1), ic_block=8, oc_block=16),  # 13 wide: split as 14
], ids=["17-wide", "1x7-17-wide", "13-wide-padded"])
def test_prime_widths_split_past_their_end_match_numpy(spec):
    """Inception-v3's 17- and 71-wide maps gave 1-column register tiles; the x axis is split as if padded."""
    from kerneltune.templates.cpu_nchwc import padded_width

    task = check_against_numpy(spec, n_random=3)
    assert padded_width(task) > spec.out_w
    # unrolled taps (3x3): the anchor computes the padded width and a crop follows; 1x7: split past the end
    computed = next(a.extent for a in task.axes if a.role == "x")
    assert computed == (padded_width(task) if spec.kw == 3 else spec.out_w), computed
    cfg = dict(zip(templates.space_for(task, LLVM).names, templates.default_config(task, LLVM)))
    assert cfg["tile_x"][1] >= 4


@pytest.mark.parametrize("spec", [
    ConvSpec(1, 3, 11, 11, 10, 3, 3, stride=(2, 2), pad=(1, 1, 1, 1), ic_block=3, oc_block=5),  # RGB stem
    ConvSpec(1, 10, 8, 8, 12, 3, 3, pad=(1, 1, 1, 1), ic_block=8, oc_block=8),  # blocks do not divide
    ConvSpec(1, 20, 6, 6, 7, 1, 1, ic_block=16, oc_block=4),
], ids=["rgb-odd", "padded-blocks", "padded-1x1"])
def test_odd_channel_counts_match_numpy(spec):
    check_against_numpy(spec)


@pytest.mark.parametrize("spec", [
    ConvSpec(1, 32, 9, 9, 64, 3, 3, stride=(2, 2), pad=(1, 1, 1, 1), groups=2, ic_block=16, oc_block=16),
    ConvSpec(1, 64, 8, 8, 64, 3, 3, pad=(1, 1, 1, 1), groups=4, ic_block=16, oc_block=8),
], ids=["2-groups-stride2", "4-groups"])
def test_grouped_matches_numpy(spec):
    check_against_numpy(spec)


@pytest.mark.parametrize("spec", [
    ConvSpec(1, 32, 9, 9, 32, 3, 3, pad=(1, 1, 1, 1), groups=32, ic_block=16, oc_block=16),
    ConvSpec(1, 24, 12, 12, 24, 3, 3, stride=(2, 2), pad=(1, 1, 1, 1), groups=24, ic_block=8, oc_block=8),
    ConvSpec(1, 16, 11, 11, 16, 5, 5, pad=(4, 4, 4, 4), dilation=(2, 2), groups=16, ic_block=16, oc_block=16),
    ConvSpec(1, 12, 7, 7, 12, 3, 3, pad=(1, 1, 1, 1), groups=12, ic_block=8, oc_block=8),  # padded block
], ids=["3x3", "stride2", "5x5-dilated", "padded"])
def test_depthwise_matches_numpy(spec):
    check_against_numpy(spec)


@pytest.mark.parametrize("epilogue", [e for e in EPILOGUES if e != "none"])
def test_every_epilogue_matches_numpy(epilogue):
    spec = ConvSpec(1, 16, 8, 8, 16, 3, 3, pad=(1, 1, 1, 1), ic_block=8, oc_block=16)
    task = check_against_numpy(spec, epilogue, n_random=1)
    assert task.epilogue, "the epilogue must be fused into the conv kernel"


@pytest.mark.parametrize("epilogue", ["relu6", "silu", "bn_relu_residual"])
def test_depthwise_epilogues_match_numpy(epilogue):
    spec = ConvSpec(1, 16, 8, 8, 16, 3, 3, pad=(1, 1, 1, 1), groups=16, ic_block=16, oc_block=16)
    check_against_numpy(spec, epilogue, n_random=1)


def test_both_parallel_orders_match_numpy_and_the_default_keeps_the_smaller_operand_apart():
    """``s0_order``: the parallel loop fuses output-channel blocks outside rows (each core writes its own
    channels and reads every weight once between the cores) or rows outside channel blocks (each core keeps
    its own rows of the activations from one conv to the next, and reads every weight).  Both compute the
    same conv; the default splits rows where the weights are the smaller operand (ResNet-50's 56x56 convs),
    channels where they are larger (its 7x7 2048->512)."""
    spec = ConvSpec(1, 32, 10, 10, 32, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16)
    task = make_task(spec, "relu")
    inputs = task.make_inputs(seed=1)
    named = {s.name: x for s, x in zip(task.inputs, inputs)}
    want = np_epilogue(np_conv(from_blocked(named["data"], spec.c), named["weight"], spec), "relu", named)
    space = templates.space_for(task, LLVM)
    default = space.as_dict(templates.default_config(task, LLVM))
    for order in ("oc_outer", "y_outer"):
        config = space.from_dict(default | {"s0_order": order})
        got = from_blocked(run_config(task, config, inputs), spec.f)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))
    wide = make_task(ConvSpec(1, 64, 56, 56, 64, 3, 3, pad=(1, 1, 1, 1)), "relu")
    deep = make_task(ConvSpec(1, 2048, 7, 7, 512, 1, 1), "relu")
    pick = lambda t: templates.space_for(t, LLVM).as_dict(templates.default_config(t, LLVM))["s0_order"]  # noqa: E731
    assert (pick(wide), pick(deep)) == ("y_outer", "oc_outer")


def test_avx2_default_tile_of_a_prime_wide_map_holds_a_whole_row():
    """With AVX2's 16 registers (12 accumulators) two 8-lane output blocks left a 7-wide map a 2 x 1 tile:
    ResNet-50's 512-channel 3x3 conv at 7x7 ran 3.86 ms where 64 trials found 1.57 ms (one block, 7
    outputs); the default now takes one block and the whole row.  AVX-512's tiles are unchanged."""
    from kerneltune.targets.parse import parse_target

    avx2 = parse_target('{"kind": "llvm", "mcpu": "x86-64-v3"}', 2).target
    for target, lanes, want in ((avx2, 8, (1, 7)), (LLVM, 16, (2, 7))):
        task = make_task(ConvSpec(1, 512, 7, 7, 512, 3, 3, pad=(1, 1, 1, 1), ic_block=lanes, oc_block=lanes))
        cfg = templates.space_for(task, target).as_dict(templates.default_config(task, target))
        assert (cfg["tile_ob"][2], cfg["tile_x"][1] * cfg["tile_y"][2]) == want, cfg


@pytest.mark.parametrize("spec,epilogue", [
    (ConvSpec(1, 64, 6, 7, 64, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16), "bn_relu_residual"),
    (ConvSpec(1, 64, 9, 9, 32, 1, 1, stride=(2, 2), ic_block=16, oc_block=16), "none"),
    (ConvSpec(1, 40, 5, 11, 32, 1, 3, pad=(0, 1, 0, 1), ic_block=8, oc_block=16), "relu"),  # 5 input blocks
], ids=["3x3-residual", "1x1-stride2", "1x3-wide"])
def test_input_channels_outside_the_rows_match_numpy(spec, epilogue):
    """``ic_order=outer``: the input-channel chunks run outside every row and column tile of a parallel chunk,
    the partial sums wait in memory and the epilogue runs once after the last chunk.  The same conv as the
    default order, over several chunk splits and with the rows in S1 (the default where it applies)."""
    task = make_task(spec, epilogue)
    inputs = task.make_inputs(seed=2)
    named = {s.name: x for s, x in zip(task.inputs, inputs)}
    want = np_epilogue(np_conv(from_blocked(named["data"], spec.c), named["weight"], spec), epilogue, named)
    space = templates.space_for(task, LLVM)
    default = space.as_dict(templates.default_config(task, LLVM))
    rco = default["tile_ic"][0] * default["tile_ic"][1]
    oh = default["tile_y"][0] * default["tile_y"][1] * default["tile_y"][2]
    for ic1 in sorted({1, rco}):
        config = space.from_dict(default | {"ic_order": "outer", "tile_ic": (rco // ic1, ic1), "tile_y": (1, oh, 1)})
        got = from_blocked(run_config(task, config, inputs), spec.f)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))


def test_default_puts_input_channels_outside_the_rows_only_for_panels_past_l1():
    """The default reads a large weight panel chunk by chunk from L1 (ResNet-50's 256 3x3 at 14x14: a 288
    KiB panel per register tile), keeps the order where the panel fits L1 (256->1024 1x1: 32 KiB) or where
    the cores split rows (64 3x3 at 56x56), and sizes a 1x1 conv's chunk to one L1 block (AVX-512, 2 cores)."""
    def default(spec):
        task = make_task(spec, "relu")
        return templates.space_for(task, AVX512).as_dict(templates.default_config(task, AVX512))

    big = default(ConvSpec(1, 256, 14, 14, 256, 3, 3, pad=(1, 1, 1, 1)))
    one = default(ConvSpec(1, 1024, 14, 14, 256, 1, 1))
    assert (big["ic_order"], big["tile_ic"], big["tile_y"][1]) == ("outer", (16, 1), 14)
    assert (one["ic_order"], one["tile_ic"]) == ("outer", (8, 8))
    assert default(ConvSpec(1, 256, 14, 14, 1024, 1, 1))["ic_order"] == "inner"
    assert default(ConvSpec(1, 64, 56, 56, 64, 3, 3, pad=(1, 1, 1, 1)))["ic_order"] == "inner"
    # weights about the input's size (Inception-v3's 768->192 1x1 at 17x17): the cores split channels for it
    wide = default(ConvSpec(1, 768, 17, 17, 192, 1, 1))
    assert (wide["ic_order"], wide["s0_order"]) == ("outer", "oc_outer")


def test_default_keeps_the_tap_loop_of_seven_wide_kernels():
    """Seven taps in a row (ResNet's 7x7 stem, Inception's 1x7) ran 15-27% faster with the tap loop kept
    than unrolled into seven copies of the channel loop; 3x3 and 5x5 were within 1% either way."""
    def unrolled(kh, kw, c=64):
        spec = ConvSpec(1, c, 17, 17, 64, kh, kw, pad=(kh // 2, kw // 2, kh // 2, kw // 2))
        task = make_task(spec, "relu")
        return templates.space_for(task, AVX512).as_dict(templates.default_config(task, AVX512))["unroll_kw"]

    assert [unrolled(1, 7), unrolled(7, 7), unrolled(3, 3), unrolled(5, 5)] == [False, False, True, True]


def test_default_register_tile_leaves_room_for_broadcasts_and_weights():
    """Inception-v3's 80->192 3x3 on a 71-wide map (split as 72): 2 blocks x 12 columns held 24 accumulators
    plus 12 broadcast inputs and 2 weight vectors, past AVX-512's 32 registers (8.3 ms); 9 columns fit."""
    task = make_task(ConvSpec(1, 80, 73, 73, 192, 3, 3), "relu")
    cfg = templates.space_for(task, AVX512).as_dict(templates.default_config(task, AVX512))
    live = cfg["tile_ob"][2] * cfg["tile_x"][1] * cfg["tile_y"][2] + cfg["tile_x"][1] * cfg["tile_y"][2] \
        + cfg["tile_ob"][2]
    assert live <= 32 and cfg["tile_x"][1] == 9, cfg


def test_merged_groups_are_the_same_convolution():
    rng = np.random.default_rng(0)
    spec = ConvSpec(1, 32, 6, 6, 32, 3, 3, pad=(1, 1, 1, 1), groups=8)  # ResNeXt-like: 4 channels a group
    x = rng.standard_normal((1, 32, 6, 6)).astype(np.float32)
    w = rng.standard_normal((32, 4, 3, 3)).astype(np.float32)
    k = merge_factor(32, 32, 8, 16, 16)
    assert k == 4
    merged = ConvSpec(1, 32, 6, 6, 32, 3, 3, pad=(1, 1, 1, 1), groups=2)
    np.testing.assert_allclose(np_conv(x, merge_groups(w, 8, k), merged), np_conv(x, w, spec), atol=1e-9)
    assert merge_factor(32, 32, 8, 4, 4) == 1 and merge_factor(30, 30, 3, 16, 16) is None


def test_weights_are_packed_at_build_time_and_invalid_tiles_refused():
    spec = ConvSpec(1, 32, 8, 8, 32, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16)
    task = make_task(spec)
    assert task.weights == ("weight",)
    func, packings = prepack.strip(templates.apply(task, templates.default_config(task, LLVM), LLVM))
    assert [p.param for p in packings] == [1] and len(packings[0].shape) == 6
    space = templates.space_for(task, LLVM)
    cfg = space.as_dict(templates.default_config(task, LLVM))
    cfg.update(tile_ob=(1, 1, 2), tile_y=(1, 1, 8), tile_x=(1, 8))  # 128 accumulators
    with pytest.raises(templates.InvalidConfig):
        templates.apply(task, space.from_dict(cfg), LLVM)


def test_blocked_layout_round_trip():
    x = np.arange(2 * 10 * 3 * 2, dtype=np.float32).reshape(2, 10, 3, 2)
    b = to_blocked(x, 4)
    assert b.shape == (2, 3, 3, 2, 4) and np.all(b[:, 2, :, :, 2:] == 0)
    np.testing.assert_array_equal(from_blocked(b, 10), x)


def opevo_trials(task, trials: int = 6):
    """``trials`` OpEvo trials of ``task`` measured here: the tuning result."""
    from kerneltune.measure import MeasureOptions, Measurer
    from kerneltune.searchers import make_searcher
    from kerneltune.tune import TaskRecords, tune

    space = templates.space_for(task, LLVM)
    searcher = make_searcher("opevo", space, seed=0)
    with Measurer(LLVM, MeasureOptions(number=2, repeat=2), workers=1) as m:
        return tune(space, searcher, lambda cs: m.measure(task, cs), trials, TaskRecords(task.key, str(LLVM)),
                    progress=False)


def test_measurer_and_opevo_tune_an_nchwc_task():
    task = make_task(ConvSpec(1, 16, 8, 8, 16, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16), "bias_relu")
    result = opevo_trials(task)
    assert result.trials == 6 and result.best_gflops > 0 and result.failures < 6
