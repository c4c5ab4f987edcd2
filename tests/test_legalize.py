"""graphopt.legalize: LSTM / GRU / RNN / ReverseSequence / scalar ConstantOfShape lowered to primitive ops.

Every variant is checked the same way: build the operator with ``onnx.helper`` and seeded random weights,
lower it, and require (1) no lowered op left, (2) ``onnx.checker`` full check, whose strict shape inference
also proves every type the lowering recorded, and (3) onnxruntime on the lowered graph equal to onnxruntime
on the original within 1e-5.  onnxruntime has no ``layout=1`` kernel for these ops, so those variants are
compared with the layout-0 twin (same weights) on transposed inputs.  No TVM here: the whole file runs in a
few seconds.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.errors import UserError
from graphopt.feeds import run_ort
from graphopt.legalize import LOWERINGS, legalize
from graphopt.legalize import rnn as rnn_lowering
from graphopt.onnx_io import export_onnx, import_onnx

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
S, B, I, H = 5, 3, 4, 6


def rnn_model(op: str = "LSTM", direction: str = "forward", layout: int = 0, bias: bool = True,
              lens: list[int] | None = None, lens_input: bool = False, h0: bool = False, c0: bool = False,
              peephole: bool = False, outputs: tuple[bool, ...] = (True, True, True), opset: int = 17,
              weights_as_inputs: bool = False, steps: int = S,
              **attrs) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One recurrent node with random weights; returns the model and matching seeded inputs."""
    rng = np.random.default_rng(0)
    nd = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    x_shape = [steps, B, I] if layout == 0 else [B, steps, I]
    state_shape = [nd, B, H] if layout == 0 else [B, nd, H]
    gin = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
    inits: list[onnx.TensorProto] = []

    def add(name: str, value: np.ndarray, as_input: bool) -> str:
        if as_input:
            gin.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                                     list(value.shape)))
            feeds[name] = value
        else:
            inits.append(numpy_helper.from_array(value, name))
        return name

    def uniform(*shape: int) -> np.ndarray:
        return rng.uniform(-0.5, 0.5, shape).astype(np.float32)

    ins = ["X", add("W", uniform(nd, g * H, I), weights_as_inputs), add("R", uniform(nd, g * H, H), weights_as_inputs)]
    ins.append(add("B", uniform(nd, 2 * g * H), weights_as_inputs) if bias else "")
    ins.append(add("L", np.array(lens, np.int32), lens_input) if lens is not None else "")
    ins.append(add("H0", rng.standard_normal(state_shape).astype(np.float32), True) if h0 else "")
    if op == "LSTM":
        ins.append(add("C0", rng.standard_normal(state_shape).astype(np.float32), True) if c0 else "")
        ins.append(add("P", uniform(nd, 3 * H), weights_as_inputs) if peephole else "")
    while ins[-1] == "":
        ins.pop()
    outs = [name if want else "" for name, want in zip(["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2], outputs)]
    while outs[-1] == "":
        outs.pop()
    if layout:
        attrs["layout"] = 1
    attrs.setdefault("hidden_size", H)
    node = helper.make_node(op, ins, outs, name=f"my_{op.lower()}", direction=direction, **attrs)
    graph = helper.make_graph([node], "g", gin, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                 for o in outs if o], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model, feeds


def reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime's outputs; for layout=1 (which ORT does not implement) via the layout-0 twin."""
    node = model.graph.node[0]
    if not any(a.name == "layout" and a.i == 1 for a in node.attribute):
        return run_ort(model, feeds)
    twin = onnx.ModelProto.FromString(model.SerializeToString())
    for a in twin.graph.node[0].attribute:
        if a.name == "layout":
            a.i = 0
    for inp in twin.graph.input:
        inp.type.tensor_type.ClearField("shape")
    outs = run_ort(twin, {k: v.transpose(1, 0, 2) if v.ndim == 3 else v for k, v in feeds.items()})
    return [o.transpose(2, 0, 1, 3) if o.ndim == 4 else o.transpose(1, 0, 2) for o in outs]


def lowered_error(model: onnx.ModelProto, feeds: dict[str, np.ndarray], hoist: bool = True) -> float:
    """Max abs difference between ORT on the lowered model and the reference (after the structural checks)."""
    graph = import_onnx(model)
    if hoist:
        result = legalize(graph)
    else:
        saved = LOWERINGS[graph.nodes[0].op_type]
        LOWERINGS[graph.nodes[0].op_type] = lambda n, b: rnn_lowering.lower(n, b, hoist=False)
        try:
            result = legalize(graph)
        finally:
            LOWERINGS[graph.nodes[0].op_type] = saved
    assert result.lowered == {graph.nodes[0].op_type: 1}
    assert not {"LSTM", "GRU", "RNN", "ReverseSequence"} & {n.op_type for n in result.graph.nodes}
    assert result.graph.output_names == graph.output_names and result.graph.input_names == graph.input_names
    out = export_onnx(result.graph)
    onnx.checker.check_model(out, full_check=True)  # strict shape inference: recorded types are right
    ref, got = reference(model, feeds), run_ort(out, feeds)
    assert [r.shape for r in ref] == [g.shape for g in got]
    return max(float(np.abs(r - g).max()) for r, g in zip(ref, got))


# Each case: (id, kwargs).  Together they cover every attribute and input of the three operators.
CASES: list[tuple[str, dict]] = []
for _op in ("LSTM", "GRU", "RNN"):
    for _dir in ("forward", "reverse", "bidirectional"):
        for _layout in (0, 1):
            CASES.append((f"{_op}-{_dir}-layout{_layout}-states", dict(op=_op, direction=_dir, layout=_layout,
                                                                        h0=True, c0=True)))
        # sequence_lens as a weight (ragged, with a zero) and as a model input, with initial states
        CASES.append((f"{_op}-{_dir}-lens-const", dict(op=_op, direction=_dir, lens=[5, 3, 0], h0=True, c0=True)))
        CASES.append((f"{_op}-{_dir}-lens-input", dict(op=_op, direction=_dir, lens=[2, 5, 4], lens_input=True,
                                                       h0=True, c0=True)))
        CASES.append((f"{_op}-{_dir}-lens-input-layout1", dict(op=_op, direction=_dir, lens=[1, 0, 4], layout=1,
                                                               lens_input=True, h0=True)))
    CASES += [
        (f"{_op}-no-bias", dict(op=_op, bias=False)),
        (f"{_op}-clip", dict(op=_op, clip=0.3, direction="bidirectional", h0=True)),
        (f"{_op}-lens-all-full", dict(op=_op, lens=[S] * B)),
        (f"{_op}-lens-short-const", dict(op=_op, lens=[3, 2, 2], direction="bidirectional")),
        (f"{_op}-only-Y", dict(op=_op, outputs=(True, False, False))),
        (f"{_op}-only-Y_h-lens", dict(op=_op, outputs=(False, True, False), lens=[0, 3, 5], lens_input=True,
                                      direction="bidirectional")),
        (f"{_op}-opset7", dict(op=_op, opset=7, direction="bidirectional", h0=True)),
        (f"{_op}-opset8-no-where-lens-input", dict(op=_op, opset=8, lens=[4, 2, 5], lens_input=True,
                                                   direction="bidirectional")),
        (f"{_op}-opset9-lens", dict(op=_op, opset=9, lens=[4, 2, 5], direction="reverse")),
        (f"{_op}-opset22", dict(op=_op, opset=22)),
        (f"{_op}-weights-as-inputs", dict(op=_op, weights_as_inputs=True, h0=True, direction="bidirectional")),
    ]
CASES += [
    ("LSTM-peepholes", dict(op="LSTM", peephole=True)),
    ("LSTM-peepholes-everything", dict(op="LSTM", peephole=True, h0=True, c0=True, direction="bidirectional",
                                       clip=0.4, lens=[5, 2, 3])),
    ("LSTM-input_forget", dict(op="LSTM", input_forget=1, c0=True)),
    ("LSTM-input_forget-peepholes", dict(op="LSTM", input_forget=1, peephole=True, c0=True)),
    ("LSTM-only-Y_c", dict(op="LSTM", outputs=(False, False, True), c0=True)),
    ("LSTM-Y_h-Y_c-lens", dict(op="LSTM", outputs=(False, True, True), lens=[0, 3, 5], c0=True,
                               direction="bidirectional")),
    ("GRU-linear_before_reset", dict(op="GRU", linear_before_reset=1)),
    ("GRU-linear_before_reset-no-bias", dict(op="GRU", linear_before_reset=1, bias=False)),
    ("GRU-linear_before_reset-everything", dict(op="GRU", linear_before_reset=1, h0=True, clip=0.2,
                                                direction="bidirectional", lens=[1, 5, 3], lens_input=True)),
]
_ACTS = [("Affine", "LeakyRelu", "ThresholdedRelu"), ("ScaledTanh", "HardSigmoid", "Elu"),
         ("Softsign", "Softplus", "Relu"), ("sigmoid", "TANH", "Tanh")]
for _k, _a in enumerate(_ACTS):
    CASES += [
        (f"LSTM-acts{_k}-alpha-beta", dict(op="LSTM", activations=list(_a), activation_alpha=[0.5, 0.7, 0.2],
                                            activation_beta=[0.3, 0.1])),
        (f"LSTM-acts{_k}-defaults", dict(op="LSTM", activations=list(_a))),
        (f"LSTM-acts{_k}-bidirectional", dict(op="LSTM", activations=list(_a) * 2, direction="bidirectional",
                                              activation_alpha=[0.5, 0.7, 0.2, 0.9, 1.1],
                                              activation_beta=[0.3, 0.1, 0.4])),
        (f"GRU-acts{_k}", dict(op="GRU", activations=list(_a[:2]), activation_alpha=[0.5, 0.7],
                               activation_beta=[0.3], linear_before_reset=_k % 2)),
        # ORT's RNN kernel (unlike LSTM and GRU) wants the names capitalized as in the ONNX spec
        (f"RNN-acts{_k}-bidirectional", dict(op="RNN", activations=list(_a[1:3]) if _k < 3 else ["Tanh", "Sigmoid"],
                                             direction="bidirectional",
                                             activation_alpha=[0.5], activation_beta=[0.3])),
        (f"LSTM-acts{_k}-opset9", dict(op="LSTM", activations=list(_a), opset=9)),
    ]
CASES.append(("RNN-schema-default-two-activations", dict(op="RNN", activations=["Relu", "Tanh"])))
# past 16 steps the per-step Split and the Y Concat become trees (graphopt.legalize.rnn.FANIN)
CASES += [("LSTM-40-steps-lens-const", dict(op="LSTM", steps=40, lens=[40, 17, 0], direction="bidirectional")),
          ("GRU-40-steps-lens-short", dict(op="GRU", steps=40, lens=[33, 17, 21], h0=True)),
          ("RNN-40-steps-lens-input", dict(op="RNN", steps=40, lens=[40, 3, 39], lens_input=True))]


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_lowering_equals_onnxruntime(kwargs):
    assert lowered_error(*rnn_model(**kwargs)) <= 1e-5


@pytest.mark.parametrize("kwargs", [dict(op="LSTM", direction="bidirectional", lens=[5, 2, 4], h0=True, c0=True),
                                    dict(op="GRU", linear_before_reset=1, direction="reverse"),
                                    dict(op="RNN", clip=0.5, lens=[1, 2, 3], lens_input=True)],
                         ids=["LSTM", "GRU", "RNN"])
def test_per_step_projection_form_equals_onnxruntime(kwargs):
    """The naive form (one input projection per step), kept for the hoisting measurement, is exact too."""
    assert lowered_error(*rnn_model(**kwargs), hoist=False) <= 1e-5


def test_projection_is_one_gemm_and_steps_are_unrolled():
    model, _ = rnn_model("LSTM", direction="bidirectional")
    graph = legalize(import_onnx(model)).graph
    matmuls = [n for n in graph.nodes if n.op_type == "MatMul"]
    x_proj = [n for n in matmuls if n.inputs[0] == "X"]
    assert len(x_proj) == 2  # one [S, B, I] @ [I, 4H] per direction
    assert len(matmuls) == 2 + 2 * (S - 1)  # + the recurrence, skipped at step 0 where the state is zero
    assert graph.shape(x_proj[0].outputs[0]) == (S, B, 4 * H)


def test_long_sequences_split_and_concat_as_trees():
    """TVM's schedule/compile time grows faster than linearly in a kernel's outputs or Concat inputs."""
    graph = legalize(import_onnx(rnn_model("LSTM", steps=300, outputs=(True, False, False))[0])).graph
    assert max(len(n.outputs) for n in graph.nodes if n.op_type == "Split") <= rnn_lowering.FANIN + 1
    assert max(len(n.inputs) for n in graph.nodes if n.op_type == "Concat") <= rnn_lowering.FANIN
    assert sum(n.op_type == "MatMul" for n in graph.nodes) == 1 + 299


def test_lowering_is_deterministic():
    model, _ = rnn_model("GRU", direction="bidirectional", lens=[1, 0, 4], lens_input=True, h0=True)
    first = export_onnx(legalize(import_onnx(model)).graph).SerializeToString()
    assert export_onnx(legalize(import_onnx(model)).graph).SerializeToString() == first


def test_only_requested_ops_are_lowered_and_input_graph_is_untouched():
    model, _ = rnn_model("LSTM")
    graph = import_onnx(model)
    assert legalize(graph, ops={"GRU", "Foo"}).lowered == {}
    assert legalize(graph, ops=set()).graph is graph
    result = legalize(graph, ops={"LSTM"})
    assert result.lowered == {"LSTM": 1} and [n.op_type for n in graph.nodes] == ["LSTM"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(activations=["Sigmoid", "Tanh", "Swish"]), "activation 'Swish'"),
    (dict(activations=["Sigmoid", "Tanh"]), "lists 2 functions, expected 3"),
    (dict(direction="sideways"), "direction='sideways'"),
    (dict(lens=[6, 1, 1]), r"sequence_lens \[6, 1, 1\] must lie in \[0, 5\]"),
    (dict(hidden_size=5), r"weight R has shape \[1, 24, 6\], expected \[1, 20, 5\]"),
], ids=["unknown-activation", "activation-count", "direction", "lens-out-of-range", "hidden-size"])
def test_impossible_nodes_are_one_line_user_errors(kwargs, match):
    model, _ = rnn_model("LSTM", **kwargs)
    with pytest.raises(UserError, match=match) as info:
        legalize(import_onnx(model, require_static=False))
    assert "my_lstm" in str(info.value) and "\n" not in str(info.value)


def test_wrong_weight_shape_is_a_user_error():
    model, _ = rnn_model("LSTM", peephole=True)
    p = next(t for t in model.graph.initializer if t.name == "P")
    p.CopyFrom(numpy_helper.from_array(np.zeros((1, 2 * H), np.float32), "P"))
    with pytest.raises(UserError, match=r"input P has shape \[1, 12\], expected \[1, 18\]"):
        legalize(import_onnx(model, require_static=False))


def test_dynamic_sequence_length_is_a_user_error():
    model, _ = rnn_model("GRU")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "seq"
    with pytest.raises(UserError, match="static .*--input-shape"):
        legalize(import_onnx(model, require_static=False))


# ---- ReverseSequence -------------------------------------------------------------------------------------
@pytest.mark.parametrize("time_axis, batch_axis, shape", [(0, 1, [5, 3, 2]), (1, 0, [3, 5, 2, 2]), (0, 1, [4, 2])])
@pytest.mark.parametrize("lens_input", [False, True], ids=["lens-const", "lens-input"])
def test_reverse_sequence_equals_onnxruntime(time_axis, batch_axis, shape, lens_input):
    rng = np.random.default_rng(1)
    lens = rng.integers(1, shape[time_axis] + 1, shape[batch_axis]).astype(np.int64)
    gin = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
    inits = []
    if lens_input:
        gin.append(helper.make_tensor_value_info("L", TensorProto.INT64, [len(lens)]))
        feeds["L"] = lens
    else:
        inits.append(numpy_helper.from_array(lens, "L"))
    node = helper.make_node("ReverseSequence", ["x", "L"], ["y"], time_axis=time_axis, batch_axis=batch_axis)
    g = helper.make_graph([node], "g", gin, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    result = legalize(import_onnx(model))
    assert result.lowered == {"ReverseSequence": 1}
    out = export_onnx(result.graph)
    onnx.checker.check_model(out, full_check=True)
    np.testing.assert_array_equal(run_ort(out, feeds)[0], run_ort(model, feeds)[0])


# ---- ConstantOfShape -------------------------------------------------------------------------------------
def _constant_of_shape_model(shape: list[int], as_output: bool) -> onnx.ModelProto:
    value = numpy_helper.from_array(np.array([7], np.int64), "value")
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=0, end=len(shape)) if shape else
             helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.zeros(0, np.int64))),
             helper.make_node("ConstantOfShape", ["s"], ["c"], value=value),
             helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT64),
             helper.make_node("Add", ["xi", "c"], ["y"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.INT64, None)]
    if as_output:
        outs.append(helper.make_tensor_value_info("c", TensorProto.INT64, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], outs)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("as_output", [False, True], ids=["internal", "graph-output"])
def test_scalar_constant_of_shape_becomes_a_weight(as_output):
    model = _constant_of_shape_model([], as_output)
    result = legalize(import_onnx(model), ops={"ConstantOfShape"})
    assert result.lowered == {"ConstantOfShape": 1}
    assert "ConstantOfShape" not in {n.op_type for n in result.graph.nodes}
    out = export_onnx(result.graph)
    onnx.checker.check_model(out, full_check=True)
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    for got, ref in zip(run_ort(out, feeds), run_ort(model, feeds)):
        assert got.shape == ref.shape
        np.testing.assert_array_equal(got, ref)


def test_constant_of_shape_with_a_real_shape_is_left_alone():
    result = legalize(import_onnx(_constant_of_shape_model([2, 3], False)), ops={"ConstantOfShape"})
    assert result.lowered == {} and "ConstantOfShape" in {n.op_type for n in result.graph.nodes}
