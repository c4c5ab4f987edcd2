"""Schedule templates: numerically correct for every operator form, fused epilogues, invalid configs
rejected before building, cuda code generated for sm_90 without a GPU."""
from __future__ import annotations

import random

import numpy as np
import pytest
import tvm

from kerneltune import templates
from kerneltune.targets.host import llvm_target
from kerneltune.task import build_func, make_task, run_func

LLVM = llvm_target(2)  # AVX-512 code on this Zen 5, like the pipeline's
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _run(task, config):
    lib = build_func(templates.apply(task, config, LLVM), LLVM)
    inputs = task.make_inputs(seed=1)
    return inputs, run_func(lib, task, inputs, tvm.cpu())


def _configs(task, n_random=2, seed=0):
    space = templates.space_for(task, LLVM)
    rng = random.Random(seed)
    return [templates.default_config(task, LLVM)] + [space.sample(rng) for _ in range(n_random)]


def _np_matmul(a, b, ta, tb):
    a = np.swapaxes(a, -1, -2) if ta else a
    b = np.swapaxes(b, -1, -2) if tb else b
    return a @ b


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_matches_numpy(ta, tb):
    task = make_task("matmul", "24,40,32", transpose_a=ta, transpose_b=tb)
    assert task.kind == "matmul" and task.dims == {"M": 24, "K": 40, "N": 32, "ta": int(ta), "tb": int(tb)}
    assert task.flops == 2 * 24 * 40 * 32
    for config in _configs(task):
        (a, b), (out,) = _run(task, config)
        np.testing.assert_allclose(out, _np_matmul(a, b, ta, tb), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, True)])
def test_batch_matmul_matches_numpy(ta, tb):
    task = make_task("batch_matmul", "3,12,20,16", transpose_a=ta, transpose_b=tb)
    assert task.kind == "batch_matmul" and task.dims["B"] == 3
    for config in _configs(task):
        (a, b), (out,) = _run(task, config)
        np.testing.assert_allclose(out, _np_matmul(a, b, ta, tb), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,shape", [("matmul", "197,64,96"), ("batch_matmul", "2,197,64,197")])
def test_prime_extents_are_split_past_their_end_and_stay_exact(kind, shape):
    """ViT's 197 tokens: the rows (and a 197-wide vector axis) split as if padded, the extra iterations
    masked; the default register tile is 4+ rows deep and whole vectors wide, and every config is exact."""
    from kerneltune.templates import cpu

    task = make_task(kind, shape)
    padded = cpu.padded_extents(task)
    assert padded.get("i") == 200
    assert (padded.get("j") == 208) == (kind == "batch_matmul")
    cfg = dict(zip(templates.space_for(task, LLVM).names, templates.default_config(task, LLVM)))
    assert cfg["tile_i"][3] * cfg["tile_i"][2] >= 4 and cfg["tile_j"][3] % 16 == 0
    # a 197-wide vector axis is computed on a zero-padded copy of B (pad_einsum), not with masked lanes
    script = cpu.schedule(task, templates.default_config(task, LLVM), LLVM).mod["main"].script()
    assert ("B_pad" in script) == (kind == "batch_matmul")
    for config in _configs(task, n_random=3):
        (a, b), (out,) = _run(task, config)
        np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)


def test_weight_padding_rounds_columns_up_to_whole_vectors_when_cheap():
    from kerneltune.templates.cpu import weight_padding

    # 4 vectors (64 lanes) when the zero columns add at most 1/32, else one vector at most 1/16
    assert [weight_padding(n) for n in (2600, 10000, 1000, 1950, 250, 650)] == [2624, 10048, 1024, 1984, 256, 656]
    assert [weight_padding(n) for n in (768, 3072, 64, 40, 100)] == [None] * 5  # divisible, or too costly
    assert weight_padding(50257) == 50272  # no divisor near a vector: padded whatever the cost


@pytest.mark.parametrize("shape,rows,width,split", [("35,650,10048", 5, 64, "j"), ("128,768,3072", 8, 48, "j"),
                                                    ("35,650,10000", 7, 16, "j"), ("128,768,50272", 8, 32, "j"),
                                                    ("3072,768,128", 6, 64, "i")])
def test_default_register_tile_fills_the_accumulators(shape, rows, width, split):
    """The register tile holds 24 of AVX-512's 32 vectors as accumulators, the most a rows x vectors tile of
    the shape reaches (ties: the widest).  35-row matmuls (an LM over 35 tokens) took the widest vector tile
    and so one row: 4 vectors x 5 rows fills 20.  The vector tile is never halved to feed the cores (10000
    columns: 25 x 25 chunks of 16 lanes, not 2 chunks of 8).  The cores split the larger operand: B's columns
    when N > M (an LM head's 1571 column tiles, not its 128 rows), else A's rows.  Rows whose A block fits in
    L1 with a B block (35 x 50 floats beside 16 columns) all repeat inside one k-block (S2 = every row tile);
    others take the rows tile given (row_repeat=1 here)."""
    from kerneltune.templates import cpu

    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})  # any host
    task = make_task("matmul", shape)
    cfg = dict(zip(cpu.space(task).names, cpu.default_config(task, avx512, row_repeat=1)))
    assert (cfg["tile_i"][3], cfg["tile_j"][3]) == (rows, width)
    assert cfg[f"tile_{split}"][0] >= 2 and cfg[f"tile_{'ij'[split == 'i']}"][0] == 1
    fits = shape == "35,650,10000"
    assert (cfg["tile_i"][1], cfg["tile_i"][2] * cfg["tile_i"][3]) == (1, 35) if fits else cfg["tile_i"][2] == 1


def _np_conv(x, w, stride, pad, groups):
    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    out = np.zeros((n, f, oh, ow), np.float64)
    fg = f // groups
    for ff in range(f):
        g = ff // fg
        for ry in range(kh):
            for rx in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, ry:ry + stride * oh:stride, rx:rx + stride * ow:stride]
                out[:, ff] += np.einsum("nchw,c->nhw", patch, w[ff, :, ry, rx])
    return out


@pytest.mark.parametrize("shape,stride,pad,groups,pads", [
    ("2,8,9,10,8,3,3", 1, 1, 1, ("stage", "inline")), ("2,8,9,10,8,3,3", 2, 1, 2, ("stage", "inline", "phases")),
    ("2,8,9,10,8,3,3", 1, 0, 4, ("stage", "inline")), ("1,8,9,9,8,3,3", 2, 1, 8, ("stage", "inline")),  # odd padded width
    ("1,3,16,16,8,3,3", 2, 1, 1, ("stage", "inline", "phases"))])
def test_conv2d_matches_numpy(shape, stride, pad, groups, pads):
    task = make_task("conv2d", shape, stride=stride, pad=pad, groups=groups)
    assert task.kind == "conv2d" and task.dims["G"] == groups
    space = templates.space_for(task, LLVM)
    configs = _configs(task)
    # every way of handling the pad block: inlined into the conv, kept as its own parallel stage, and kept
    # as even and odd columns (stride 2, even padded width only)
    knobs = {k.name: k for k in space.knobs}
    assert tuple(knobs["pad"].values if "pad" in knobs else ()) == pads
    configs += [space.from_dict({**space.as_dict(configs[0]), "pad": v}) for v in pads]
    for config in configs:
        (x, w), (out,) = _run(task, config)
        np.testing.assert_allclose(out, _np_conv(x, w, stride, pad, groups), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape,groups,rows", [
    ("1,30,14,14,60,1,1", 3, 5),      # ShuffleNet v1's groups of 20 filters: 5 rows, not 6 across a boundary
    ("1,64,14,14,64,3,3", 16, 8),     # ResNeXt's groups of 4: two whole groups a tile
    ("1,16,14,14,48,1,1", 1, 8)])     # ungrouped: the largest divisor that fits the accumulators
def test_grouped_conv_register_rows_cover_whole_groups(shape, groups, rows):
    """The default register tile's filters (``tile_f`` S3, 16 accumulators of AVX-512 over 2 output rows) divide
    a group's filters or take whole groups, and the kernel (for this machine) still equals numpy."""
    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})  # any host
    task = make_task("conv2d", shape, groups=groups)
    assert templates.space_for(task, avx512).as_dict(templates.default_config(task, avx512))["tile_f"][3] == rows
    (x, w), (out,) = _run(task, templates.default_config(task, LLVM))
    np.testing.assert_allclose(out, _np_conv(x, w, 1, 0, groups), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape,stride,pad,groups,expected", [
    ("1,16,28,28,16,3,3", 1, 1, 16, "inline"),   # depthwise: the checks inline cost less than a scalar copy
    ("1,16,28,28,16,3,3", 2, 1, 16, "inline"),
    ("1,3,32,32,16,3,3", 2, 1, 1, "phases"),     # a stride-2 stem reads even and odd columns apart
    ("1,8,14,14,16,3,3", 1, 1, 1, "stage"),      # a padded stride-1 conv copies once, checks nothing inside
    ("1,8,14,14,16,3,3", 1, 0, 1, "inline")])    # no padding: nothing to check
def test_default_pad_handling(shape, stride, pad, groups, expected):
    task = make_task("conv2d", shape, stride=stride, pad=pad, groups=groups)
    space = templates.space_for(task, LLVM)
    assert space.as_dict(templates.default_config(task, LLVM)).get("pad", "inline") == expected


def _fused_model_funcs():
    """PrimFuncs exactly as the pipeline gets them: ONNX -> from_onnx -> LegalizeOps .. FuseTIR."""
    import onnx  # noqa: F401 - the frontend needs it
    from onnx import TensorProto, helper, numpy_helper
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    rng = np.random.default_rng(0)

    def w(name, shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.1, name)

    const = lambda name, v: numpy_helper.from_array(np.array(v, np.float32), name)  # noqa: E731
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),                                     # matmul+add+relu
        helper.make_node("MatMul", ["r1", "W2"], ["m2"]), helper.make_node("Add", ["m2", "b2"], ["a2"]),
        helper.make_node("Add", ["a2", "x"], ["res"]),                                # residual add
        helper.make_node("Reshape", ["res", "shp"], ["q"]),
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["q"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["qt", "kt"], ["s"]),                              # rank-4 QK^T
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "qt"], ["o"]),                               # rank-4 PV
        helper.make_node("MatMul", ["y", "W3"], ["m3"]), helper.make_node("Add", ["m3", "b3"], ["a3"]),
        helper.make_node("Div", ["a3", "sq2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["a3", "e1"], ["g0"]),
        helper.make_node("Mul", ["g0", "half"], ["g"]),                               # erf gelu (HF export)
        helper.make_node("Gemm", ["y", "W4"], ["gm"], transB=1),
        helper.make_node("Conv", ["img", "CW", "CB"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["cr"]),                                      # conv+bias+relu
        helper.make_node("Conv", ["img", "GW"], ["gc"], strides=[2, 2], group=2),     # grouped, strided
    ]
    inits = [w("W1", (32, 64)), w("b1", (64,)), w("W2", (64, 32)), w("b2", (32,)), w("W3", (32, 48)),
             w("b3", (48,)), w("W4", (40, 32)), w("CW", (8, 4, 3, 3)), w("CB", (8,)), w("GW", (6, 2, 1, 1)),
             numpy_helper.from_array(np.array([1, 16, 4, 8], np.int64), "shp"),
             const("sq2", 1.4142135), const("one", 1.0), const("half", 0.5)]
    outs = ["o", "g", "gm", "cr", "gc"]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 32]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 32]),
         helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 4, 10, 10])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    mod = from_onnx(model, keep_params_in_input=False)
    mod = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fused_pipeline_funcs_classified_and_scheduled():
    funcs = _fused_model_funcs()
    tasks = {name: templates.task_for(name, f) for name, f in funcs.items()}
    kinds = sorted(t.kind for t in tasks.values() if t is not None)
    # two rank-4 attention matmuls, four dense ones (relu, residual, gelu, Gemm transB), two convs
    assert kinds == ["batch_matmul"] * 2 + ["conv2d"] * 2 + ["matmul"] * 4, {n: t and t.key for n, t in tasks.items()}
    assert all(tasks[n] is None for n in funcs if n.startswith(("softmax", "transpose", "reshape")))
    epilogues = {t.epilogue for t in tasks.values() if t is not None}
    assert ("T_add", "compute") in epilogues            # bias + relu (matmul and conv)
    assert ("T_add", "T_add") in epilogues              # bias + residual
    bmm = [t for t in tasks.values() if t is not None and t.kind == "batch_matmul"]
    assert {t.dims["B"] for t in bmm} == {4} and {t.dims["M"] for t in bmm} == {16}
    for name, task in tasks.items():
        if task is None:
            continue
        inputs = task.make_inputs(seed=2)
        ref = task.reference(inputs)
        lib = build_func(templates.apply(task, templates.default_config(task, LLVM), LLVM), LLVM)
        out = run_func(lib, task, inputs, tvm.cpu())
        for o, r in zip(out, ref):
            np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4, err_msg=name)


def test_scheduled_func_is_marked_and_vectorized():
    task = make_task("matmul", "64,64,64")
    func = templates.apply(task, templates.default_config(task, LLVM), LLVM)
    assert bool(func.attrs["tirx.is_scheduled"])
    text = func.script()
    assert "T.parallel" in text and "T.vectorized" in text and "pragma_auto_unroll_max_step" in text


def _vector_widths(func) -> list[int]:
    """Extents of the vectorized loops of a scheduled PrimFunc (read from its TVMScript)."""
    import re

    return [int(n) for n in re.findall(r"T\.vectorized\((?:T\.int64\()?(\d+)", func.script())]


@pytest.mark.parametrize("tb", [False, True])
def test_one_wide_panel_vectorizes_no_strided_loop(tb):
    """G-BFS starts from untiled configs: with a 1-wide j tile the panel copy's and the write-back's inner
    loops run along k / the rows.  Vectorizing those made LLVM build a 768-lane gather (89 s per build at
    128x768x3072, a build timeout per trial); no vector may be wider than the j tile there."""
    task = make_task("matmul", "8,96,32", transpose_b=tb)
    space = templates.space_for(task, LLVM)
    for pack in ("panel", "none"):
        cfg = space.from_dict({"tile_i": [8, 1, 1, 1], "tile_j": [32, 1, 1, 1], "tile_k": [96, 1], "unroll": 64,
                               "s1_order": "reversed", "pack": pack})
        func = templates.apply(task, cfg, LLVM)
        assert all(w <= 1 for w in _vector_widths(func)), (pack, _vector_widths(func))
        (a, b), (out,) = _run(task, cfg)
        np.testing.assert_allclose(out, _np_matmul(a, b, False, tb), rtol=1e-4, atol=1e-4)


def test_default_config_uses_avx512_lanes_and_both_cores():
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver5", "num-cores": 2})
    task = make_task("matmul", "128,768,768")
    cfg = templates.space_for(task, target).as_dict(templates.default_config(task, target))
    assert cfg["tile_j"][3] % 16 == 0                      # whole zmm vectors innermost
    assert cfg["tile_i"][0] * cfg["tile_j"][0] >= 2          # parallel loop has work for 2 cores


@pytest.mark.parametrize("mcpu, registers", [("x86-64-v3", 16), ("skylake-avx512", 32)])
def test_register_tiles_fit_the_vector_register_file(mcpu, registers):
    """Accumulators leave 8 vector registers to the operands: 24 on AVX-512's 32 (8 rows x 3 vectors), 8 on
    AVX2's 16 (a 4 x 4-vector tile spilled there: x86-64-v3 on an Intel Xeon, 110 vs 148 GFLOP/s for 2 x 4)."""
    from kerneltune.targets.host import vector_lanes

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    used = {}
    for shape in ("128,768,3072", "197,768,768", "1,768,1000"):
        task = make_task("matmul", shape)
        cfg = templates.space_for(task, target).as_dict(templates.default_config(task, target))
        vectors = -(-cfg["tile_j"][3] // vector_lanes(target, "float32"))
        used[shape] = vectors * cfg.get("tile_i", (1, 1, 1, 1))[3]
        assert used[shape] <= registers - 8, (shape, cfg)
    assert used["128,768,3072"] == registers - 8


def test_invalid_configs_rejected_before_build():
    task = make_task("matmul", "64,64,64")
    space = templates.space_for(task, LLVM)
    good = templates.default_config(task, LLVM)
    with pytest.raises(templates.InvalidConfig):
        templates.apply(task, good[:-1], LLVM)                        # wrong arity
    with pytest.raises(templates.InvalidConfig):
        templates.apply(task, ((64, 1, 1, 2),) + good[1:], LLVM)      # factors do not multiply to 64
    gspace = templates.space_for(task, CUDA)
    d = gspace.as_dict(templates.default_config(task, CUDA))
    too_many_threads = gspace.from_dict({**d, "tile_i": (1, 1, 64, 1), "tile_j": (1, 1, 64, 1)})
    with pytest.raises(templates.InvalidConfig, match="threads"):
        templates.apply(task, too_many_threads, CUDA)
    big = make_task("matmul", "256,1024,256")
    gd = templates.space_for(big, CUDA).as_dict(templates.default_config(big, CUDA))
    too_much_shared = templates.space_for(big, CUDA).from_dict(
        {**gd, "tile_i": (1, 1, 16, 16), "tile_j": (1, 1, 16, 16), "tile_k": (1, 1024, 1)})
    with pytest.raises(templates.InvalidConfig, match="shared memory"):
        templates.apply(big, too_much_shared, CUDA)
    assert space.contains(good)


@pytest.mark.parametrize("kind,shape,kw", [
    ("matmul", "64,48,32", {"transpose_b": True}),
    ("batch_matmul", "2,32,16,32", {}),
    ("conv2d", "1,8,12,12,16,3,3", {"stride": 2, "pad": 1, "groups": 2}),
])
def test_cuda_template_builds_for_sm90_without_gpu(kind, shape, kw):
    task = make_task(kind, shape, **kw)
    space = templates.space_for(task, CUDA)
    rng = random.Random(0)
    configs = [templates.default_config(task, CUDA)] + [space.sample(rng) for _ in range(6)]
    built = 0
    for config in configs:
        try:
            func = templates.apply(task, config, CUDA)
        except templates.InvalidConfig:
            continue
        lib = build_func(func, CUDA)
        src = lib.imports[0].inspect_source()
        assert str(lib.imports[0].kind) == "cuda" and "__global__" in src and "__shared__" in src
        built += 1
    assert built >= 2


def test_host_target_gets_avx512_code_and_bare_llvm_does_not():
    task = make_task("matmul", "32,32,64")
    host = llvm_target(2)
    assert str(host.attrs["mcpu"]) != ""
    asm_host = build_func(templates.apply(task, templates.default_config(task, host), host), host).inspect_source("asm")
    bare = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    asm_bare = build_func(templates.apply(task, templates.default_config(task, bare), bare), bare).inspect_source("asm")
    assert "vfmadd" not in asm_bare                      # baseline x86-64: SSE only
    from tvm.target import codegen
    if codegen.target_has_features("avx512f", host):    # this Zen 5
        assert "zmm" in asm_host and "vfmadd" in asm_host


@pytest.mark.parametrize("kind,shape,tb", [("matmul", "24,40,32", False), ("matmul", "24,40,32", True),
                                           ("batch_matmul", "3,12,20,16", False),
                                           ("matmul", "1,40,32", False), ("matmul", "1,40,32", True)])
def test_prepacked_weight_kernel_matches_numpy(kind, shape, tb):
    """pack=prepack (B a model weight): the kernel without its packing copy, fed B packed as the copy would
    have packed it, computes the same product; the packed layout really differs from B's."""
    import dataclasses

    from kerneltune import prepack

    plain = make_task(kind, shape, transpose_b=tb)
    pack_values = lambda t: next((k.values for k in templates.space_for(t, LLVM).knobs  # noqa: E731
                                  if k.name == "pack"), ())
    assert "prepack" not in pack_values(plain)  # B is not a weight here
    task = dataclasses.replace(plain, weights=("B",))
    assert "prepack" in pack_values(task)
    space = templates.space_for(task, LLVM)
    # a weight is stored as packed panels by default (a plain B is copied panel by panel at run time)
    assert space.as_dict(templates.default_config(task, LLVM))["pack"] == "prepack"
    if kind == "matmul" and not shape.startswith("1,"):
        assert space.as_dict(templates.default_config(plain, LLVM))["pack"] == "panel"
    rng = random.Random(3)
    configs = [space.from_dict({**space.as_dict(c), "pack": "prepack"})
               for c in [templates.default_config(task, LLVM)] + [space.sample(rng) for _ in range(2)]]
    for config in configs:
        func, packings = prepack.strip(templates.apply(task, config, LLVM))
        assert len(packings) == 1 and packings[0].param == 1
        assert tuple(int(d) for d in func.params[1].shape) == packings[0].shape  # the kernel takes B packed
        a, b = task.make_inputs(seed=1)
        packed = prepack.pack_inputs([a, b], packings)
        assert packed[1].shape == packings[0].shape and packed[1].shape != b.shape
        (out,) = run_func(build_func(func, LLVM), task, packed, tvm.cpu())
        np.testing.assert_allclose(out, _np_matmul(a, b, False, tb), rtol=1e-4, atol=1e-4)


def test_prepacked_matmul_prefetches_the_next_weight_panel():
    """A pre-packed weight's next panel is prefetched into L2 while the row tiles of the current one run (the
    weights of a model come from DRAM); an 8-row tile, which reads each panel once, prefetches the panel's next
    k-block instead; the kernel computes what it did.  A matrix-vector product is left to the hardware
    prefetchers, and the schedule's trace (the MetaSchedule export) has no prefetch: no schedule primitive
    expresses it."""
    import dataclasses

    from kerneltune import prepack

    for shape, expected in (("64,256,384", True), ("8,256,384", True), ("1,256,384", False)):
        task = dataclasses.replace(make_task("matmul", shape), weights=("B",))
        config = templates.default_config(task, LLVM)
        assert templates.space_for(task, LLVM).as_dict(config)["pack"] == "prepack"
        func, packings = prepack.strip(templates.apply(task, config, LLVM))
        lib = build_func(func, LLVM)
        assert ("prefetcht1" in lib.inspect_source("asm")) == expected, shape
        assert "prefetch" not in templates.schedule(task, config, LLVM).mod["main"].script()
        a, b = task.make_inputs(seed=2)
        (out,) = run_func(lib, task, prepack.pack_inputs([a, b], packings), tvm.cpu())
        np.testing.assert_allclose(out, _np_matmul(a, b, False, False), rtol=1e-4, atol=1e-4)


def test_prime_reduction_depth_is_one_k_block():
    """A reduction with no divisor near the k-block depth (ViT's 197 tokens, a prime) is one k-block, not 197
    blocks of 1 (which sent the register tile to memory and back for every FMA step, 55 GFLOP/s in place);
    depths with a good divisor keep 64-deep blocks.  The product still equals numpy."""
    from kerneltune.templates import cpu

    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
    for shape, k in (("12,197,197,64", (1, 197)), ("12,128,768,64", (12, 64)), ("4,20,130,32", (5, 26))):
        task = make_task("batch_matmul", shape)
        assert dict(zip(cpu.space(task).names, cpu.default_config(task, target, row_repeat=1)))["tile_k"] == k
    task = make_task("batch_matmul", "2,13,197,24")
    a, b = task.make_inputs(seed=4)
    (out,) = run_func(build_func(templates.apply(task, templates.default_config(task, LLVM), LLVM), LLVM), task,
                      [a, b], tvm.cpu())
    np.testing.assert_allclose(out, a.astype("f8") @ b.astype("f8"), rtol=1e-4, atol=1e-4)
