"""Round trips of models exported by torch itself, with both exporters.

The TorchScript exporter (opset 17) emits Constant and Identity nodes, Shape/Gather chains and dim_param
axes; the dynamo exporter (opset 18) emits value_info for every tensor, node metadata, and its own naming.
For each, import -> export must keep every node (``account_nodes``: 0 dropped) and onnxruntime must give
the same outputs (max abs err <= 1e-5).  The models are tiny so the whole file runs in well under a minute.
"""
from __future__ import annotations

import io
import json
import math
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: these tests need torch.onnx.export "
                                            "(pip install -e .[test])")
from torch import nn  # noqa: E402

from pipeline.cli import graphopt_main  # noqa: E402
from graphopt.errors import UserError  # noqa: E402
from graphopt.onnx_io import account_nodes, export_onnx, import_onnx  # noqa: E402
from graphopt.roundtrip import roundtrip  # noqa: E402

SEQ = 16


class TinyBert(nn.Module):
    """HF BertModel's forward in miniature: embeddings, extended mask, eager attention, Erf GELU, pooler."""

    def __init__(self, vocab: int = 100, hidden: int = 32, heads: int = 4, inter: int = 64, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.word = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(64, hidden)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            q=nn.Linear(hidden, hidden), k=nn.Linear(hidden, hidden), v=nn.Linear(hidden, hidden),
            o=nn.Linear(hidden, hidden), ln1=nn.LayerNorm(hidden, eps=1e-12), f1=nn.Linear(hidden, inter),
            f2=nn.Linear(inter, hidden), ln2=nn.LayerNorm(hidden, eps=1e-12))) for _ in range(layers))
        self.pool = nn.Linear(hidden, hidden)

    def forward(self, input_ids, attention_mask):
        b, s = input_ids.shape
        x = self.ln(self.word(input_ids) + self.pos(torch.arange(s).unsqueeze(0)))
        mask = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
        for layer in self.layers:
            def heads(t):
                return t.view(b, s, self.heads, -1).permute(0, 2, 1, 3)
            q, k, v = heads(layer["q"](x)), heads(layer["k"](x)), heads(layer["v"](x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
            ctx = (torch.softmax(scores, dim=-1) @ v).permute(0, 2, 1, 3).reshape(b, s, -1)
            x = layer["ln1"](x + layer["o"](ctx))
            h = layer["f1"](x)
            h = h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))
            x = layer["ln2"](x + layer["f2"](h))
        return x, torch.tanh(self.pool(x[:, 0]))


class TinyResNet(nn.Module):
    """Conv + BatchNorm + ReLU, a grouped-conv residual block, a strided block with a downsample branch."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.grouped = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(16))
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32))
        self.skip = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32))
        self.fc = nn.Linear(32, 10)
        for m in self.modules():  # non-trivial BN statistics, as after training
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.data.uniform_(0.5, 1.5)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(self.stem(x), 2)
        x = torch.relu(self.grouped(x) + x)
        x = torch.relu(self.down(x) + self.skip(x))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.rnn = cell(8, 16, num_layers=2, batch_first=True)

    def forward(self, x):
        y, state = self.rnn(x)
        return y, state[0] if isinstance(state, tuple) else state


def _make(kind: str, layers: int = 2) -> tuple[nn.Module, tuple, list[str]]:
    torch.manual_seed(0)
    if kind == "bert":
        ids = torch.randint(0, 100, (1, SEQ))
        return TinyBert(layers=layers), (ids, torch.ones(1, SEQ, dtype=torch.int64)), ["input_ids", "attention_mask"]
    if kind == "resnet":
        return TinyResNet(), (torch.randn(1, 3, 16, 16),), ["x"]
    if kind == "lstm":
        return Recurrent(nn.LSTM), (torch.randn(1, 5, 8),), ["x"]
    if kind == "gru":
        return Recurrent(nn.GRU), (torch.randn(1, 5, 8),), ["x"]
    raise ValueError(kind)


def _export(module: nn.Module, args: tuple, names: list[str], exporter: str, **kw) -> onnx.ModelProto:
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            return torch.onnx.export(module, args, input_names=names, dynamo=True, opset_version=18, verbose=False,
                                     **kw).model_proto
        buf = io.BytesIO()
        torch.onnx.export(module, args, buf, input_names=names, dynamo=False, opset_version=17, **kw)
        return onnx.load_from_string(buf.getvalue())


_CACHE: dict[tuple[str, str], onnx.ModelProto] = {}


def _exported(kind: str, exporter: str) -> onnx.ModelProto:
    if (kind, exporter) not in _CACHE:
        module, args, names = _make(kind)
        _CACHE[kind, exporter] = _export(module, args, names, exporter)
    return _CACHE[kind, exporter]


def _assert_lossless(proto: onnx.ModelProto, input_shapes=None) -> dict:
    r = roundtrip(proto, input_shapes)
    assert r["outputs_equal"] and r["max_abs_err"] <= 1e-5 and r["dropped_nodes"] == 0, r
    graph = import_onnx(proto, input_shapes)
    acc = account_nodes(proto, graph)
    assert acc["dropped_nodes"] == 0, acc["dropped"]
    assert acc["kept"] + acc["folded_constants"] + acc["bypassed_identities"] == len(proto.graph.node)
    assert acc["kept"] == len(graph.nodes) == r["nodes"]
    out = export_onnx(graph)
    for a, b in ((proto.graph.input, out.graph.input), (proto.graph.output, out.graph.output)):
        assert [(v.name, v.type.tensor_type.elem_type) for v in a] == [(v.name, v.type.tensor_type.elem_type)
                                                                       for v in b]
    assert {o.domain: o.version for o in out.opset_import} == {o.domain: o.version for o in proto.opset_import}
    return {**r, **acc}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", ["bert", "resnet", "lstm", "gru"])
def test_torch_export_round_trips(kind, exporter):
    proto = _exported(kind, exporter)
    assert proto.opset_import[0].version == (18 if exporter == "dynamo" else 17)
    result = _assert_lossless(proto)
    ops = {n.op_type for n in proto.graph.node}
    expected = {"bert": {"Gather", "LayerNormalization", "Erf", "Softmax", "MatMul"}, "resnet": {"Conv", "Gemm"},
                "lstm": {"LSTM"}, "gru": {"GRU"}}[kind]
    assert expected <= ops
    if kind == "resnet":  # grouped conv survives the round trip with its group attribute
        groups = [a.i for n in proto.graph.node if n.op_type == "Conv" for a in n.attribute if a.name == "group"]
        assert 4 in groups
    if exporter == "torchscript" and kind in ("bert", "lstm"):
        assert result["folded_constants"] > 0  # the TorchScript quirk import must handle is really there


def test_torchscript_transformer_encoder_layer_with_padding_mask():
    """torch's own TransformerEncoderLayer: Where/Equal/ConstantOfShape chains from the bool padding mask."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, activation="gelu")
    pad = torch.zeros(1, 8, dtype=torch.bool)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, pad):
            return self.layer(x, src_key_padding_mask=pad)

    proto = _export(Encoder(), (torch.randn(1, 8, 32), pad), ["x", "pad"], "torchscript")
    assert {"Where", "Erf", "LayerNormalization"} <= {n.op_type for n in proto.graph.node}
    _assert_lossless(proto)


def test_torchscript_local_functions_are_kept():
    module, args, names = _make("bert")
    proto = _export(module, args, names, "torchscript", export_modules_as_functions={nn.LayerNorm, nn.Linear})
    assert proto.functions
    _assert_lossless(proto)
    out = export_onnx(import_onnx(proto))
    assert [(f.domain, f.name) for f in out.functions] == [(f.domain, f.name) for f in proto.functions]


def test_dynamo_unoptimized_export_with_metadata():
    """optimize=False keeps the raw translation: many more nodes, metadata_props, full value_info."""
    module, args, names = _make("bert", layers=1)  # dynamo exports are slow: one layer is enough here
    proto = _export(module, args, names, "dynamo", optimize=False)
    assert proto.graph.value_info and any(n.metadata_props for n in proto.graph.node)
    assert len(proto.graph.node) > len(_exported("bert", "dynamo").graph.node) / 2
    _assert_lossless(proto)


def _dynamic_batch(exporter: str) -> onnx.ModelProto:
    module, (ids, mask), names = _make("bert", layers=1)
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
    if exporter == "dynamo":
        batch = torch.export.Dim("batch", min=1, max=64)
        return _export(module, (ids, mask), names, "dynamo", dynamic_shapes=({0: batch}, {0: batch}))
    axes = {n: {0: "batch"} for n in names}
    return _export(module, (ids, mask), names, "torchscript", dynamic_axes=axes)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_dynamic_batch_needs_and_accepts_input_shapes(exporter, tmp_path, capsys):
    proto = _dynamic_batch(exporter)
    dims = [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims[0] and dims[1] == ""  # batch is symbolic, sequence fixed
    with pytest.raises(UserError, match=r"inputs have symbolic dimensions: input_ids \[(\w+), \d+\], "
                                        r"attention_mask \[\1, \d+\]: fix them with --dim \1=N$"):
        import_onnx(proto)
    shapes = {"input_ids": (3, SEQ), "attention_mask": (3, SEQ)}
    result = _assert_lossless(proto, shapes)
    graph = import_onnx(proto, shapes)
    assert graph.inputs[0].shape == (3, SEQ) and graph.outputs[0].shape == (3, SEQ, 32)

    path = tmp_path / "dyn.onnx"
    onnx.save(proto, str(path))
    assert graphopt_main(["roundtrip", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "input_ids" in err and "attention_mask" in err and "--dim" in err
    out = tmp_path / "r.json"
    assert graphopt_main(["roundtrip", str(path), "--input-shape", f"input_ids=3,{SEQ}",
                          "--input-shape", f"attention_mask=3,{SEQ}", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["outputs_equal"] and written["nodes"] == result["nodes"]
    assert json.loads(capsys.readouterr().out) == written


def test_wrong_rank_and_unknown_input_name_are_user_errors():
    proto = _dynamic_batch("torchscript")
    with pytest.raises(UserError, match="rank 2"):
        import_onnx(proto, {"input_ids": (3,), "attention_mask": (3, SEQ)})
    with pytest.raises(UserError, match="input_ids"):
        import_onnx(proto, {"token_ids": (3, SEQ)})


def test_torch_and_onnxruntime_agree_after_round_trip():
    """The re-exported model computes what the torch module computes (not just what the export did)."""
    module, args, names = _make("bert")
    proto = export_onnx(import_onnx(_exported("bert", "dynamo")))
    from graphopt.feeds import run_ort

    feeds = {n: a.numpy() for n, a in zip(names, args)}
    with torch.no_grad():
        expected = [t.numpy() for t in module.eval()(*args)]
    for got, want in zip(run_ort(proto, feeds), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
