"""A plain multi-layer perceptron: the simplest matmul-bound benchmark.

Hidden layers are ``Gemm(transB=1) + Relu`` (how torch exports ``nn.Linear`` on 2-D inputs with the
TorchScript exporter); the classifier is ``MatMul + Add`` (how the dynamo exporter writes it), so both
linear-layer spellings appear in the benchmark set.
"""
from __future__ import annotations

import onnx

from models.builder import GraphBuilder


def build_mlp(seed: int = 0, batch: int = 64, sizes: tuple[int, ...] = (784, 1024, 1024, 1024, 10),
              name: str = "mlp") -> onnx.ModelProto:
    b = GraphBuilder(name, seed, opset=17)
    x = b.input("input", (batch, sizes[0]))
    for i, (n_in, n_out) in enumerate(zip(sizes[:-2], sizes[1:-1])):
        w = b.he(f"layers.{i}.weight", (n_out, n_in), n_in)
        bias = b.normal(f"layers.{i}.bias", (n_out,), 0.05)
        x = b.op("Gemm", [x, w, bias], f"layers.{i}/Gemm", alpha=1.0, beta=1.0, transB=1)
        x = b.op("Relu", [x], f"layers.{i}/Relu")
    n_in, n_out = sizes[-2], sizes[-1]
    w = b.normal("head.weight", (n_in, n_out), n_in ** -0.5)
    bias = b.normal("head.bias", (n_out,), 0.05)
    y = b.op("MatMul", [x, w], "head/MatMul")
    b.op("Add", [y, bias], "head/Add", out="output")
    b.output("output", (batch, n_out))
    return b.model(f"MLP {'-'.join(map(str, sizes))}, batch {batch}")
