"""The benchmark model set: name -> (one-line description, builder).

Builders are plain functions ``(seed) -> onnx.ModelProto`` so tests, benchmarks and the CLI build the same
models the same way; a reduced configuration of a family is built by calling the family's builder directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx

from graphopt.errors import UserError
from models.bert import BERT_BASE, BERT_TINY, build_bert
from models.inception import build_inception
from models.mlp import build_mlp
from models.nasrnn import build_nasrnn
from models.resnet import RESNET50, RESNEXT50, build_resnet
from models.rnn_lm import RnnLmConfig, build_rnn_lm


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    build: Callable[[int], onnx.ModelProto]


MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("bert-base", "BERT-base encoder, HF-export shaped: 12 layers, hidden 768, 12 heads, seq 128, "
              "batch 1 (~440 MB of weights)", lambda seed: build_bert(BERT_BASE, seed, "bert-base")),
    ModelSpec("bert-tiny", "same BERT graph with 2 layers, hidden 128, 2 heads, vocab 1000 "
              "(bundled as models/bert_tiny.onnx)", lambda seed: build_bert(BERT_TINY, seed, "bert-tiny")),
    ModelSpec("resnet50", "ResNet-50, 1x3x224x224, BatchNorm folded into Conv",
              lambda seed: build_resnet(RESNET50, seed, "resnet50")),
    ModelSpec("resnext50", "ResNeXt-50 32x4d (grouped 3x3 convs, 32 groups), 1x3x224x224, BatchNorm folded",
              lambda seed: build_resnet(RESNEXT50, seed, "resnext50")),
    ModelSpec("inception-block", "GoogLeNet inception 3a, 3b, 4a blocks (parallel 1x1/3x3/5x5/pool branches)",
              lambda seed: build_inception(seed)),
    ModelSpec("nasrnn", "TASO's NASRNN cell unrolled 5 steps, hidden 512 (16 small MatMuls per step)",
              lambda seed: build_nasrnn(seed)),
    ModelSpec("lstm-lm", "word-level LSTM LM: embedding, 2 ONNX LSTM layers of hidden 256, vocab 1000 head; "
              "seq 32, batch 1", lambda seed: build_rnn_lm(seed)),
    ModelSpec("gru-lm", "the same LM with bidirectional GRU layers (linear_before_reset, as torch exports)",
              lambda seed: build_rnn_lm(seed, RnnLmConfig(cell="GRU", bidirectional=True), name="gru-lm")),
    ModelSpec("mlp", "MLP 784-1024-1024-1024-10, batch 64 (Gemm+Relu layers, MatMul+Add head)",
              lambda seed: build_mlp(seed)),
]}


def get_model(name: str) -> ModelSpec:
    """The spec for ``name``; unknown names are a user error listing the valid ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)} "
                        "(see python -m models list)") from None


def build(name: str, seed: int = 0) -> onnx.ModelProto:
    return get_model(name).build(seed)
