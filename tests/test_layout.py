"""The whole-graph NCHWc pass (pipeline.layout.nchwc) on real torch exports: every conv blocked, the blocked layout
carried through BN, activations (Clip included), pooling, residual adds, grouped/depthwise convs and concat,
transforms only at the edges, and the compiled model equal to onnxruntime."""
from __future__ import annotations

import io

import onnx
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e .[test])")
from torch import nn  # noqa: E402

from kerneltune.targets.parse import parse_target  # noqa: E402
from pipeline.layout import nchwc  # noqa: E402
from pipeline.relax_import import import_model  # noqa: E402
from layout_check import compiled_matches_onnxruntime  # noqa: E402


class ChainCNN(nn.Module):
    """Conv/BN/activation chain with a residual block, a ResNeXt-style grouped conv (4 channels a group,
    merged to fill a block) and a MobileNet-style inverted residual (depthwise, ReLU6, HardSwish, SiLU)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.res = nn.Sequential(nn.Conv2d(16, 32, 1), nn.ReLU(), nn.Conv2d(32, 32, 3, 1, 1, groups=8),
                                 nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 16, 1))
        self.inv = nn.Sequential(nn.Conv2d(16, 48, 1), nn.ReLU6(), nn.Conv2d(48, 48, 3, 2, 1, groups=48),
                                 nn.Hardswish(), nn.Conv2d(48, 24, 1), nn.SiLU())
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        x = self.pool(self.stem(x))
        x = torch.relu(x + self.res(x))
        x = self.inv(x)
        x = nn.functional.avg_pool2d(x, 2)
        return self.head(x.mean((2, 3)))


class ConcatCNN(nn.Module):
    """Inception/SqueezeNet-style branches concatenated on channels (8 + 16 = 24: two different blocks)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        self.a = nn.Conv2d(16, 8, 1)
        self.b = nn.Conv2d(16, 16, 3, 1, 1)
        self.out = nn.Conv2d(24, 32, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
        return self.out(x)


class DenseCNN(nn.Module):
    """DenseNet's pattern (Huang et al., "Densely Connected Convolutional Networks", CVPR'17): every layer is
    BN -> ReLU -> conv on the concat of all earlier features (16, 16+8, 16+8+8 channels).  The concats tie the
    features into one class of gcd 8 channels; the BNs cannot be folded into a conv, so the exporter keeps them.
    Until the BN's tuple was resolved, the BN's output started a class of its own (16c where the features were
    8c) and ConvertLayout failed with "Invalid layout axis 16b"."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        self.layers = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, 8, 3, 1, 1))
                                    for c in (16, 24))
        self.out = nn.Sequential(nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 16, 1))

    def forward(self, x):
        feats = [self.stem(x)]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        return self.out(torch.cat(feats, 1))


class ScaledCNN(nn.Module):
    """Constants of other ranks than (1,C,1,1) between convs: a per-channel (C,1,1) scale (ConvNeXt's layer
    scale, BN folded by hand), a one-element scale and a (W,)-shaped offset that varies along the width."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, 1, 1)
        self.b = nn.Conv2d(16, 16, 3, 1, 1)
        self.c = nn.Conv2d(16, 16, 1)
        self.scale = nn.Parameter(torch.rand(16, 1, 1) + 0.5)
        self.one = nn.Parameter(torch.tensor([1.5]))
        self.along_w = nn.Parameter(torch.rand(1, 1, 1, 32))

    def forward(self, x):
        x = self.b(torch.relu(self.a(x)) * self.scale) + self.along_w
        return self.c(x) * self.one


class SplitCNN(nn.Module):
    """YOLOv8's C2f pattern: a conv's channels split in two (ONNX Split: ``torch.split`` from either exporter,
    ``chunk`` from dynamo), one half through more convs, everything concatenated again."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, 1, 1)
        self.m = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1), nn.SiLU())
        self.out = nn.Conv2d(48, 16, 1)

    def forward(self, x):
        a, b = torch.relu(self.stem(x)).split([16, 16], 1)
        return self.out(torch.cat([a, b, self.m(b)], 1))


def export(model: nn.Module, shape=(1, 3, 32, 32), dynamo: bool = False, opset: int = 17) -> onnx.ModelProto:
    torch.manual_seed(0)
    model.eval()
    for m in model.modules():  # non-trivial BN statistics, so folding them is actually checked
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    buf = io.BytesIO()
    if dynamo:
        prog = torch.onnx.export(model, (torch.randn(*shape),), dynamo=True, opset_version=18,
                                 input_names=["x"])
        return prog.model_proto
    torch.onnx.export(model, (torch.randn(*shape),), buf, dynamo=False, opset_version=opset, input_names=["x"])
    return onnx.load_from_string(buf.getvalue())


def compile_and_compare(proto: onnx.ModelProto, narrow_groups: str = "nchw"):
    imported = import_model(proto)
    spec = parse_target("llvm", threads=2)
    mod, report = nchwc.to_nchwc(imported.mod, 16, narrow_groups)
    return report, compiled_matches_onnxruntime(imported, mod, spec)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_chain_cnn_is_blocked_end_to_end(dynamo):
    report, part = compile_and_compare(export(ChainCNN(), dynamo=dynamo))
    # the 4-channel grouped conv stays NCHW (narrower than a block), every other conv is blocked
    assert report.convs == 7 and report.blocked == 6 and len(report.kept_nchw) == 1
    assert "narrower than the blocks" in report.kept_nchw[0] and report.merged_groups == 0
    assert report.lifted == 3  # ReLU6 (Clip: call_tir maximum + minimum) and HardSwish (Relax clip)
    # into the blocked layout at the input, out of it before the classifier, and around the grouped conv
    assert report.transforms == 4
    kinds = [t.kind for t in part.tasks]
    assert kinds.count("conv2d_nchwc") >= 6 and kinds.count("conv2d") == 1
    convs = [t for t in part.tasks if t.kind == "conv2d_nchwc"]
    assert all(t.task is not None and t.task.epilogue for t in convs[1:])  # bias/BN/activations fused


def test_merged_groups_end_to_end():
    report, part = compile_and_compare(export(ChainCNN()), narrow_groups="merge")
    assert report.convs == report.blocked == 7 and report.merged_groups == 1 and report.transforms == 2
    assert "conv2d" not in [t.kind for t in part.tasks]


def test_concat_of_different_blocks_is_correct():
    report, part = compile_and_compare(export(ConcatCNN()))
    assert report.blocked == report.convs == 4
    # 8 + 16 channels concatenated: both branches (and the stem feeding them) in 8-channel blocks
    assert report.transforms == 2
    assert {t.task.dims["d"] for t in part.tasks if t.kind == "conv2d_nchwc"} == {8, 16}


def test_lanes_pick_the_blocks():
    assert nchwc.channel_block(64, 16) == 16 and nchwc.channel_block(24, 16) == 8
    assert nchwc.channel_block(3, 16) == 3 and nchwc.channel_block(20, 16) == 10
    assert nchwc.channel_block(64, 8) == 8
    assert nchwc.plan(128, 128, 32, 16, 16, "merge") == nchwc.ConvPlan(16, 16, 4)  # 4x merged groups
    assert nchwc.plan(128, 128, 32, 8, 8, "merge") == nchwc.ConvPlan(8, 8, 2)
    assert isinstance(nchwc.plan(128, 128, 32, 16, 16), str)  # ResNeXt stage 1 stays NCHW by default
    assert nchwc.plan(512, 512, 32, 16, 16) == nchwc.ConvPlan(16, 16)  # 16-channel groups are aligned
    assert nchwc.plan(144, 144, 144, 16, 16) == nchwc.ConvPlan(16, 16)
    assert isinstance(nchwc.plan(144, 144, 144, 16, 8), str)  # depthwise lanes map one to one
    assert isinstance(nchwc.plan(30, 30, 3, 16, 16), str)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "resnext50_32x4d"])
def test_torchvision_cnns_nchwc_equal_onnxruntime(name):
    lib = torch.library.Library("torchvision", "DEF")  # torchvision's CUDA wheel needs its op schemas
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    report, _ = compile_and_compare(export(getattr(torchvision.models, name)(weights=None), (1, 3, 64, 64)))
    narrow = {"resnext50_32x4d": 7}.get(name, 0)  # stages 1-2: 4 and 8 channels a group stay NCHW
    assert report.blocked == report.convs - narrow and report.transforms == 2 + 2 * narrow


def test_densenet_pattern_is_blocked_end_to_end():
    report, part = compile_and_compare(export(DenseCNN()))
    assert report.convs == report.blocked == 4 and report.transforms == 2  # the model's input and output only
    # the BNs after the concats: their multiply/add carried in the features' 8-channel blocks and fused
    assert sum(t.kind == "conv2d_nchwc" for t in part.tasks) == 4


def test_constant_ranks():
    assert nchwc.constant_rank((16, 1, 1), (1, 16, 8, 8)) == (1, 16, 1, 1)  # per channel: blocked with the op
    assert nchwc.constant_rank((1,), (1, 16, 8, 8)) == ()  # one element: a scalar
    assert nchwc.constant_rank((1, 1, 1, 1), (1, 16, 8, 8)) == ()
    assert nchwc.constant_rank((1, 1, 1, 8), (1, 16, 8, 8)) == (8,)  # over the width: the op stays NCHW
    assert nchwc.constant_rank((1, 1, 8, 8), (1, 16, 8, 8)) == (8, 8)
    assert nchwc.constant_rank((1, 16, 1, 1), (1, 16, 8, 8)) is None  # already right
    assert nchwc.constant_rank((8,), (1, 16, 8, 8)) is None
    assert nchwc.constant_rank((16, 8, 8), (1, 16, 8, 8)) == (1, 16, 8, 8)
    assert nchwc.constant_rank((2, 16, 1, 1), (1, 16, 8, 8)) is None  # widens the result: left alone
    assert nchwc.constant_rank((16, 1, 1), (1, 16)) is None


def test_constants_of_any_rank_keep_the_blocked_layout_or_leave_it_cleanly():
    """The (C,1,1) scale and the one-element scale are carried in the blocked layout (before, each put the
    activation back into NCHW for the op); the (1,1,1,W) offset cannot be blocked (one channel): it runs in
    NCHW with a transform each side (before, ConvertLayout failed: "Cannot broadcast from 5 to 4")."""
    report, _ = compile_and_compare(export(ScaledCNN()))
    assert report.convs == report.blocked == 3
    assert report.reshaped_constants == 3 and report.transforms == 4


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_channel_split_is_correct(dynamo):
    """ConvertLayout's own ``split`` inference broke on a blocked input (a 32-channel NCHW16c tensor split at 16
    gave a 32-channel part: "error: internal ValueError" from optimize-model); the split is now two slices."""
    report, _ = compile_and_compare(export(SplitCNN(), dynamo=dynamo))
    assert report.convs == report.blocked == 3


def test_split_bounds():
    assert nchwc.split_bounds(32, [16]) == [(0, 16), (16, 32)]
    assert nchwc.split_bounds(32, 2) == [(0, 16), (16, 32)]
    assert nchwc.split_bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]  # Relax/ONNX: the last part is smaller
    assert nchwc.split_bounds(24, [8, 16]) == [(0, 8), (8, 16), (16, 24)]


class ShuffleCNN(nn.Module):
    """ShuffleNet's unit (Zhang et al., CVPR'18): a 1x1 conv, its 48 channels shuffled in ``groups`` groups
    (``[N, g, C/g, H, W]`` transposed), a depthwise 3x3 and a 1x1 conv; a second shuffle feeds the classifier
    in NCHW (no blocked consumer)."""

    def __init__(self, groups: int):
        super().__init__()
        self.g = groups
        self.reduce = nn.Sequential(nn.Conv2d(16, 48, 1), nn.BatchNorm2d(48), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(48, 48, 3, 1, 1, groups=48), nn.BatchNorm2d(48), nn.Conv2d(48, 48, 1))
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        self.head = nn.Linear(48 * 8 * 8, 10)

    def shuffle(self, y):
        n, c, h, w = y.shape
        return y.view(n, self.g, c // self.g, h, w).transpose(1, 2).reshape(n, c, h, w)

    def forward(self, x):
        y = self.body(self.shuffle(self.reduce(torch.relu(self.stem(x)))))
        return self.head(self.shuffle(y).flatten(1))


@pytest.mark.parametrize("groups, dynamo", [(3, False), (2, True)], ids=["g3-torchscript", "g2-dynamo"])
def test_channel_shuffle_is_one_kernel_from_block_to_block(groups, dynamo):
    """Each shuffle is one ``channel_shuffle`` kernel reading the producer's blocks and writing the consumer's
    (or NCHW before the classifier): no transform around it, where ConvertLayout left three kernels."""
    report, part = compile_and_compare(export(ShuffleCNN(groups), shape=(1, 3, 8, 8), dynamo=dynamo))
    assert report.convs == report.blocked == 4 and report.shuffles == 2
    assert report.transforms == 1  # into the blocks at the input only; the second shuffle writes NCHW
    names = [t.name for t in part.tasks]
    assert sum("channel_shuffle" in n for n in names) == 2 and not any("transpose" in n for n in names), names


def test_shuffle_permutation_and_transform_blocks():
    import numpy as np
    from tvm import relax

    from pipeline.layout.shuffle import Shuffle, transform_block

    for g, width in ((3, 16), (2, 5), (4, 1)):
        want = np.arange(g * width).reshape(1, g, width, 1, 1).transpose(0, 2, 1, 3, 4).reshape(-1)
        assert [Shuffle(g, width).source(j) for j in range(g * width)] == want.tolist()
    x = relax.Var("x", relax.TensorType((1, 48, 4, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        blocked = bb.emit(relax.op.layout_transform(x, lambda n, c, h, w: (n, c // 16, h, w, c % 16)))
        back = bb.emit(relax.op.layout_transform(blocked, lambda n, c, h, w, l: (n, c * 16 + l, h, w)))
        odd = bb.emit(relax.op.layout_transform(x, lambda n, c, h, w: (n, h, w, c)))  # NHWC: not a block
        bb.emit_func_output(relax.Tuple([back, odd]))
    values = {b.var: b.value for b in bb.get()["main"].body.blocks[0].bindings}
    assert [transform_block(values[v], True) for v in (blocked, back, odd)] == [16, None, None]
    assert [transform_block(values[v], False) for v in (blocked, back, odd)] == [None, 16, None]


class ShuffleV1Unit(nn.Module):
    """ShuffleNet v1's stride-2 unit: 1x1 convs in 3 groups of 16->20 and 20->16 channels around a shuffle
    and a depthwise 3x3, and a shortcut average-pooled with padding (``count_include_pad``: the ONNX
    importer emits a zero pad and a pool) concatenated to it."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 48, 3, 1, 1)
        self.reduce = nn.Sequential(nn.Conv2d(48, 60, 1, groups=3), nn.BatchNorm2d(60), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(60, 60, 3, 2, 1, groups=60), nn.BatchNorm2d(60),
                                  nn.Conv2d(60, 48, 1, groups=3), nn.BatchNorm2d(48))
        self.head = nn.Conv2d(96, 16, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        n, c, h, w = (y := self.reduce(x)).shape
        y = self.body(y.view(n, 3, c // 3, h, w).transpose(1, 2).reshape(n, c, h, w))
        return self.head(torch.relu(torch.cat([nn.functional.avg_pool2d(x, 3, 2, 1), y], 1)))


@pytest.mark.parametrize("dynamo, opset", [(False, 9), (True, 18)], ids=["opset9", "dynamo"])
def test_shufflenet_v1_unit_is_blocked_end_to_end(dynamo, opset):
    """Every conv blocked and transforms only at the edges: the 60-channel tensors between groups of 20 take
    blocks of 10 (a block of 15, the widest dividing 60, kept both grouped convs NCHW with a transform on
    each side), the padded average pool is one pool in the blocked layout (torch's opset-9 export pads it
    with a Pad node, which the importer made a ``call_tir`` opaque to ConvertLayout), and the shuffle is one
    gather."""
    report, part = compile_and_compare(export(ShuffleV1Unit(), shape=(1, 3, 16, 16), dynamo=dynamo, opset=opset))
    assert report.convs == report.blocked == 5 and report.kept_nchw == []
    assert report.shuffles == 1 and report.lifted == (opset == 9) and report.transforms == 2
    convs = {t.task.dims["C"]: (t.task.dims["a"], t.task.dims["d"]) for t in part.tasks
             if t.kind == "conv2d_nchwc" and t.task.dims["G"] == 3}
    assert convs == {48: (16, 10), 60: (10, 16)}, convs
    assert not any("pad" in t.name for t in part.tasks), [t.name for t in part.tasks]
