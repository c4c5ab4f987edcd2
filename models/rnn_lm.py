"""A word-level language model as torch exports one: Embedding -> stacked LSTM (or GRU) -> Linear to vocab.

Each layer is one ONNX ``LSTM``/``GRU`` node (time major, weights as initializers, the state outputs
unused), which TVM's importer cannot convert: the pipeline lowers it with :mod:`graphopt.legalize.rnn`.
The default size is the LSTM LM the lowering's input-projection design was measured on.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from models.builder import GraphBuilder


@dataclass(frozen=True)
class RnnLmConfig:
    """The model's shape: the recurrent cell, the vocabulary, the layers' width and count, the input's length."""

    cell: str = "LSTM"  # or "GRU"
    vocab: int = 1000
    hidden: int = 256
    layers: int = 2
    seq: int = 32
    batch: int = 1
    bidirectional: bool = False


LSTM_LM = RnnLmConfig()


def build_rnn_lm(seed: int = 0, cfg: RnnLmConfig = LSTM_LM, name: str = "lstm-lm") -> onnx.ModelProto:
    """The language model of shape ``cfg``, its weights drawn from ``seed``."""
    cell, vocab, hidden, seq, batch = cfg.cell, cfg.vocab, cfg.hidden, cfg.seq, cfg.batch
    bidirectional = cfg.bidirectional
    gates = {"LSTM": 4, "GRU": 3}[cell]
    dirs = 2 if bidirectional else 1
    b = GraphBuilder(name, seed, opset=17)
    ids = b.input("input_ids", (seq, batch), TensorProto.INT64)
    x = b.op("Gather", [b.normal("embedding.weight", (vocab, hidden), 1.0), ids], "embedding/Gather")
    width = hidden
    scale = hidden ** -0.5  # torch's U(-1/sqrt(h), 1/sqrt(h)) init, as a normal of similar spread
    for i in range(cfg.layers):
        attrs = {"hidden_size": hidden, "direction": "bidirectional" if bidirectional else "forward"}
        if cell == "GRU":
            attrs["linear_before_reset"] = 1  # what torch's GRU computes
        w = b.normal(f"rnn.weight_ih_l{i}", (dirs, gates * hidden, width), scale)
        r = b.normal(f"rnn.weight_hh_l{i}", (dirs, gates * hidden, hidden), scale)
        bias = b.normal(f"rnn.bias_l{i}", (dirs, 2 * gates * hidden), scale)
        y = b.op(cell, [x, w, r, bias], f"rnn/{cell}_{i}", **attrs)  # [seq, dirs, batch, hidden]
        x = b.op("Reshape", [y, b.const(f"rnn/shape_{i}", [seq, batch, dirs * hidden])], f"rnn/Reshape_{i}")
        width = dirs * hidden
    logits = b.op("MatMul", [x, b.normal("decoder.weight", (width, vocab), width ** -0.5)], "decoder/MatMul")
    out = b.op("Add", [logits, b.normal("decoder.bias", (vocab,), 0.02)], "decoder/Add", out="logits")
    b.output(out, (seq, batch, vocab))
    return b.model(f"{cell} language model: vocab {vocab}, {cfg.layers} layers of hidden {hidden}, seq {seq}, "
                   f"batch {batch}{', bidirectional' if bidirectional else ''}")
