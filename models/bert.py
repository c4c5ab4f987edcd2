"""BERT encoders shaped like a Hugging Face ``BertModel`` ONNX export (opset 17, eager attention).

The graph follows what ``torch.onnx.export`` produces for ``transformers.BertModel`` with static shapes:
three int64 inputs; word + position + token-type embeddings via Gather; LayerNormalization; per layer
separate Q/K/V MatMul + bias Add, Reshape/Transpose into heads (K transposed straight to [B,h,d,S]),
QK^T MatMul, Div by sqrt(d), Add of the extended mask ``(1 - mask) * finfo(float32).min``, Softmax, MatMul
with V, Transpose/Reshape back, output projection, residual + LayerNorm, FFN with the exact Erf GELU
``x * 0.5 * (1 + erf(x / sqrt 2))``, residual + LayerNorm; outputs ``last_hidden_state`` and
``pooler_output`` (Gemm + Tanh on the first token).  Weights follow HF's init (N(0, 0.02), LayerNorm
gamma near 1), so activations look like a real checkpoint's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from models.builder import GraphBuilder


@dataclass(frozen=True)
class BertConfig:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    intermediate: int = 3072
    seq: int = 128
    batch: int = 1
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


BERT_BASE = BertConfig()
BERT_TINY = BertConfig(layers=2, hidden=128, heads=2, intermediate=512, vocab=1000)


def _linear(b: GraphBuilder, x: str, prefix: str, path: str, n_in: int, n_out: int) -> str:
    """torch Linear on a 3-D input exports as MatMul with the transposed weight, then Add of the bias."""
    w = b.normal(f"{prefix}.weight", (n_in, n_out), 0.02)
    bias = b.normal(f"{prefix}.bias", (n_out,), 0.02)
    y = b.op("MatMul", [x, w], f"{path}/MatMul")
    return b.op("Add", [bias, y], f"{path}/Add")


def _layer_norm(b: GraphBuilder, x: str, prefix: str, path: str, cfg: BertConfig, out: str | None = None) -> str:
    gamma = b.normal(f"{prefix}.weight", (cfg.hidden,), 0.02, mean=1.0)
    beta = b.normal(f"{prefix}.bias", (cfg.hidden,), 0.02)
    return b.op("LayerNormalization", [x, gamma, beta], f"{path}/LayerNormalization", out=out, axis=-1,
                epsilon=cfg.eps)


def _attention(b: GraphBuilder, x: str, mask: str, i: int, cfg: BertConfig, shapes: dict[str, str]) -> str:
    pre, path = f"encoder.layer.{i}.attention", f"/encoder/layer.{i}/attention"
    q = _linear(b, x, f"{pre}.self.query", f"{path}/self/query", cfg.hidden, cfg.hidden)
    k = _linear(b, x, f"{pre}.self.key", f"{path}/self/key", cfg.hidden, cfg.hidden)
    v = _linear(b, x, f"{pre}.self.value", f"{path}/self/value", cfg.hidden, cfg.hidden)
    heads = {}
    for name, t, perm in (("query", q, [0, 2, 1, 3]), ("key", k, [0, 2, 3, 1]), ("value", v, [0, 2, 1, 3])):
        r = b.op("Reshape", [t, shapes["heads"]], f"{path}/self/{name}/Reshape")
        heads[name] = b.op("Transpose", [r], f"{path}/self/{name}/Transpose", perm=perm)
    scores = b.op("MatMul", [heads["query"], heads["key"]], f"{path}/self/MatMul")
    scores = b.op("Div", [scores, shapes["sqrt_d"]], f"{path}/self/Div")
    scores = b.op("Add", [scores, mask], f"{path}/self/Add")
    probs = b.op("Softmax", [scores], f"{path}/self/Softmax", axis=-1)
    ctx = b.op("MatMul", [probs, heads["value"]], f"{path}/self/MatMul_1")
    ctx = b.op("Transpose", [ctx], f"{path}/self/Transpose", perm=[0, 2, 1, 3])
    ctx = b.op("Reshape", [ctx, shapes["hidden"]], f"{path}/self/Reshape")
    out = _linear(b, ctx, f"{pre}.output.dense", f"{path}/output/dense", cfg.hidden, cfg.hidden)
    out = b.op("Add", [out, x], f"{path}/output/Add")
    return _layer_norm(b, out, f"{pre}.output.LayerNorm", f"{path}/output/LayerNorm", cfg)


def _ffn(b: GraphBuilder, x: str, i: int, cfg: BertConfig, consts: dict[str, str], out: str | None = None) -> str:
    pre, path = f"encoder.layer.{i}", f"/encoder/layer.{i}"
    h = _linear(b, x, f"{pre}.intermediate.dense", f"{path}/intermediate/dense", cfg.hidden, cfg.intermediate)
    act = f"{path}/intermediate/intermediate_act_fn"
    g = b.op("Div", [h, consts["sqrt2"]], f"{act}/Div")
    g = b.op("Erf", [g], f"{act}/Erf")
    g = b.op("Add", [g, consts["one"]], f"{act}/Add")
    g = b.op("Mul", [h, g], f"{act}/Mul")
    g = b.op("Mul", [g, consts["half"]], f"{act}/Mul_1")
    y = _linear(b, g, f"{pre}.output.dense", f"{path}/output/dense", cfg.intermediate, cfg.hidden)
    y = b.op("Add", [y, x], f"{path}/output/Add")
    return _layer_norm(b, y, f"{pre}.output.LayerNorm", f"{path}/output/LayerNorm", cfg, out)


def build_bert(cfg: BertConfig = BERT_BASE, seed: int = 0, name: str = "bert") -> onnx.ModelProto:
    b = GraphBuilder(name, seed, opset=17)
    B, S, H = cfg.batch, cfg.seq, cfg.hidden
    ids = b.input("input_ids", (B, S), TensorProto.INT64)
    mask_in = b.input("attention_mask", (B, S), TensorProto.INT64)
    types = b.input("token_type_ids", (B, S), TensorProto.INT64)

    # Extended attention mask, as BertModel.get_extended_attention_mask exports it.
    m = b.op("Unsqueeze", [mask_in, b.const("/Constant_output_0", [1], np.int64)], "Unsqueeze")
    m = b.op("Unsqueeze", [m, b.const("/Constant_1_output_0", [2], np.int64)], "Unsqueeze_1")
    m = b.op("Cast", [m], "Cast", to=TensorProto.FLOAT)
    m = b.op("Sub", [b.const("/Constant_2_output_0", 1.0, np.float32), m], "Sub")
    mask = b.op("Mul", [m, b.const("/Constant_3_output_0", np.finfo(np.float32).min, np.float32)], "Mul")

    # Embeddings.  position_ids is a registered buffer sliced to the sequence length; the exporter folds
    # the slice into a constant.
    word = b.normal("embeddings.word_embeddings.weight", (cfg.vocab, H), 0.02)
    pos_table = b.normal("embeddings.position_embeddings.weight", (cfg.max_positions, H), 0.02)
    type_table = b.normal("embeddings.token_type_embeddings.weight", (cfg.type_vocab, H), 0.02)
    pos_ids = b.const("/embeddings/Slice_output_0", np.arange(S, dtype=np.int64)[None, :])
    e = b.op("Gather", [word, ids], "embeddings/word_embeddings/Gather")
    t = b.op("Gather", [type_table, types], "embeddings/token_type_embeddings/Gather")
    e = b.op("Add", [e, t], "embeddings/Add")
    p = b.op("Gather", [pos_table, pos_ids], "embeddings/position_embeddings/Gather")
    e = b.op("Add", [e, p], "embeddings/Add_1")
    x = _layer_norm(b, e, "embeddings.LayerNorm", "/embeddings/LayerNorm", cfg)

    shapes = {
        "heads": b.const("/encoder/Constant_output_0", [B, S, cfg.heads, cfg.head_dim], np.int64),
        "hidden": b.const("/encoder/Constant_1_output_0", [B, S, H], np.int64),
        "sqrt_d": b.const("/encoder/Constant_2_output_0", np.sqrt(cfg.head_dim), np.float32),
    }
    consts = {
        "sqrt2": b.const("/encoder/Constant_3_output_0", 1.4142135381698608, np.float32),
        "one": b.const("/encoder/Constant_4_output_0", 1.0, np.float32),
        "half": b.const("/encoder/Constant_5_output_0", 0.5, np.float32),
    }
    for i in range(cfg.layers):
        x = _attention(b, x, mask, i, cfg, shapes)
        x = _ffn(b, x, i, cfg, consts, out="last_hidden_state" if i == cfg.layers - 1 else None)

    # Pooler: first token -> Linear (exported as Gemm on a 2-D input) -> Tanh.
    first = b.op("Gather", [x, b.const("/pooler/Constant_output_0", 0, np.int64)],
                 "pooler/Gather", axis=1)
    w = b.normal("pooler.dense.weight", (H, H), 0.02)
    bias = b.normal("pooler.dense.bias", (H,), 0.02)
    pooled = b.op("Gemm", [first, w, bias], "pooler/dense/Gemm", alpha=1.0, beta=1.0, transB=1)
    b.op("Tanh", [pooled], "pooler/activation/Tanh", out="pooler_output")
    b.output("last_hidden_state", (B, S, H))
    b.output("pooler_output", (B, H))
    return b.model(f"BERT encoder ({cfg})")
