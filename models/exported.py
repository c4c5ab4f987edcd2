"""Real exporter output: torchvision, Hugging Face transformers and torch.nn models run through torch's exporters.

Our own builders (:mod:`models.registry`) write the graphs we expect; this corpus is what users actually bring
(issue 13): the TorchScript exporter (``dynamo=False``, opset 17: Constant nodes, Shape/Gather chains,
dynamic axes), the dynamo exporter (``dynamo=True``, opset 18: onnxscript's optimizer, value_info, its own
naming), and the old model-zoo convention (TorchScript at opset 9 with every weight also listed as a graph
input, ``keep_initializers_as_inputs=True``).  Every model is built from its library's own classes with
random, seeded weights (no hub downloads) in two sizes: ``small`` (reduced widths, depths and images so a
test exports and compiles it in seconds) and ``full`` (the architecture at its usual size, for
``bench/coverage.py``).

torch, torchvision and transformers are imported inside the builders, so ``import models`` stays light.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import onnx

from graphopt.errors import UserError

SIZES = ("small", "full")
# exporter name -> (opset, what it is); "opset9" is the model-zoo convention, offered for a few CNNs only.
EXPORTERS = {
    "torchscript": (17, "torch.onnx.export(dynamo=False, opset_version=17)"),
    "dynamo": (18, "torch.onnx.export(dynamo=True, opset_version=18)"),
    "opset9": (9, "torch.onnx.export(dynamo=False, opset_version=9, keep_initializers_as_inputs=True)"),
}


@dataclass
class Built:
    """A torch module ready to export: example args (their shapes are the suggested static shapes), input and
    output names, and which input axes the export leaves symbolic (name -> {axis: dim name})."""

    module: Any
    args: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]] = field(default_factory=dict)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # for the symbolic inputs
    # values the model needs to be run meaningfully (a control input), not just any values of the right dtype
    sample_inputs: dict[str, np.ndarray] | None = None


@dataclass
class ExportedModel:
    """One corpus entry as a user would hand it to ``optimize-model``."""

    name: str
    size: str
    exporter: str
    model: onnx.ModelProto
    input_shapes: dict[str, tuple[int, ...]]  # --input-shape for every symbolic input (empty: all static)
    sample_inputs: dict[str, np.ndarray] | None = None  # for --inputs FILE.npz when random values are invalid

    @property
    def opset(self) -> int:
        return next(o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx"))

    def shape_args(self) -> list[str]:
        """The ``--input-shape NAME=D1,...`` options this model needs on the command line."""
        out: list[str] = []
        for name, dims in self.input_shapes.items():
            out += ["--input-shape", f"{name}={','.join(str(d) for d in dims)}"]
        return out


@dataclass(frozen=True)
class CorpusSpec:
    name: str
    family: str  # transformer | vision | rnn | control
    description: str
    build: Callable[[str], Built]
    exporters: tuple[str, ...] = ("torchscript", "dynamo")


# ------------------------------------------------------------------------------------------------- helpers

_TV_LIB = None  # the torchvision op schemas defined on CPU torch (kept alive; see _torchvision)


def _torch():
    try:
        import torch
    except ImportError:
        raise UserError("the exported-model corpus needs torch: pip install -e .[test]") from None
    return torch


def _torchvision():
    """Import torchvision.  The PyPI wheel is a CUDA build whose C++ ops do not load on CPU torch; its Python
    modules register fake kernels for ``torchvision::nms``/``qnms`` at import, which needs their schemas, so
    we define them first (only when the library did not load them itself).  transformers imports torchvision
    too, so its builders come through here as well."""
    global _TV_LIB
    torch = _torch()
    if _TV_LIB is None:
        try:
            torch.ops.torchvision.nms.default  # noqa: B018 - present when the extension loaded
        except (AttributeError, RuntimeError):
            _TV_LIB = torch.library.Library("torchvision", "DEF")
            _TV_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _TV_LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision


def missing_dependency() -> str | None:
    """Why the corpus cannot be built here (torch, torchvision or transformers missing), or None."""
    try:
        _torchvision()
        import transformers  # noqa: F401
    except (ImportError, UserError) as exc:
        return f"the exported-model corpus needs torch, torchvision and transformers ({exc})"
    return None


def _trained_like(module) -> Any:
    """Seeded, non-trivial BatchNorm statistics and affine parameters (as after training), so BN folding and
    its numerics are really exercised; eval mode."""
    torch = _torch()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(n, generator=g) * 1.5 + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
    return module.eval()


def _pick(size: str, small, full):
    if size not in SIZES:
        raise UserError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    return small if size == "small" else full


def _image(size: str, small: int, full: int = 224):
    torch = _torch()
    hw = _pick(size, small, full)
    return (torch.randn(1, 3, hw, hw, generator=torch.Generator().manual_seed(0)),)


def _vision(module, size: str, small_image: int, full_image: int = 224) -> Built:
    return Built(_trained_like(module), _image(size, small_image, full_image), ["input"], ["logits"])


# ---------------------------------------------------------------------------------------------- transformers

def _tokens(size: str, vocab: int, names: list[str], batch: int) -> tuple:
    torch = _torch()
    seq = _pick(size, 16, 128)
    g = torch.Generator().manual_seed(0)
    args = []
    for n in names:
        if n == "input_ids":
            args.append(torch.randint(0, vocab, (batch, seq), generator=g))
        elif n == "token_type_ids":
            args.append(torch.zeros(batch, seq, dtype=torch.int64))
        else:
            args.append(torch.ones(batch, seq, dtype=torch.int64))
    return tuple(args)


def _outputs(model, names: list[str], fields: list[str]):
    """``model`` called with keyword inputs, returning a tuple of named fields (what optimum exports), not a
    ModelOutput."""
    torch = _torch()

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):  # named: torch.export maps by name
            given = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            out = self.model(**{n: given[n] for n in names})
            return tuple(getattr(out, f) for f in fields)

    return Wrapper().eval()


def _hf_built(model, size: str, vocab: int, names: list[str], fields: list[str]) -> Built:
    """Batch and sequence are exported symbolic, as optimum does; the example has batch 2 because torch.export
    specializes a dimension of size 1, and the suggested --input-shape is batch 1."""
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    return Built(_outputs(model, names, fields), _tokens(size, vocab, names, 2), names, fields, axes,
                 input_shapes={n: (1, _pick(size, 16, 128)) for n in names})


def bert(size: str) -> Built:
    _torchvision()
    _torch().manual_seed(0)
    from transformers import BertConfig, BertModel

    cfg = _pick(size, BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, max_position_embeddings=64),
                BertConfig())  # bert-base-uncased: 12 layers, hidden 768, 12 heads, vocab 30522
    return _hf_built(BertModel(cfg).eval(), size, cfg.vocab_size, ["input_ids", "attention_mask", "token_type_ids"],
                     ["last_hidden_state", "pooler_output"])


def minilm(size: str) -> Built:
    """The sentence-embedding encoder all-MiniLM-L6-v2 ships (sentence-transformers): a BERT of 6 layers,
    hidden 384, 12 heads, MLP 1536.  Random weights: its trained ones come from the Hugging Face hub, which a
    machine without network cannot reach; the kernels, shapes and timings are the same."""
    _torchvision()
    _torch().manual_seed(0)
    from transformers import BertConfig, BertModel

    cfg = _pick(size, BertConfig(vocab_size=1000, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=96, max_position_embeddings=64),
                BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536))
    return _hf_built(BertModel(cfg).eval(), size, cfg.vocab_size, ["input_ids", "attention_mask", "token_type_ids"],
                     ["last_hidden_state", "pooler_output"])


def gpt2(size: str) -> Built:
    _torchvision()
    _torch().manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = _pick(size, GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4),
                GPT2Config())  # gpt2 (124M): 12 layers, 768, 12 heads, vocab 50257
    cfg.use_cache = False
    return _hf_built(GPT2LMHeadModel(cfg).eval(), size, cfg.vocab_size, ["input_ids", "attention_mask"], ["logits"])


def distilbert(size: str) -> Built:
    _torchvision()
    _torch().manual_seed(0)
    from transformers import DistilBertConfig, DistilBertModel

    cfg = _pick(size, DistilBertConfig(vocab_size=1000, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                       max_position_embeddings=64),
                DistilBertConfig())  # distilbert-base: 6 layers, 768, 12 heads
    return _hf_built(DistilBertModel(cfg).eval(), size, cfg.vocab_size, ["input_ids", "attention_mask"],
                     ["last_hidden_state"])


# ---------------------------------------------------------------------------------------------- torchvision

def vit(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    from torchvision.models.vision_transformer import VisionTransformer

    m = _pick(size, lambda: VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                              hidden_dim=32, mlp_dim=64, num_classes=10),
              lambda: tv.models.vit_b_16())()
    # torchvision zero-initializes the classifier head: untrained, every output is 0 and a check against
    # onnxruntime compares zeros with zeros.  A random head makes the check see the whole network.
    with _torch().no_grad():
        m.heads.head.weight.normal_(0, 0.02)
    return _vision(m, size, 32)


def swin(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    from torchvision.models.swin_transformer import SwinTransformer

    m = _pick(size, lambda: SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                            window_size=[4, 4], num_classes=10),
              lambda: tv.models.swin_t())()
    return _vision(m, size, 32)


def convnext(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    m = _pick(size, lambda: ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=10),
              lambda: tv.models.convnext_tiny())()
    return _vision(m, size, 32)


def resnet(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    from torchvision.models.resnet import BasicBlock, ResNet

    m = _pick(size, lambda: ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10), lambda: tv.models.resnet50())()
    return _vision(m, size, 32)


def resnext(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    from torchvision.models.resnet import Bottleneck, ResNet

    m = _pick(size, lambda: ResNet(Bottleneck, [1, 1, 1, 1], groups=8, width_per_group=4, num_classes=10),
              lambda: tv.models.resnext50_32x4d())()
    return _vision(m, size, 32)


def mobilenet_v2(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    m = _pick(size, lambda: tv.models.MobileNetV2(width_mult=0.25, num_classes=10),
              lambda: tv.models.mobilenet_v2())()
    return _vision(m, size, 32)


def mobilenet_v3(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    m = _pick(size, lambda: tv.models.mobilenet_v3_small(width_mult=0.25, num_classes=10),
              lambda: tv.models.mobilenet_v3_large())()
    return _vision(m, size, 32)


def efficientnet(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    def small():
        setting = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(6, 3, 2, 8, 16, 1), MBConvConfig(6, 5, 2, 16, 24, 1)]
        return EfficientNet(setting, dropout=0.2, num_classes=10, last_channel=64)

    return _vision(_pick(size, small, lambda: tv.models.efficientnet_b0())(), size, 32)


def densenet(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    m = _pick(size, lambda: tv.models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16,
                                                num_classes=10),
              lambda: tv.models.densenet121())()
    return _vision(m, size, 32)


def googlenet(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    # GoogLeNet's widths are fixed by the architecture; ``small`` only shrinks the image (1.5 GFLOP -> 0.04).
    m = tv.models.GoogLeNet(num_classes=_pick(size, 10, 1000), aux_logits=False, init_weights=True)
    return _vision(m, size, 32)


def inception_v3(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    # Inception-v3 needs >= 75x75 inputs; its outputs reach ~800 with random weights (issue 13, item 4).
    m = tv.models.Inception3(num_classes=_pick(size, 10, 1000), aux_logits=False, init_weights=True)
    return _vision(m, size, 75, 299)


def squeezenet(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    # SqueezeNet 1.1's widths are fixed (1.2 M weights); ``small`` shrinks the image and the classifier.
    m = tv.models.SqueezeNet(version="1_1", num_classes=_pick(size, 10, 1000))
    return _vision(m, size, 64)


def shufflenet(size: str) -> Built:
    tv = _torchvision()
    _torch().manual_seed(0)
    # ShuffleNet-v2's channel shuffle is a 5-D reshape/transpose/reshape (its two branches concatenated,
    # viewed as [N, 2, C/2, H, W], the group axes swapped): the layout stage must carry blocked layouts
    # around it (issue 24).  ``small``: width 0.5 (48-192 channels), a 64x64 image, 10 classes.
    m = _pick(size, lambda: tv.models.shufflenet_v2_x0_5(num_classes=10), lambda: tv.models.shufflenet_v2_x1_0())()
    return _vision(m, size, 64)


def shufflenet_v1(size: str) -> Built:
    """ShuffleNet v1 with 3 groups (Zhang et al., "ShuffleNet: An Extremely Efficient Convolutional Neural
    Network for Mobile Devices", CVPR 2018, Table 1; torchvision has none, the onnx model zoo's is an
    opset-9 export of this architecture): every 1x1 conv is grouped (3 groups of 20-80 channels, none a
    vector multiple) and a channel shuffle (``[N, g, C/g, H, W]`` transposed) follows the first, before a
    depthwise 3x3.  Stride-2 units concatenate an average-pooled shortcut.  ``full``: 240/480/960 channels,
    4/8/4 units, 224; ``small``: 48/96/192 channels, one unit a stage, 64x64, 10 classes."""
    torch = _torch()
    nn = torch.nn
    torch.manual_seed(0)
    groups = 3
    widths, repeats, classes = _pick(size, ((48, 96, 192), (1, 1, 1), 10), ((240, 480, 960), (4, 8, 4), 1000))

    def conv_bn(cin: int, cout: int, k: int, stride: int = 1, g: int = 1) -> list:
        return [nn.Conv2d(cin, cout, k, stride, k // 2, groups=g, bias=False), nn.BatchNorm2d(cout)]

    class Unit(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, g1: int):
            super().__init__()
            self.stride, mid = stride, cout // 4
            out = cout - cin if stride == 2 else cout  # a stride-2 unit concatenates its input, pooled
            self.g1 = g1
            self.reduce = nn.Sequential(*conv_bn(cin, mid, 1, g=g1), nn.ReLU(inplace=True))
            self.body = nn.Sequential(*conv_bn(mid, mid, 3, stride, g=mid), *conv_bn(mid, out, 1, g=groups))

        def forward(self, x):
            y = self.reduce(x)
            n, c, h, w = y.shape
            y = y.view(n, self.g1, c // self.g1, h, w).transpose(1, 2).reshape(n, c, h, w)  # channel shuffle
            y = self.body(y)
            if self.stride == 2:
                return torch.relu(torch.cat([nn.functional.avg_pool2d(x, 3, 2, 1), y], 1))
            return torch.relu(x + y)

    class ShuffleNetV1(nn.Module):
        def __init__(self):
            super().__init__()
            layers, c = [*conv_bn(3, 24, 3, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)], 24
            for stage, (width, n) in enumerate(zip(widths, repeats)):
                for i in range(n):
                    # the first unit reads the stem's 24 channels: too few to group (the paper's note)
                    layers.append(Unit(c, width, 2 if i == 0 else 1, 1 if stage == 0 and i == 0 else groups))
                    c = width
            self.features = nn.Sequential(*layers)
            self.fc = nn.Linear(c, classes)

        def forward(self, x):
            return self.fc(self.features(x).mean((2, 3)))

    return _vision(ShuffleNetV1(), size, 64)


def _fc_classifier_cnn(name: str, channels: int, small_image: int, size: str) -> Built:
    """A torchvision CNN whose classifier is FC layers over its pooled ``channels``-channel features.
    ``small``: a ``small_image``-pixel image, the features pooled to 1x1 and one FC layer to 10 classes (the
    convs keep their widths; pooled to the full model's 7x7 or 6x6 from a 1x1 map, the TorchScript exporter
    refuses the adaptive pool)."""
    tv, torch = _torchvision(), _torch()
    torch.manual_seed(0)
    m = getattr(tv.models, name)(num_classes=_pick(size, 10, 1000))
    if size == "small":
        m.avgpool = torch.nn.AdaptiveAvgPool2d(1)
        m.classifier = torch.nn.Linear(channels, 10)
    return _vision(m, size, small_image)


def vgg(size: str) -> Built:
    """VGG-19: 16 3x3 convs, two 4096-wide FC layers over 25088 inputs (548 MB of weights at full size)."""
    return _fc_classifier_cnn("vgg19", 512, 32, size)


def alexnet(size: str) -> Built:
    """AlexNet: an 11x11 stride-4 conv, 5x5 and 3x3 convs, three FC layers (9216 -> 4096 -> 4096); ``small``
    at 64x64, its least image."""
    return _fc_classifier_cnn("alexnet", 256, 64, size)


def convnet(size: str) -> Built:
    """A model-zoo-era CNN (VGG-like: conv-BN-ReLU stacks, max pools, ``view`` + two Linear layers)."""
    torch = _torch()
    nn = torch.nn
    torch.manual_seed(0)
    width, image = _pick(size, (8, 32), (32, 224))

    class ConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            layers, c = [], 3
            for w in (width, 2 * width, 4 * width, 8 * width):
                layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
                c = w
            self.features = nn.Sequential(*layers)
            self.flat = c * (image // 16) ** 2
            self.fc1 = nn.Linear(self.flat, 8 * width)
            self.fc2 = nn.Linear(8 * width, 10)

        def forward(self, x):
            x = self.features(x)
            x = x.view(x.size(0), self.flat)  # Shape/Gather/Concat/Reshape in the TorchScript export
            return self.fc2(torch.relu(self.fc1(x)))

    return _vision(ConvNet(), size, image, image)


# ---------------------------------------------------------------------------------------------- recurrent

def _rnn_lm(cell: str, bidirectional: bool) -> Callable[[str], Built]:
    """Word-level language model (Zaremba et al. 2014, "Recurrent Neural Network Regularization", medium:
    2 layers of 650, sequence 35, vocab 10k): Embedding -> nn.LSTM/nn.GRU -> Linear decoder."""

    def build(size: str) -> Built:
        torch = _torch()
        nn = torch.nn
        torch.manual_seed(0)
        vocab, hidden, seq = _pick(size, (100, 16, 8), (10000, 650, 35))

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, hidden)
                self.rnn = getattr(nn, cell)(hidden, hidden, num_layers=2, batch_first=True,
                                             bidirectional=bidirectional)
                self.decoder = nn.Linear(hidden * (2 if bidirectional else 1), vocab)

            def forward(self, tokens):
                y, _ = self.rnn(self.embed(tokens))
                return self.decoder(y)

        tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
        return Built(LM().eval(), (tokens,), ["tokens"], ["logits"])

    return build


# ---------------------------------------------------------------------------------------------- control input

SAMPLE_RATES = (8000, 16000)


def vad(size: str) -> Built:
    """A voice-activity detector shaped like Silero VAD's ONNX release: audio chunk + integer sample rate +
    recurrent state in, speech probability + new state out.  The sample rate picks the front end with an
    ``If`` (16 kHz: a strided STFT-like Conv1d; 8 kHz: one with half the window), and the energy features are
    normalised by ``16000 / sr``: any value but 8000 or 16000 gives a wrong branch or Inf/NaN, so the model
    can only be checked with valid sample inputs (``--inputs FILE.npz``, issue 13 item 5)."""
    torch = _torch()
    nn = torch.nn
    torch.manual_seed(0)
    chunk, ch, hidden = _pick(size, (256, 16, 16), (512, 128, 64))

    class FrontEnd(nn.Module):
        def __init__(self, window: int):
            super().__init__()
            self.ch = ch
            self.stft = nn.Conv1d(1, 2 * ch, window, stride=window // 2, bias=False)
            self.enc = nn.Sequential(nn.Conv1d(ch, ch, 3, padding=1), nn.ReLU(), nn.Conv1d(ch, ch, 3, padding=1),
                                     nn.ReLU())

        def forward(self, x, scale):
            spec = self.stft(x.unsqueeze(1))
            re, im = spec[:, :self.ch], spec[:, self.ch:]
            mag = torch.sqrt(re * re + im * im + 1e-6) * scale
            return self.enc(mag).mean(dim=2)

    class Vad(nn.Module):
        def __init__(self):
            super().__init__()
            self.front16 = FrontEnd(32)
            self.front8 = FrontEnd(16)
            self.cell = nn.LSTMCell(ch, hidden)
            self.out = nn.Linear(hidden, 1)

        def forward(self, x, sr, state):
            scale = 16000.0 / sr.to(torch.float32)
            if torch.jit.is_scripting():  # the TorchScript exporter needs a scripted If
                feats = self.front16(x, scale) if bool(sr == 16000) else self.front8(x, scale)
            else:  # torch.export (dynamo) needs torch.cond for data-dependent control flow
                feats = torch.cond(sr == 16000, self.front16, self.front8, (x, scale))
            h, c = self.cell(feats, (state[0], state[1]))
            return torch.sigmoid(self.out(h)), torch.stack([h, c])

    audio = torch.randn(1, chunk, generator=torch.Generator().manual_seed(0)) * 0.1
    sr = torch.tensor(16000, dtype=torch.int64)
    state = torch.zeros(2, 1, hidden)
    samples = {"input": audio.numpy(), "sr": np.array(16000, dtype=np.int64), "state": state.numpy()}
    return Built(Vad().eval(), (audio, sr, state), ["input", "sr", "state"], ["output", "stateN"],
                 sample_inputs=samples)


def _silero(both_rates: bool) -> Callable[[str], Built]:
    """A replica of Silero VAD's released ONNX (v5: https://github.com/snakers4/silero-vad), structure kept,
    weights random: audio ``input`` [batch, samples] with both axes symbolic, an int64 scalar ``sr`` and the
    LSTM ``state`` [2, batch, hidden] in, speech probability [batch, 1] and the new state out.  Per sample
    rate: a reflect pad of ``sr // 250`` samples of context on the left (Silero's 64 at 16 kHz, 32 at 8 kHz)
    and the rest of a fixed 128-sample margin on the right, so the exported ``Pad`` has pads computed from
    ``sr`` while the frame count depends on the chunk length alone (torch.export cannot unroll an LSTM over
    a length it only knows at run time); a Conv1d "STFT" (fixed basis as weights, stride = hop) and its
    magnitude ``sqrt(re^2 + im^2)``; Conv1d+ReLU encoder blocks, some strided; an ``nn.LSTM`` over the
    frames; the decoder (ReLU, 1x1 Conv1d, Sigmoid, mean over time).

    ``both_rates`` is v5's layout: the 16 kHz and 8 kHz graphs under an ``If`` on ``sr == 16000`` (a
    ``torch.cond`` for the dynamo exporter).  Without it, the 16 kHz graph alone (still reading ``sr``):
    the LSTM is then a top-level node whose input shape depends on the pads, hence on ``sr``'s value.
    Both exports were failures of issue 25: the LSTM's input ``(unk, unk, C)`` after ``--input-shape``,
    and TVM's importer's "Dynamic pads are not supported yet" inside the ``If``."""

    def build(size: str) -> Built:
        torch = _torch()
        nn = torch.nn
        torch.manual_seed(0)
        ch, hidden, strides = _pick(size, ((16, 16, 16), 16, (1, 2, 1)), ((128, 64, 64, 128), 128, (1, 2, 2, 1)))
        windows = _pick(size, {16000: 64, 8000: 32}, {16000: 256, 8000: 128})
        samples, margin, batch = 576, 128, 4  # Silero v5's 16 kHz chunk: 512 samples + 64 of context

        class RateGraph(nn.Module):
            """One sample rate's model: pad, STFT magnitude, encoder, LSTM, decoder."""

            def __init__(self, window: int):
                super().__init__()
                self.bins, self.margin = window // 2 + 1, margin
                self.stft = nn.Conv1d(1, 2 * self.bins, window, stride=window // 2, bias=False)
                blocks: list[Any] = []
                for c_in, c_out, s in zip((self.bins,) + ch[:-1], ch, strides):
                    blocks += [nn.Conv1d(c_in, c_out, 3, stride=s, padding=1), nn.ReLU()]
                self.encoder = nn.Sequential(*blocks)
                self.lstm = nn.LSTM(ch[-1], hidden, batch_first=True)
                self.decoder = nn.Sequential(nn.ReLU(), nn.Conv1d(hidden, 1, 1), nn.Sigmoid())

            def forward(self, x, sr, state):
                if torch.jit.is_scripting():
                    context = int(sr // 250)
                else:  # torch.export: a size from a tensor's value, bounded so the output length is known
                    context = (sr // 250).item()
                    torch._check(context >= 0)
                    torch._check(context <= self.margin)
                x = torch.nn.functional.pad(x.unsqueeze(1), [context, self.margin - context], mode="reflect")
                spec = self.stft(x)
                re, im = spec[:, :self.bins], spec[:, self.bins:]
                feats = self.encoder(torch.sqrt(re * re + im * im))
                y, (h, c) = self.lstm(feats.permute(0, 2, 1), (state[0:1], state[1:2]))  # permute: scripted
                prob = self.decoder(y.permute(0, 2, 1)).mean(dim=2)  # graphs lose ranks, transpose needs one
                return prob, torch.cat([h, c])

        class TwoRates(nn.Module):
            def __init__(self):
                super().__init__()
                self.rate16, self.rate8 = RateGraph(windows[16000]), RateGraph(windows[8000])

            def forward(self, input, sr, state):  # noqa: A002 - Silero's input name; torch.export maps by name
                if torch.jit.is_scripting():  # the TorchScript exporter needs a scripted If
                    if bool(sr == 16000):
                        return self.rate16(input, sr, state)
                    return self.rate8(input, sr, state)
                return torch.cond(sr == 16000, self.rate16, self.rate8, (input, sr, state))

        class OneRate(nn.Module):
            def __init__(self):
                super().__init__()
                self.rate16 = RateGraph(windows[16000])

            def forward(self, input, sr, state):  # noqa: A002
                return self.rate16(input, sr, state)

        g = torch.Generator().manual_seed(0)
        example = (torch.randn(2, samples, generator=g) * 0.1, torch.tensor(16000, dtype=torch.int64),
                   torch.zeros(2, 2, hidden))  # batch 2: torch.export specializes a dimension of size 1
        samples_in = {"input": (torch.randn(batch, samples, generator=g) * 0.1).numpy(),
                      "sr": np.array(16000, dtype=np.int64), "state": np.zeros((2, batch, hidden), np.float32)}
        axes = {"input": {0: "batch", 1: "samples"}, "state": {1: "batch"}}
        return Built((TwoRates() if both_rates else OneRate()).eval(), example, ["input", "sr", "state"],
                     ["output", "stateN"], axes, {"input": (batch, samples), "state": (2, batch, hidden)},
                     sample_inputs=samples_in)

    return build


# ---------------------------------------------------------------------------------------------- the corpus

CORPUS: dict[str, CorpusSpec] = {s.name: s for s in [
    CorpusSpec("bert", "transformer", "transformers BertModel (full: bert-base, seq 128)", bert),
    CorpusSpec("gpt2", "transformer", "transformers GPT2LMHeadModel, no cache (full: gpt2 124M, seq 128)", gpt2),
    CorpusSpec("minilm", "transformer", "transformers BertModel as all-MiniLM-L6-v2 (full: 6 layers, hidden 384, "
               "seq 128; random weights)", minilm),
    CorpusSpec("distilbert", "transformer", "transformers DistilBertModel (full: distilbert-base, seq 128)",
               distilbert),
    CorpusSpec("vit", "vision", "torchvision VisionTransformer (full: vit_b_16, 224)", vit),
    CorpusSpec("swin", "vision", "torchvision SwinTransformer, windowed attention (full: swin_t, 224)", swin),
    CorpusSpec("convnext", "vision", "torchvision ConvNeXt (full: convnext_tiny, 224)", convnext),
    CorpusSpec("resnet", "vision", "torchvision ResNet (small: BasicBlock [1,1,1,1]; full: resnet50, 224)",
               resnet, ("torchscript", "dynamo", "opset9")),
    CorpusSpec("resnext", "vision", "torchvision ResNeXt (full: resnext50_32x4d, 224)", resnext),
    CorpusSpec("mobilenet_v2", "vision", "torchvision MobileNetV2 (small: width 0.25; full: 1.0, 224)",
               mobilenet_v2),
    CorpusSpec("mobilenet_v3", "vision", "torchvision MobileNetV3 (small: v3-small width 0.25; full: v3-large)",
               mobilenet_v3),
    CorpusSpec("efficientnet", "vision", "torchvision EfficientNet (small: 3 MBConv stages; full: b0, 224)",
               efficientnet),
    CorpusSpec("densenet", "vision", "torchvision DenseNet (small: growth 8, blocks (2,2); full: densenet121)",
               densenet),
    CorpusSpec("googlenet", "vision", "torchvision GoogLeNet, no aux heads (small: 32x32 image; full: 224)",
               googlenet),
    CorpusSpec("inception_v3", "vision", "torchvision Inception3, no aux heads (small: 75x75; full: 299x299)",
               inception_v3),
    CorpusSpec("squeezenet", "vision", "torchvision SqueezeNet 1.1 (small: 64x64 image; full: 224)", squeezenet,
               ("torchscript", "dynamo", "opset9")),
    CorpusSpec("shufflenet", "vision", "torchvision ShuffleNetV2 (5-D channel shuffle; small: x0.5, 64x64 image; "
               "full: x1.0, 224)", shufflenet, ("torchscript", "dynamo", "opset9")),
    CorpusSpec("shufflenet_v1", "vision", "ShuffleNet v1, 3 groups (grouped 1x1 convs + channel shuffle; small: "
               "48-192 channels, 64x64; full: 240-960, 224)", shufflenet_v1, ("dynamo", "opset9")),
    CorpusSpec("convnet", "vision", "VGG-like CNN with BatchNorm and view() (model-zoo era)", convnet,
               ("torchscript", "dynamo", "opset9")),
    CorpusSpec("vgg", "vision", "torchvision VGG-19 (small: 32x32 image, pooled to 1x1, one FC layer; "
               "full: 224)", vgg, ("torchscript", "dynamo", "opset9")),
    CorpusSpec("alexnet", "vision", "torchvision AlexNet (small: 64x64 image, pooled to 1x1, one FC layer; "
               "full: 224)", alexnet, ("torchscript", "dynamo", "opset9")),
    CorpusSpec("lstm_lm", "rnn", "word LM: Embedding + 2-layer nn.LSTM + Linear (full: 650 wide, seq 35)",
               _rnn_lm("LSTM", False)),
    CorpusSpec("bilstm_lm", "rnn", "word LM, bidirectional 2-layer nn.LSTM", _rnn_lm("LSTM", True)),
    CorpusSpec("gru_lm", "rnn", "word LM: Embedding + 2-layer nn.GRU + Linear", _rnn_lm("GRU", False)),
    CorpusSpec("bigru_lm", "rnn", "word LM, bidirectional 2-layer nn.GRU", _rnn_lm("GRU", True)),
    CorpusSpec("vad", "control", "Silero-VAD-like: audio + int64 sample rate (8000|16000, an If) + LSTM state",
               vad),
    CorpusSpec("vad_real", "control", "Silero VAD v5 replica: If on int64 sr over 16k/8k graphs (pads from sr, "
               "Conv1d STFT, nn.LSTM), dynamic [batch, samples]", _silero(True)),
    # The dynamo exporter (torch 2.13) writes a rank-4 type for the top-level LSTM's Y_h output, which the
    # ONNX checker rejects; under the If of vad_real its types are right.
    CorpusSpec("vad_real_16k", "control", "Silero VAD replica, 16 kHz graph alone: a top-level nn.LSTM behind "
               "pads computed from sr", _silero(False), ("torchscript",)),
]}


def matrix(names: list[str] | None = None) -> list[tuple[str, str]]:
    """(model, exporter) pairs of the corpus, in corpus order."""
    out = []
    for name in names or list(CORPUS):
        spec = get_spec(name)
        out += [(spec.name, e) for e in spec.exporters]
    return out


def get_spec(name: str) -> CorpusSpec:
    try:
        return CORPUS[name]
    except KeyError:
        raise UserError(f"unknown corpus model {name!r}; choose from: {', '.join(CORPUS)}") from None


def export(built: Built, exporter: str) -> onnx.ModelProto:
    """Run torch's exporter as a user would (warnings silenced; they are the exporter's, not ours)."""
    torch = _torch()
    if exporter not in EXPORTERS:
        raise UserError(f"unknown exporter {exporter!r}: use one of {', '.join(EXPORTERS)}")
    opset = EXPORTERS[exporter][0]
    kw: dict[str, Any] = dict(input_names=built.input_names, output_names=built.output_names, opset_version=opset)
    with warnings.catch_warnings():  # no torch.no_grad(): it turns on eval fast paths (MHA) that do not export
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            if built.dynamic_axes:  # dynamic_axes does not translate for HF models: say it in torch.export's terms
                dims: dict[str, Any] = {}
                kw["dynamic_shapes"] = {n: {a: dims.setdefault(d, torch.export.Dim(d))
                                            for a, d in built.dynamic_axes.get(n, {}).items()}
                                        for n in built.input_names}
            return torch.onnx.export(built.module, built.args, dynamo=True, verbose=False, **kw).model_proto
        if built.dynamic_axes:
            kw["dynamic_axes"] = built.dynamic_axes
        module = built.module
        if built.sample_inputs is not None:  # data-dependent control flow (torch.cond) must be scripted
            module = torch.jit.script(module)
        buf = io.BytesIO()
        torch.onnx.export(module, built.args, buf, dynamo=False, keep_initializers_as_inputs=exporter == "opset9",
                          **kw)
        return onnx.load_from_string(buf.getvalue())


def build_exported(name: str, size: str = "small", exporter: str = "torchscript") -> ExportedModel:
    """Build corpus model ``name`` at ``size`` and export it with ``exporter``."""
    spec = get_spec(name)
    if exporter not in spec.exporters:
        raise UserError(f"{name} is not exported with {exporter!r} in the corpus (it is with: "
                        f"{', '.join(spec.exporters)})")
    built = spec.build(size)
    model = export(built, exporter)
    return ExportedModel(name, size, exporter, model, dict(built.input_shapes), built.sample_inputs)


__all__ = ["CORPUS", "EXPORTERS", "SIZES", "ExportedModel", "build_exported", "get_spec", "matrix",
           "missing_dependency"]
