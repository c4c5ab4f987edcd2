"""Kernels CNNs spend time in besides the convolutions: the fast sigmoid (SiLU epilogues), spatial means and
pools of blocked tensors (the lane-reduction CPU rule); and the NCHWc template's constrained search space."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import tvm
from tvm import relax

from kerneltune import templates
from kerneltune.templates.conv_nchwc import ConvSpec, make_task
from kerneltune.searchers import make_searcher
from kerneltune.space import SearchSpace
from kerneltune.targets.parse import parse_target
from pipeline.compile import compile_partition
from pipeline.cpu_rules import MIN_PARALLEL_ELEMS
from pipeline.partition import partition

LLVM = parse_target("llvm", 2)


def run_relax(build, *inputs):
    """Fuse, schedule and build ``main`` as the pipeline does; return its output and how it was scheduled."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(x.shape, str(x.dtype))) for i, x in enumerate(inputs)]
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit_output(build(*params))
        bb.emit_func_output(y)
    part = partition(bb.get())
    cm = compile_partition(SimpleNamespace(input_names=[]), part, LLVM)
    out = cm.vm()["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()
    return out, part, cm.schedules


def test_silu_uses_the_fast_sigmoid_and_keeps_its_accuracy_nan_and_inf():
    x = np.linspace(-100, 100, 4096, dtype=np.float32).reshape(4, 1024)
    x[0, :4] = [np.nan, np.inf, -np.inf, 88.5]
    out, part, _ = run_relax(lambda v: relax.op.multiply(v, relax.op.sigmoid(v)), x)
    assert [t.name for t in part.tasks] == ["fused_fast_sigmoid_multiply1"]
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    ok = np.isfinite(ref)
    assert np.all(out[~ok & ~np.isnan(ref)] == ref[~ok & ~np.isnan(ref)])  # +inf stays +inf
    assert np.max(np.abs(out[ok] - ref[ok]) / np.maximum(1.0, np.abs(ref[ok]))) < 1e-6


@pytest.mark.parametrize("shape", [(1, 8, 7, 7, 16), (2, 3, 15, 9, 8), (1, 2, 5, 5, 4)])
def test_spatial_mean_of_a_blocked_tensor_is_vectorized_over_lanes_and_exact(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out, part, how = run_relax(lambda v: relax.op.mean(v, axis=[2, 3], keepdims=True), x)
    np.testing.assert_allclose(out, x.mean(axis=(2, 3), keepdims=True), rtol=1e-5, atol=1e-6)
    from pipeline.compile import schedule

    mod, _ = schedule(part, LLVM)
    assert "T.vectorized" in mod[part.tasks[0].names[0]].script()


@pytest.mark.parametrize("width", [28, 7])
def test_channel_shuffle_of_rows_no_vector_divides_is_vectorized_and_exact(width):
    """ShuffleNet-v2's shuffle (concat, a 5-D reshape and transpose, reshape back) on NCHW maps 28 wide: the
    row is no whole number of vectors, so the rows are fused until they are (it ran scalar, 10x slower)."""
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((1, 6, width, width)).astype(np.float32) for _ in range(2))

    def shuffle(x, y):
        cat = relax.op.concat([x, y], axis=1)
        five = relax.op.reshape(cat, (1, 2, 6, width, width))
        return relax.op.reshape(relax.op.permute_dims(five, [0, 2, 1, 3, 4]), (1, 12, width, width))

    out, part, _ = run_relax(shuffle, a, b)
    ref = np.concatenate([a, b], 1).reshape(1, 2, 6, width, width).transpose(0, 2, 1, 3, 4).reshape(1, 12, width,
                                                                                                       width)
    np.testing.assert_array_equal(out, ref)
    from pipeline.compile import schedule

    mod, _ = schedule(part, LLVM)
    assert "T.vectorized" in mod[part.tasks[0].names[0]].script()


@pytest.mark.parametrize("shape, a, b", [((1, 10, 12, 9, 6), 6, 5), ((1, 3, 16, 16, 16), 16, 16)])
def test_a_blocked_channel_shuffle_unrolls_its_lanes_instead_of_gathering_and_is_exact(shape, a, b):
    """pipeline.layout.shuffle's gather between blocked layouts: each lane reads a channel the lane index
    divides, so the Injective rule unrolls the lanes (a vector of them was a gather, 4.7-9x slower alone) and
    parallelizes outside the serial loop around them."""
    from tvm import te

    from kerneltune.task import build_func
    from pipeline.cpu_rules import Injective
    from pipeline.layout.shuffle import Shuffle, gather

    channels = shape[1] * a
    x = te.placeholder(shape, name="x")
    func = te.create_prim_func([x, gather(x, Shuffle(3, channels // 3), a, b, channels)])
    script = Injective().apply(func, LLVM.target, False).mod["main"].script()
    assert "T.unroll" in script and "T.vectorized" not in script and "T.parallel" in script, script
    xs = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    flat = xs.transpose(0, 1, 4, 2, 3).reshape(1, channels, *shape[2:4])  # NCHW
    want = flat.reshape(1, 3, channels // 3, *shape[2:4]).transpose(0, 2, 1, 3, 4).reshape(1, channels // b, b,
                                                                                           *shape[2:4])
    out = tvm.runtime.empty((1, channels // b, *shape[2:4], b), "float32")
    build_func(Injective().apply(func, LLVM.target, False).mod["main"], LLVM.target)(tvm.runtime.tensor(xs), out)
    np.testing.assert_array_equal(out.numpy(), want.transpose(0, 1, 3, 4, 2))


def test_a_u8_requantization_of_rows_no_byte_vector_divides_vectorizes_within_the_row():
    """MobileNet-v2 int8's requantization after a depthwise conv: int32 rows of 144 channels to u8.  64 u8
    lanes do not divide 144; fused into 64-lane vectors across rows, each lane's channel was ``i % 144`` and
    the per-channel scales a gather.  The row takes the widest vector that divides it (16 lanes, one register
    of int32 loads): the scales and biases are read contiguously, and the bytes match numpy."""
    rng = np.random.default_rng(3)
    acc = rng.integers(-20000, 20000, (196, 144)).astype(np.int32)
    bias = rng.integers(-500, 500, (144,)).astype(np.int32)
    scale = rng.uniform(1e-3, 2e-2, (144,)).astype(np.float32)

    def requantize(a, b, s):
        x = relax.op.multiply(relax.op.astype(relax.op.add(a, b), "float32"), s)
        return relax.op.astype(relax.op.clip(relax.op.add(relax.op.round(x), relax.const(np.float32(3))), 0, 255),
                               "uint8")

    out, part, _ = run_relax(requantize, acc, bias, scale)
    ref = np.clip(np.rint((acc + bias).astype(np.float32) * scale) + np.float32(3), 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(out, ref)
    from pipeline.compile import schedule

    from kerneltune.targets.host import vector_bits

    script = schedule(part, LLVM)[0][part.tasks[0].names[0]].script()
    lanes = vector_bits(LLVM.target) // 32  # a register of int32 accumulators: 144 is 9 such vectors
    assert f"T.vectorized(T.int64({lanes}))" in script and "% T.int64(144)" not in script, script


def test_blocked_max_pool_with_padding_is_vectorized_over_lanes_and_matches_numpy():
    x = np.random.default_rng(1).standard_normal((1, 2, 9, 9, 16)).astype(np.float32)
    out, part, _ = run_relax(lambda v: relax.op.nn.max_pool2d(v, 3, 2, 1, layout="NCHW16c"), x)
    from pipeline.compile import schedule

    mod, _ = schedule(part, LLVM)
    script = mod[part.tasks[0].names[0]].script()
    assert "T.vectorized" in script and "T.parallel" in script
    pad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
    ref = np.stack([np.stack([pad[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3].max(axis=(2, 3)) for j in range(5)], 2)
                    for i in range(5)], 2)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("include_pad", [False, True])
def test_blocked_avg_pool_with_padding_matches_numpy(include_pad):
    """Inception's 3x3 stride-1 average pools (padding 1, not counted): the padding is read through inside
    the reduction, the divisor still counts only the taps inside (or, with count_include_pad, all 9)."""
    x = np.random.default_rng(2).standard_normal((1, 2, 6, 7, 16)).astype(np.float32)
    out, _, _ = run_relax(lambda v: relax.op.nn.avg_pool2d(v, 3, 1, 1, layout="NCHW16c",
                                                          count_include_pad=include_pad), x)
    pad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1), (0, 0)))
    ones = np.pad(np.ones_like(x), ((0, 0), (0, 0), (1, 1), (1, 1), (0, 0)))
    win = lambda a, i, j: a[:, :, i:i + 3, j:j + 3].sum(axis=(2, 3))  # noqa: E731
    ref = np.stack([np.stack([win(pad, i, j) / (9 if include_pad else win(ones, i, j)) for j in range(7)], 2)
                    for i in range(6)], 2)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_nchwc_space_only_holds_register_tiles_that_fit():
    task = make_task(ConvSpec(1, 64, 28, 28, 128, 3, 3, pad=(1, 1, 1, 1), ic_block=16, oc_block=16))
    space = templates.space_for(task, LLVM.target)
    free = SearchSpace(space.knobs)
    rng = random.Random(0)
    drawn = [free.sample(rng) for _ in range(300)]
    assert sum(not space.valid(c) for c in drawn) > 30  # the unconstrained space is full of spilling tiles
    assert all(space.valid(space.sample(rng)) for _ in range(300))
    default = templates.default_config(task, LLVM.target)
    assert space.contains(default)
    for i in range(len(space.knobs)):
        for v in space.neighbours(default, i):
            assert space.valid(default[:i] + (v,) + default[i + 1:])
    bad = next(c for c in drawn if not space.valid(c))
    assert not space.contains(bad)
    with pytest.raises(templates.InvalidConfig):
        templates.apply(task, bad, LLVM.target)
    searcher = make_searcher("opevo", space, 0)
    searcher.observe([default], [50.0])
    for _ in range(4):
        batch = searcher.propose(8)
        assert batch and all(space.valid(c) for c in batch)
        searcher.observe(batch, [rng.uniform(1, 100) for _ in batch])


@pytest.mark.parametrize("columns", [17, 49, 128, 197, 768])
def test_softmax_and_layer_norm_reduce_in_vectors_and_match_numpy(columns):
    """Reductions along the last axis (softmax, layer norm) are summed in vector partials (an ``_rf`` block,
    vectorized) when 16 lanes divide the row, and stay exact either way.  A softmax row that no vector width
    divides (49, 197) is cut into whole vectors and a tail (pipeline.passes.lane_softmax), its body reduced in
    vectors too; a layer norm over such a row keeps scalar reductions."""
    from pipeline.compile import schedule

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4, 16, columns)) * 4).astype(np.float32)
    gamma, beta = rng.standard_normal(columns).astype(np.float32), rng.standard_normal(columns).astype(np.float32)
    x[0, 1, columns // 2:] = -np.inf  # a causal mask's row: the masked entries (body and tail) weigh 0
    x[1, 2, -1] = 30.0                  # the row's max in the tail
    out, part, _ = run_relax(lambda v: relax.op.nn.softmax(v, axis=-1), x)
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(axis=-1, keepdims=True), rtol=1e-5, atol=1e-7)
    mod, _ = schedule(part, LLVM)
    script = mod[part.tasks[0].names[0]].script()
    assert ("_rf" in script) == (columns >= 32)
    assert ("T.parallel" in script) == (x.size >= MIN_PARALLEL_ELEMS)
    x = x.copy()
    x[0, 1, :] = 1.0  # layer norm: finite rows

    out, part, _ = run_relax(lambda v, g, b: relax.op.nn.layer_norm(v, g, b, axes=[-1]), x, gamma, beta)
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float64)
    ref = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5) * gamma + beta
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    mod, _ = schedule(part, LLVM)
    assert ("_rf" in mod[part.tasks[0].names[0]].script()) == (columns % 16 == 0)
