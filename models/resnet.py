"""ResNet-50 and ResNeXt-50 (32x4d), NCHW 1x3x224x224, as torchvision defines them (v1.5: stride on 3x3).

BatchNorm is folded into each convolution's weight and bias, which is what ``torch.onnx.export`` does for
an eval-mode model with its default constant folding (and what onnxruntime would do anyway), so the graph
is Conv(+bias) -> Relu chains, MaxPool, residual Adds, GlobalAveragePool, Flatten, Gemm.  The last
convolution of each residual branch gets a small gain, the way a trained BN gamma damps it, so the
residual stream stays O(1) over 16 blocks instead of doubling its variance per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx

from models.builder import GraphBuilder


@dataclass(frozen=True)
class ResNetConfig:
    blocks: tuple[int, ...] = (3, 4, 6, 3)
    groups: int = 1
    width_per_group: int = 64
    num_classes: int = 1000
    image: int = 224
    batch: int = 1


RESNET50 = ResNetConfig()
RESNEXT50 = ResNetConfig(groups=32, width_per_group=4)
_EXPANSION = 4
_BRANCH_GAIN = 0.2


@dataclass(frozen=True)
class _Conv:
    """A convolution's shape: channels in and out, a square ``k`` x ``k`` kernel, its stride and groups."""

    c_in: int
    c_out: int
    k: int
    stride: int = 1
    groups: int = 1


def _conv(b: GraphBuilder, x: str, path: str, conv: _Conv, relu: bool = True, gain: float = 1.0) -> str:
    c_in, c_out, k, groups = conv.c_in, conv.c_out, conv.k, conv.groups
    fan_in = c_in // groups * k * k
    w = b.he(f"{path}.weight", (c_out, c_in // groups, k, k), fan_in, gain)
    bias = b.normal(f"{path}.bias", (c_out,), 0.05)
    pad = k // 2
    y = b.op("Conv", [x, w, bias], f"{path.replace('.', '/')}/Conv", dilations=[1, 1], group=groups,
             kernel_shape=[k, k], pads=[pad] * 4, strides=[conv.stride, conv.stride])
    return b.op("Relu", [y], f"{path.replace('.', '/')}/Relu") if relu else y


def _bottleneck(b: GraphBuilder, x: str, path: str, c_in: int, planes: int, stride: int,
                cfg: ResNetConfig) -> str:
    width = int(planes * (cfg.width_per_group / 64.0)) * cfg.groups
    c_out = planes * _EXPANSION
    y = _conv(b, x, f"{path}.conv1", _Conv(c_in, width, 1))
    y = _conv(b, y, f"{path}.conv2", _Conv(width, width, 3, stride=stride, groups=cfg.groups))
    y = _conv(b, y, f"{path}.conv3", _Conv(width, c_out, 1), relu=False, gain=_BRANCH_GAIN)
    if stride != 1 or c_in != c_out:
        x = _conv(b, x, f"{path}.downsample.0", _Conv(c_in, c_out, 1, stride=stride), relu=False)
    y = b.op("Add", [y, x], f"{path.replace('.', '/')}/Add")
    return b.op("Relu", [y], f"{path.replace('.', '/')}/Relu_1")


def build_resnet(cfg: ResNetConfig = RESNET50, seed: int = 0, name: str = "resnet50") -> onnx.ModelProto:
    b = GraphBuilder(name, seed, opset=17)
    x = b.input("input", (cfg.batch, 3, cfg.image, cfg.image))
    x = _conv(b, x, "conv1", _Conv(3, 64, 7, stride=2))
    x = b.op("MaxPool", [x], "maxpool/MaxPool", ceil_mode=0, dilations=[1, 1], kernel_shape=[3, 3],
             pads=[1, 1, 1, 1], strides=[2, 2])
    c_in = 64
    for stage, n_blocks in enumerate(cfg.blocks):
        planes = 64 * 2 ** stage
        for i in range(n_blocks):
            stride = 2 if (i == 0 and stage > 0) else 1
            x = _bottleneck(b, x, f"layer{stage + 1}.{i}", c_in, planes, stride, cfg)
            c_in = planes * _EXPANSION
    x = b.op("GlobalAveragePool", [x], "avgpool/GlobalAveragePool")
    x = b.op("Flatten", [x], "Flatten", axis=1)
    w = b.normal("fc.weight", (cfg.num_classes, c_in), (1.0 / c_in) ** 0.5)
    bias = b.normal("fc.bias", (cfg.num_classes,), 0.05)
    b.op("Gemm", [x, w, bias], "fc/Gemm", out="output", alpha=1.0, beta=1.0, transB=1)
    b.output("output", (cfg.batch, cfg.num_classes))
    return b.model(f"{name} ({cfg}), BatchNorm folded into Conv")
