"""Stacked GoogLeNet (Inception-v1) blocks: the multi-branch pattern TASO's graph substitutions target.

Each block runs four branches on one shared input - 1x1; 1x1 -> 3x3; 1x1 -> 5x5; 3x3 max-pool -> 1x1 -
and concatenates them on channels.  The channel counts are GoogLeNet's inception 3a, 3b, (max-pool) 4a,
on the 28x28x192 feature map the GoogLeNet stem produces.  Conv + Relu without BatchNorm, as in the paper.
"""
from __future__ import annotations

import onnx

from models.builder import GraphBuilder

# (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj) from the GoogLeNet paper, table 1.
INCEPTION_3A = (64, 96, 128, 16, 32, 32)
INCEPTION_3B = (128, 128, 192, 32, 96, 64)
INCEPTION_4A = (192, 96, 208, 16, 48, 64)


def _conv_relu(b: GraphBuilder, x: str, path: str, c_in: int, c_out: int, k: int) -> str:
    w = b.he(f"{path}.weight", (c_out, c_in, k, k), c_in * k * k)
    bias = b.normal(f"{path}.bias", (c_out,), 0.05)
    p = path.replace(".", "/")
    y = b.op("Conv", [x, w, bias], f"{p}/Conv", dilations=[1, 1], group=1, kernel_shape=[k, k],
             pads=[k // 2] * 4, strides=[1, 1])
    return b.op("Relu", [y], f"{p}/Relu")


def _block(b: GraphBuilder, x: str, path: str, c_in: int, spec: tuple[int, ...],
           out: str | None = None) -> tuple[str, int]:
    c1, r3, c3, r5, c5, pp = spec
    b1 = _conv_relu(b, x, f"{path}.branch1", c_in, c1, 1)
    b2 = _conv_relu(b, x, f"{path}.branch2.0", c_in, r3, 1)
    b2 = _conv_relu(b, b2, f"{path}.branch2.1", r3, c3, 3)
    b3 = _conv_relu(b, x, f"{path}.branch3.0", c_in, r5, 1)
    b3 = _conv_relu(b, b3, f"{path}.branch3.1", r5, c5, 5)
    b4 = b.op("MaxPool", [x], f"{path}/branch4/MaxPool", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    b4 = _conv_relu(b, b4, f"{path}.branch4.1", c_in, pp, 1)
    y = b.op("Concat", [b1, b2, b3, b4], f"{path}/Concat", out=out, axis=1)
    return y, c1 + c3 + c5 + pp


def build_inception(seed: int = 0, batch: int = 1, name: str = "inception-block") -> onnx.ModelProto:
    b = GraphBuilder(name, seed, opset=17)
    x = b.input("input", (batch, 192, 28, 28))
    x, c = _block(b, x, "inception3a", 192, INCEPTION_3A)
    x, c = _block(b, x, "inception3b", c, INCEPTION_3B)
    x = b.op("MaxPool", [x], "maxpool3/MaxPool", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    x, c = _block(b, x, "inception4a", c, INCEPTION_4A, out="output")
    b.output("output", (batch, c, 14, 14))
    return b.model("GoogLeNet inception blocks 3a, 3b, 4a on a 192x28x28 input")
