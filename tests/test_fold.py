"""pipeline.passes.fold: numpy's constant folding gives what Relax's FoldConstant gives, bit for bit, and leaves what
it cannot evaluate to FoldConstant."""
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from pipeline.passes.fold import fold_constants, fold_numpy  # noqa: E402

RNG = np.random.default_rng(0)


def _const(*shape, dtype="float32"):
    return relax.const(RNG.uniform(0.1, 2.0, shape).astype(dtype))


def _module(build, params):
    """``main(params...) -> build(bb, params)``: a dataflow function whose output mixes folded constants with
    the parameters (so the output is computed, not a constant)."""
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType(s, "float32")) for i, s in enumerate(params)]
    with bb.function("main", xs):
        with bb.dataflow():
            out = bb.emit_output(build(bb, xs))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, inputs):
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs])
    return [out[i].numpy() for i in range(len(out))] if hasattr(out, "__len__") and not hasattr(out, "numpy") \
        else [out.numpy()]


def _calls(mod) -> list[str]:
    return [b.value.op.name for blk in mod["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def _weights_chain(bb, xs):
    """What a BatchNormalization's and a blocked conv's constants go through."""
    x, y = xs
    op = relax.op
    gamma, var, mean, beta = _const(16), _const(16), _const(16), _const(16)
    scale = bb.emit(op.multiply(gamma, bb.emit(op.rsqrt(bb.emit(op.add(var, relax.const(1e-5, "float32")))))))
    shift = bb.emit(op.subtract(beta, bb.emit(op.multiply(mean, scale))))
    s4 = bb.emit(op.reshape(scale, (1, 16, 1, 1)))
    b4 = bb.emit(op.expand_dims(bb.emit(op.expand_dims(bb.emit(op.divide(shift, _const(16))), 1)), 2))
    z = bb.emit(op.add(bb.emit(op.multiply(x, s4)), b4))
    w = bb.emit(op.layout_transform(_const(32, 16, 3, 3),
                                    index_map=lambda o, i, h, w: (o // 16, i // 8, h, w, i % 8, o % 16)))
    cat = bb.emit(op.permute_dims(bb.emit(op.concat([_const(2, 6), bb.emit(op.sqrt(_const(1, 6)))], axis=0))))
    neg = bb.emit(op.maximum(bb.emit(op.negative(cat)), _const(6, 3)))
    return relax.Tuple([z, bb.emit(op.add(y, w)), neg])


def test_folds_what_foldconstant_folds_bit_for_bit():
    mod = _module(_weights_chain, [(1, 16, 4, 4), (2, 2, 3, 3, 8, 16)])
    folded, left = fold_numpy(mod)
    assert left == 0
    # only the ops on the parameters are left: the multiply/add of x and the add of y
    assert sorted(_calls(folded)) == ["relax.add", "relax.add", "relax.multiply"]
    inputs = [RNG.standard_normal((1, 16, 4, 4)).astype("float32"),
              RNG.standard_normal((2, 2, 3, 3, 8, 16)).astype("float32")]
    ours, theirs = _run(folded, inputs), _run(relax.transform.FoldConstant()(mod), inputs)
    for a, b in zip(ours, theirs):
        assert np.array_equal(a, b)


def test_leaves_what_numpy_cannot_evaluate_to_foldconstant():
    def build(bb, xs):
        op = relax.op
        # a layout transform that pads 20 channels to two blocks of 16, and an integer division
        w = bb.emit(op.layout_transform(_const(20, 4), index_map=lambda o, i: (o // 16, i, o % 16),
                                        pad_value=0.0))
        q = bb.emit(op.divide(relax.const(np.array([7, -7], "int32")), relax.const(np.array([2, 2], "int32"))))
        return relax.Tuple([bb.emit(op.add(xs[0], w)), bb.emit(op.astype(q, "float32"))])

    mod = _module(build, [(2, 4, 16)])
    folded, left = fold_numpy(mod)
    assert left == 2 and "relax.layout_transform" in _calls(folded) and "relax.divide" in _calls(folded)
    x = RNG.standard_normal((2, 4, 16)).astype("float32")
    full = fold_constants(mod)
    assert _calls(full) == ["relax.add"]
    for a, b in zip(_run(full, [x]), _run(mod, [x])):
        assert np.array_equal(a, b)


def _packing(scale: bool = False):
    """A kernel's weight-packing copy as ``SplitLayoutRewritePreproc`` writes it (``dst[f(v)] = src[v]`` over
    all of ``src``): a [32, 16, 3, 3] weight into [32 / 16, 16 / 8, 3, 3, 8, 16] blocks; ``scale``: a
    multiply into those blocks, not a copy."""
    from tvm import te

    src = te.placeholder((32, 16, 3, 3), "float32", "w")

    def body(o, i, h, w):
        return src[o, i, h, w] * 2.0 if scale else src[o, i, h, w]
    sch = tvm.s_tir.Schedule(te.create_prim_func([src, te.compute(src.shape, body, "packed")]))
    # the output written in the blocked layout, as TVM's layout-rewrite copies write it
    sch.transform_layout(sch.get_sblock("packed"), ("write", 0),
                         lambda o, i, h, w: (o // 16, i // 8, h, w, i % 8, o % 16))
    return sch.mod["main"].without_attr("global_symbol"), (2, 2, 3, 3, 8, 16)


def test_folds_a_weight_packing_copy_bit_for_bit_and_leaves_other_kernels():
    """The kernels' packing copies (kerneltune.prepack) are folded in numpy, equal to FoldConstant's value;
    a kernel that computes (here a multiply) is left to FoldConstant."""
    for scale, expect_left in ((False, 0), (True, 1)):
        kernel, dst = _packing(scale)
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType(dst, "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                gv = bb.add_func(kernel, "pack")
                packed = bb.emit(relax.call_tir(gv, (_const(32, 16, 3, 3),), relax.TensorType(dst, "float32")))
                out = bb.emit_output(bb.emit(relax.op.add(x, packed)))
            bb.emit_func_output(out)
        mod = bb.get()
        folded, left = fold_numpy(mod)
        assert left == expect_left
        assert ("relax.call_tir" in _calls(folded)) == bool(expect_left)
        x_in = RNG.standard_normal(dst).astype("float32")
        ours, theirs = _run(fold_constants(mod), [x_in]), _run(relax.transform.FoldConstant()(mod), [x_in])
        assert np.array_equal(ours[0], theirs[0])
