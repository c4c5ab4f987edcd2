"""The benchmark model builders: CLI, faithfulness to the real architectures, and round trips.

Faithfulness is checked two ways: numerically (bert-tiny, nasrnn and mlp against numpy re-implementations
that read the builder's weights by name) and structurally (parameter counts that must equal torchvision's /
Hugging Face's published counts for the full-size architectures).
"""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from graphopt.errors import UserError
from graphopt.feeds import random_inputs, run_ort
from graphopt.onnx_io import account_nodes, import_onnx
from graphopt.roundtrip import roundtrip
from models import MODELS, build, get_model
from models.__main__ import main as models_main
from models.bert import BERT_BASE, BERT_TINY, BertConfig, build_bert

ROOT = Path(__file__).resolve().parents[1]


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _ops(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


@pytest.fixture(scope="module")
def built() -> dict[str, onnx.ModelProto]:
    """Every registered model except bert-base (440 MB; see the slow test) built once with seed 0."""
    return {name: build(name) for name in MODELS if name != "bert-base"}


# ---- CLI ----------------------------------------------------------------------------------------------
def test_list_names_every_model(capsys):
    assert models_main(["list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == list(MODELS)
    assert {"bert-base", "bert-tiny", "resnet50", "resnext50", "inception-block", "nasrnn", "mlp"} <= set(MODELS)
    assert all(len(ln.split(None, 1)) == 2 for ln in lines)  # every name has a description


def test_build_writes_a_loadable_model(tmp_path, capsys):
    out = tmp_path / "sub" / "mlp.onnx"
    assert models_main(["build", "mlp", "-o", str(out), "--seed", "3"]) == 0
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["input"]
    assert "mlp.onnx" in capsys.readouterr().out


def test_unknown_model_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "models", "build", "resnet51", "-o", str(tmp_path / "x.onnx")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "resnet51" in proc.stderr and "resnet50" in proc.stderr and "bert-base" in proc.stderr
    assert not (tmp_path / "x.onnx").exists()
    with pytest.raises(UserError, match="choose one of"):
        get_model("nope")


def test_unwritable_output_is_a_user_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert models_main(["build", "mlp", "-o", str(blocker / "mlp.onnx")]) == 2  # parent is a file
    err = capsys.readouterr().err
    assert err.startswith("error: -o") and "is a file, not a folder" in err and err.count("\n") == 1


def test_seed_controls_the_weights():
    a, b, c = build("mlp", seed=0), build("mlp", seed=0), build("mlp", seed=1)
    assert a.SerializeToString() == b.SerializeToString()
    wa, wc = _weights(a), _weights(c)
    assert wa.keys() == wc.keys()
    assert not np.array_equal(wa["layers.0.weight"], wc["layers.0.weight"])


def test_bundled_bert_tiny_is_the_builders_output():
    committed = onnx.load(str(ROOT / "models" / "bert_tiny.onnx"))
    assert committed.SerializeToString() == build("bert-tiny", seed=0).SerializeToString()
    assert (ROOT / "models" / "bert_tiny.onnx").stat().st_size < 5e6


# ---- BERT ---------------------------------------------------------------------------------------------
def _bert_params(cfg: BertConfig) -> int:
    h, i = cfg.hidden, cfg.intermediate
    emb = (cfg.vocab + cfg.max_positions + cfg.type_vocab) * h + 2 * h
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    return emb + cfg.layers * layer + h * h + h


def test_bert_base_config_has_hf_parameter_count():
    # bert-base-uncased (transformers BertModel) has 109,482,240 parameters.
    assert _bert_params(BERT_BASE) == 109_482_240
    assert (BERT_BASE.layers, BERT_BASE.hidden, BERT_BASE.heads, BERT_BASE.intermediate, BERT_BASE.seq,
            BERT_BASE.vocab) == (12, 768, 12, 3072, 128, 30522)


def _check_bert_structure(model: onnx.ModelProto, cfg: BertConfig) -> None:
    g = model.graph
    assert model.opset_import[0].version == 17
    assert [(i.name, i.type.tensor_type.elem_type) for i in g.input] == [
        ("input_ids", onnx.TensorProto.INT64), ("attention_mask", onnx.TensorProto.INT64),
        ("token_type_ids", onnx.TensorProto.INT64)]
    assert all([d.dim_value for d in i.type.tensor_type.shape.dim] == [cfg.batch, cfg.seq] for i in g.input)
    assert [o.name for o in g.output] == ["last_hidden_state", "pooler_output"]
    params = sum(int(np.prod(w.shape)) for k, w in _weights(model).items() if "." in k)
    assert params == _bert_params(cfg)
    ops, L = _ops(model), cfg.layers
    # Per layer: Q, K, V, output, FFN1, FFN2 projections + QK^T + PV; 3 Gathers for embeddings + pooler.
    assert ops["MatMul"] == 8 * L and ops["Softmax"] == L and ops["Erf"] == L
    assert ops["LayerNormalization"] == 2 * L + 1 and ops["Gather"] == 4
    assert ops["Gemm"] == 1 and ops["Tanh"] == 1 and ops["Cast"] == 1
    transposes = [list(n.attribute[0].ints) for n in g.node if n.op_type == "Transpose"]
    assert transposes.count([0, 2, 3, 1]) == L  # K goes straight to [B, heads, d, S], as in HF exports
    eps = [a.f for n in g.node if n.op_type == "LayerNormalization" for a in n.attribute if a.name == "epsilon"]
    assert eps == pytest.approx([cfg.eps] * (2 * L + 1), rel=1e-6)


def test_bert_builder_structure_on_reduced_bert_base():
    cfg = dataclasses.replace(BERT_BASE, layers=1)  # full width and vocab, one layer: same builder
    model = build_bert(cfg, seed=0)
    _check_bert_structure(model, cfg)
    r = roundtrip(model)
    assert r["outputs_equal"] and r["max_abs_err"] <= 1e-5 and r["nodes"] == r["source_nodes"]


def _layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def _erf(x):
    return np.vectorize(math.erf)(x)


def _bert_reference(w: dict[str, np.ndarray], feeds: dict[str, np.ndarray], cfg: BertConfig):
    """HF BertModel.forward in float64 numpy, reading the builder's weights by their HF names."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    ids, mask, types = feeds["input_ids"], feeds["attention_mask"], feeds["token_type_ids"]
    S, nh, d = cfg.seq, cfg.heads, cfg.head_dim
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][types]
    x = x + w["embeddings.position_embeddings.weight"][np.arange(S)][None]
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], cfg.eps)
    ext = (1.0 - mask[:, None, None, :]) * np.finfo(np.float32).min

    def lin(t, name):
        return t @ w[f"{name}.weight"] + w[f"{name}.bias"]

    for i in range(cfg.layers):
        p = f"encoder.layer.{i}"
        heads = [lin(x, f"{p}.attention.self.{n}").reshape(1, S, nh, d).transpose(0, 2, 1, 3)
                 for n in ("query", "key", "value")]
        s = heads[0] @ heads[1].transpose(0, 1, 3, 2) / math.sqrt(d) + ext
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = (s / s.sum(-1, keepdims=True)) @ heads[2]
        ctx = ctx.transpose(0, 2, 1, 3).reshape(1, S, nh * d)
        x = _layer_norm(lin(ctx, f"{p}.attention.output.dense") + x, w[f"{p}.attention.output.LayerNorm.weight"],
                        w[f"{p}.attention.output.LayerNorm.bias"], cfg.eps)
        h = lin(x, f"{p}.intermediate.dense")
        h = h * 0.5 * (1.0 + _erf(h / math.sqrt(2.0)))
        x = _layer_norm(lin(h, f"{p}.output.dense") + x, w[f"{p}.output.LayerNorm.weight"],
                        w[f"{p}.output.LayerNorm.bias"], cfg.eps)
    pooled = np.tanh(x[:, 0] @ w["pooler.dense.weight"].T + w["pooler.dense.bias"])
    return x, pooled


def test_bert_tiny_matches_numpy_bert(built):
    model = built["bert-tiny"]
    _check_bert_structure(model, BERT_TINY)
    feeds = random_inputs(import_onnx(model), seed=1)
    assert feeds["input_ids"].max() >= BERT_TINY.vocab // 2  # ids span the vocabulary ...
    assert feeds["input_ids"].max() < BERT_TINY.vocab and feeds["token_type_ids"].max() <= 1  # ... validly
    assert 0 < feeds["attention_mask"].sum() < BERT_TINY.seq  # some positions masked
    hidden, pooled = run_ort(model, feeds)
    ref_hidden, ref_pooled = _bert_reference(_weights(model), feeds, BERT_TINY)
    np.testing.assert_allclose(hidden, ref_hidden, atol=2e-4)
    np.testing.assert_allclose(pooled, ref_pooled, atol=2e-4)
    assert 0.5 < hidden.std() < 2.0  # LayerNorm output: activations look like a real model's


# ---- CNNs ---------------------------------------------------------------------------------------------
def _torchvision_params(model: onnx.ModelProto) -> int:
    """Parameter count of the unfolded network: conv weights + BN gamma/beta per conv channel + fc."""
    w = _weights(model)
    total = 0
    for n in model.graph.node:
        if n.op_type == "Conv":
            total += w[n.input[1]].size + 2 * w[n.input[1]].shape[0]
        elif n.op_type == "Gemm":
            total += w[n.input[1]].size + w[n.input[2]].size
    return total


@pytest.mark.parametrize("name,params,grouped", [("resnet50", 25_557_032, 0), ("resnext50", 25_028_904, 16)])
def test_resnets_match_torchvision(built, name, params, grouped):
    model = built[name]
    assert _torchvision_params(model) == params  # torchvision.models.resnet50 / resnext50_32x4d
    ops = _ops(model)
    assert ops["Conv"] == 53 and ops["Add"] == 16 and ops["MaxPool"] == 1 and ops["GlobalAveragePool"] == 1
    assert ops["Gemm"] == 1 and "BatchNormalization" not in ops
    groups = [a.i for n in model.graph.node if n.op_type == "Conv" for a in n.attribute if a.name == "group"]
    assert sum(g == 32 for g in groups) == grouped and set(groups) <= {1, 32}
    (out,) = run_ort(model, random_inputs(import_onnx(model)))
    assert out.shape == (1, 1000) and 0.1 < out.std() < 10  # residual stream neither explodes nor vanishes


def test_inception_blocks_share_inputs_across_branches(built):
    model = built["inception-block"]
    ops = _ops(model)
    assert ops["Concat"] == 3 and ops["Conv"] == 18 and ops["MaxPool"] == 4
    consumers: dict[str, int] = {}
    for n in model.graph.node:
        for t in n.input:
            consumers[t] = consumers.get(t, 0) + 1
    # Each block's input feeds four branches: 1x1, 3x3-reduce, 5x5-reduce, pool.
    assert sorted(t for t, c in consumers.items() if c == 4) == sorted(
        ["input", "/inception3a/Concat_output_0", "/maxpool3/MaxPool_output_0"])
    graph = import_onnx(model)
    widths = [graph.shape(n.output[0]) for n in model.graph.node if n.op_type == "Concat"]
    assert widths == [(1, 256, 28, 28), (1, 480, 28, 28), (1, 512, 14, 14)]  # GoogLeNet 3a, 3b, 4a


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_nasrnn_matches_taso_cell(built):
    model = built["nasrnn"]
    w = _weights(model)
    feeds = random_inputs(import_onnx(model), seed=2)
    h = feeds["h0"].astype(np.float64)
    for t in range(5):
        x = feeds[f"x{t}"].astype(np.float64)
        g = [x @ w[f"cell.gate{i}.w_x"] + h @ w[f"cell.gate{i}.w_h"] for i in range(8)]
        m0 = np.maximum(g[0], 0) + _sigmoid(g[3])
        m1 = _sigmoid(g[1]) + np.tanh(g[2])
        m2 = _sigmoid(g[4]) * np.tanh(g[5])
        m3 = _sigmoid(g[6]) * np.maximum(g[7], 0)
        m4 = _sigmoid(m1) + np.tanh(m2)
        m5 = np.tanh(m0) * np.tanh(m3)
        h = np.tanh(np.tanh(m4) * np.tanh(m5))
    (out,) = run_ort(model, feeds)
    np.testing.assert_allclose(out, h, atol=1e-5)
    assert _ops(model)["MatMul"] == 5 * 16


def test_mlp_matches_numpy(built):
    model = built["mlp"]
    w = _weights(model)
    feeds = random_inputs(import_onnx(model), seed=3)
    x = feeds["input"].astype(np.float64)
    for i in range(3):
        x = np.maximum(x @ w[f"layers.{i}.weight"].T + w[f"layers.{i}.bias"], 0)
    ref = x @ w["head.weight"] + w["head.bias"]
    (out,) = run_ort(model, feeds)
    np.testing.assert_allclose(out, ref, atol=1e-4)


# ---- every model round-trips through the IR -----------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in MODELS if n != "bert-base"])
def test_every_model_round_trips(built, name):
    model = built[name]
    r = roundtrip(model)
    assert r["outputs_equal"] and r["max_abs_err"] <= 1e-5 and r["dropped_nodes"] == 0
    assert r["nodes"] == r["source_nodes"] == len(model.graph.node)
    acc = account_nodes(model, import_onnx(model))
    assert acc["dropped_nodes"] == 0 and acc["kept"] == len(model.graph.node)


@pytest.mark.slow
def test_full_bert_base_builds_and_round_trips(tmp_path):
    out = tmp_path / "bert-base.onnx"
    assert models_main(["build", "bert-base", "-o", str(out)]) == 0
    model = onnx.load(str(out))
    _check_bert_structure(model, BERT_BASE)
    r = roundtrip(str(out))
    assert r["outputs_equal"] and r["max_abs_err"] <= 1e-5 and r["nodes"] == r["source_nodes"]
