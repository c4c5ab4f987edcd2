"""Which ONNX nodes each kernel call computes (pipeline.passes.provenance): traced through the import, the layout
stage and the fusion, on the bundled BERT and a conv net in the blocked layout."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.onnx_io import node_names
from kerneltune.targets.parse import check_name
from pipeline import stages
from pipeline.context import BuildContext

BERT = Path(__file__).resolve().parents[1] / "models" / "bert_tiny.onnx"


def _lowered(model: onnx.ModelProto, layout: str | None):
    ctx = BuildContext.create(check_name("llvm"), threads=1, layout=layout or "auto")
    return stages.lower(model, ctx.spec, None if layout is None else ctx.layout)


def test_every_bert_kernel_call_names_its_nodes_and_equal_kernels_keep_their_own():
    model = onnx.load(BERT)
    sites = _lowered(model, None).part.sites
    assert sites and all(s.nodes for s in sites)
    names = {n for n in node_names(model.graph) if n}
    covered = {n for s in sites for n in s.nodes}
    assert covered <= names
    assert len(covered) >= 0.95 * len(names)  # the position embedding's Gather folds into a constant
    # Q, K and V are one fused function in TVM (equal groups share it); each call still names its own MatMul
    qkv = [s.nodes for s in sites if any(n.endswith("/query/MatMul") or n.endswith("/key/MatMul")
                                         or n.endswith("/value/MatMul") for n in s.nodes)]
    assert len(qkv) == 6 and len({nodes[0] for nodes in qkv}) == 6
    ffn = next(s.nodes for s in sites if any(n.endswith("intermediate/dense/MatMul") for n in s.nodes))
    assert any(n.endswith("Erf") for n in ffn)  # the GELU fused into the matmul, rewritten to fast_erf on the way


def _conv_net() -> onnx.ModelProto:
    """Two 3x3 convs with bias and ReLU, the nodes unnamed as many exporters leave them, then a Gemm head."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.1, n) for n, s in
             (("w1", (16, 8, 3, 3)), ("b1", (16,)), ("w2", (16, 16, 3, 3)), ("b2", (16,)), ("wf", (10, 16)),
              ("bf", (10,)))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "convnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 14, 14])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("layout", [None, "nchwc"])
def test_conv_calls_name_the_conv_and_its_relu_through_the_layout_stage(layout):
    model = _conv_net()
    sites = _lowered(model, layout).part.sites
    assert all(n.name == "" for n in model.graph.node)  # named for the import only, as the graph IR names them
    convs = [s.nodes for s in sites if "conv2d" in s.kernel]
    assert convs == [("Conv_0", "Relu_1"), ("Conv_2", "Relu_3")]
    assert any(s.nodes == ("Gemm_6",) for s in sites)
    assert {n for s in sites for n in s.nodes} >= {"Conv_0", "Relu_1", "Conv_2", "Relu_3", "Gemm_6"}


def test_int8_kernels_name_the_conv_they_compute(tmp_path):
    """The integer pass (pipeline.passes.int8) rebuilds a quantized conv into a u8 x s8 product and its requantizing
    epilogue: each kernel still names its Conv, and the run of helper bindings it emits is not pinned on
    one node downstream."""
    from tests.test_int8 import _quantize, conv_net

    rng = np.random.default_rng(0)
    samples = [{"x": rng.uniform(-1, 1, (1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    model = _quantize(conv_net(), tmp_path, static=True, samples=samples)
    sites = _lowered(model, None).part.sites
    anchors = {n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm")}
    # the u8 x s8 products and their epilogues: dense convs as implicit GEMMs where the host has a dot-product
    # instruction (else as matmuls of their patches), the classifier as a matmul
    products = [s.nodes for s in sites if "matmul" in s.kernel or "conv2d_nhwc" in s.kernel]
    assert len(products) == 3 and all(nodes[0] in anchors for nodes in products)
    assert anchors <= {n for s in sites for n in s.nodes}  # the depthwise conv has a kernel of its own
