"""Every operator spec: its float reference matches onnxruntime running its ONNX mapping, its integer
reference matches the float one (exactly, on small integers, with relu -> x*(x+1)+1 and avg -> sum), and
importing the exported node gives back the same (op, params)."""
from __future__ import annotations

import numpy as np
import pytest

from graphopt import ops
from graphopt.feeds import run_ort
from graphopt.ir import Graph, TensorInfo
from graphopt.onnx_io import export_onnx, import_onnx

C = dict(stride=(1, 1), pad="SAME", act="none", groups=1)
CASES = [
    ("matmul", {}, [(2, 4), (4, 3)]),
    ("matmul", {}, [(2, 3, 4), (4, 5)]),
    ("bmatmul", {}, [(2, 3, 4), (2, 4, 5)]),
    ("conv2d", C, [(2, 4, 5, 5), (6, 4, 3, 3)]),
    ("conv2d", {**C, "act": "relu", "stride": (2, 1)}, [(2, 4, 5, 5), (6, 4, 1, 3)]),
    ("conv2d", {**C, "pad": "VALID", "groups": 2}, [(1, 4, 5, 6), (6, 2, 3, 3)]),
    ("pool2d_max", dict(kernel=(3, 3), stride=(2, 2), pad="SAME"), [(2, 3, 5, 5)]),
    ("pool2d_avg", dict(kernel=(3, 3), stride=(1, 1), pad="SAME"), [(2, 3, 5, 5)]),
    ("pool2d_avg", dict(kernel=(2, 2), stride=(2, 2), pad="VALID"), [(1, 3, 4, 4)]),
    ("relu", {}, [(3, 4)]),
    ("ewadd", {}, [(3, 4), (3, 4)]),
    ("ewmul", {}, [(3, 4), (3, 4)]),
    ("smul", {}, [(3, 4), ()]),
    ("bias_add", {}, [(2, 3, 4), (4,)]),
    ("bias_add", {}, [(2, 4, 3, 3), (4, 1, 1)]),
    ("concat", {"axis": 1}, [(2, 3), (2, 5)]),
    ("split", {"axis": 1, "sizes": (2, 3)}, [(4, 5)]),
    ("transpose", {"perm": (0, 2, 1)}, [(2, 3, 4)]),
    ("reshape", {"shape": (2, 3, 2, 2)}, [(2, 3, 4)]),
    ("enlarge", {}, [(4, 4, 1, 3), (4, 4, 3, 3)]),
    ("Iconv", {}, [(4, 4, 3, 3)]),
    ("Imatmul", {}, [(4, 4)]),
    ("Iewmul", {}, [(2, 3)]),
    ("Cpool", {"kernel": (3, 3)}, [(2, 4, 5, 5)]),
]
SHAPE_ONLY_IMPORT = {"enlarge", "Iconv", "Imatmul", "Iewmul", "Cpool"}  # no ONNX node to import back


def _graph(op, params, shapes):
    names = [f"in{i}" for i in range(len(shapes))]
    outs = [f"out{i}" for i in range(ops.REGISTRY[op].n_outputs if op != "split" else len(params["sizes"]))]
    out_shapes = ops.infer_shape(op, params, shapes)
    g = Graph([], [TensorInfo(n, "float32", s) for n, s in zip(names, shapes)],
              [TensorInfo(n, "float32", s) for n, s in zip(outs, out_shapes)])
    g.nodes = ops.to_onnx(op, params, names, outs, g)
    # constants come out as weights named like the output; route them through an Identity-free Add 0
    for o in outs:
        if o in g.initializers:
            val = g.initializers.pop(o)
            g.initializers[o + "_w"] = val
            g.initializers[o + "_zero"] = np.zeros((), dtype=val.dtype)
            from graphopt.ir import Node
            g.nodes.append(Node("Add", [o + "_w", o + "_zero"], [o], {}, name=o + "_add"))
    return g, out_shapes


@pytest.mark.parametrize("op,params,shapes", CASES, ids=[f"{c[0]}{i}" for i, c in enumerate(CASES)])
def test_op_matches_onnxruntime(op, params, shapes):
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-1, 1, size=s).astype(np.float32) for s in shapes]
    g, out_shapes = _graph(op, params, shapes)
    model = export_onnx(g)
    got = run_ort(model, {f"in{i}": x for i, x in enumerate(xs)})
    want = ops.evaluate(op, params, [x.astype(np.float64) for x in xs], ops.FLOAT)
    for a, b, s in zip(got, want, out_shapes):
        assert a.shape == s == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    ints = [rng.integers(-4, 5, size=s).astype(np.int64) for s in shapes]
    iref = ops.evaluate(op, params, ints, ops.INT)
    fref = ops.evaluate(op, params, [x.astype(np.float64) for x in ints], ops.FLOAT)
    for a, b in zip(iref, fref):
        if op == "relu":
            b = np.asarray(ints[0] * (ints[0] + 1) + 1, dtype=np.float64)
        elif op in ("pool2d_avg", "Cpool"):
            b = b * params["kernel"][0] * params["kernel"][1]
        elif op == "conv2d" and params["act"] == "relu":
            pre = ops.evaluate(op, {**params, "act": "none"}, ints, ops.INT)[0]
            b = (pre * (pre + 1) + 1).astype(np.float64)
        assert a.dtype == np.int64
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)

    if op not in SHAPE_ONLY_IMPORT:
        back = import_onnx(model)
        main = [n for n in back.nodes if n.op_type != "Relu" or op == "relu"][0]
        view = ops.from_onnx(main, back)
        expect = {**params, "act": "none"} if op == "conv2d" else params
        assert view == (op, expect)
        assert ops.understood(main, back)
        assert [back.shape(i) for i in ops.op_inputs(main, back)] == [tuple(s) for s in shapes]


def test_opaque_and_invalid_shapes():
    with pytest.raises(ValueError):
        ops.infer_shape("matmul", {}, [(2, 4), (3, 4)])
    with pytest.raises(ValueError):
        ops.infer_shape("conv2d", C, [(1, 4, 5, 5), (4, 3, 3, 3)])
    with pytest.raises(ValueError):
        ops.infer_shape("split", {"axis": 0, "sizes": ("x1.0", "x2.0")}, [(4, 4)])
    bound = ops.bind_params({"axis": 0, "sizes": ("x1.0", "x2.1")}, {"x1": (3, 1), "x2": (7, 1)})
    assert ops.infer_shape("split", bound, [(4, 4)]) == [(3, 4), (1, 4)]
    g, _ = _graph("bias_add", {}, [(2, 3), (3,)])
    g.nodes[0].inputs.reverse()  # Add(bias, x): still a bias_add with the bias second
    assert ops.from_onnx(g.nodes[0], g) == ("bias_add", {})
    assert ops.op_inputs(g.nodes[0], g) == ["in0", "in1"]
    g.nodes[0].op_type = "Softmax"
    assert not ops.understood(g.nodes[0], g)
