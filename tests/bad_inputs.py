"""The bad-input corpus: models and option values a careless user passes, each with what must happen.

Every case builds its files (models made with ``onnx.helper``) in a fresh folder and runs one command:
``optimize-model``, ``bench-model``, ``graphopt``, ``tune-kernels`` or ``python -m models``.  The contract
(developers' guide; issue 17): exit 0 with a checked, correct artifact, or exit 2 with exactly one stderr
line naming the problem and the fix.  An outcome is

* ``clean``: what the case expects (a one-line refusal containing the case's words, or a success whose
  artifact :func:`verify` finds correct - recomputed here with TVM and onnxruntime, not read from our report);
* ``internal``: an ``error: internal ...`` line, a traceback, another exit code, or more than one line;
* ``hang``: still running at the case's time limit;
* ``signal``: killed by a signal (exit code -N, or 128+N from a shell): SIGFPE, SIGSEGV, SIGBUS;
* ``wrong success``: exit 0 where the input had to be refused, or an artifact that is wrong;
* ``unexpected``: a clean refusal of a case that should have gone through, or one missing the words.

Cases run in-process (the ``cli_entry``-wrapped main functions; fast, for refusals that happen before TVM
loads) or as real subprocesses of the console scripts (``subprocess`` is the user's view: a representative
set in CI, all of them in ``bench/reliability.py``).  Used by ``tests/test_reliability.py`` and
``bench/reliability.py``.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
BERT_TINY = ROOT / "models" / "bert_tiny.onnx"
ENTRY = {"optimize-model": "optimize_model_main", "bench-model": "bench_model_main", "graphopt": "graphopt_main",
         "tune-kernels": "tune_kernels_main"}
F = T.FLOAT


# ---- model builders ----------------------------------------------------------------------------------------

def vi(name: str, shape, dtype: int = F) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, dtype, shape)


def model(nodes, inputs, outputs, inits=(), opset: int = 17, ir: int = 10, domains=()) -> onnx.ModelProto:
    g = h.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)] + [h.make_opsetid(d, 1) for d in domains])
    m.ir_version = ir  # onnxruntime 1.31 reads IR <= 13; the pinned onnx writes 14 by default
    return m


def init(name: str, arr) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def save(m: onnx.ModelProto, d: Path, name: str = "m.onnx") -> str:
    p = d / name
    p.write_bytes(m.SerializeToString())
    return str(p)


def relu(shape=(2, 3)) -> onnx.ModelProto:
    return model([h.make_node("Relu", ["x"], ["y"])], [vi("x", list(shape))], [vi("y", list(shape))])


def dynamic_relu() -> onnx.ModelProto:
    return model([h.make_node("Relu", ["x"], ["y"])], [vi("x", ["N", 8])], [vi("y", ["N", 8])])


def unary_of_log(op: str, **attrs) -> onnx.ModelProto:
    """``op(Log(x))``: Log of the negative half of the random inputs is NaN, and ``op`` is one whose kernels
    may drop a NaN (max/min-based) - the probe issue 17 found reported as "max abs err 0"."""
    extra, inits = [], []
    if op in ("Max", "Min"):
        extra, inits = ["zero"], [init("zero", np.zeros((), np.float32))]
    if op == "Clip":
        extra, inits = ["lo", "hi"], [init("lo", np.float32(0)), init("hi", np.float32(1))]
    out = [4] if op == "ReduceMax" else [4, 8]
    nodes = [h.make_node("Log", ["x"], ["l"]), h.make_node(op, ["l", *extra], ["y"], **attrs)]
    return model(nodes, [vi("x", [4, 8])], [vi("y", out)], inits)


def named_dims_add() -> onnx.ModelProto:
    """``x + m``, both [batch, seq]: two inputs sharing two named symbolic dimensions (``--dim``, issue 41)."""
    return model([h.make_node("Add", ["x", "m"], ["y"])], [vi("x", ["batch", "seq"]), vi("m", ["batch", "seq"])],
                 [vi("y", ["batch", "seq"])])


def lstm(seq="S") -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w, r, b = (rng.standard_normal(s).astype(np.float32) * 0.3 for s in ([1, 16, 4], [1, 16, 4], [1, 32]))
    node = h.make_node("LSTM", ["x", "w", "r", "b"], ["y"], hidden_size=4)
    return model([node], [vi("x", [seq, 1, 4])], [vi("y", [seq, 1, 1, 4])],
                 [init("w", w), init("r", r), init("b", b)])


def gather_ids() -> onnx.ModelProto:
    table = np.random.default_rng(1).standard_normal((50, 4)).astype(np.float32)
    return model([h.make_node("Gather", ["table", "ids"], ["e"]), h.make_node("Relu", ["e"], ["y"])],
                 [vi("ids", [1, 8], T.INT64)], [vi("y", [1, 8, 4])], [init("table", table)])


def fp16_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    w, b = rng.standard_normal((16, 8)).astype(np.float16) * 0.25, rng.standard_normal(8).astype(np.float16)
    nodes = [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Add", ["m", "b"], ["a"]),
             h.make_node("Relu", ["a"], ["y"])]
    return model(nodes, [vi("x", [4, 16], T.FLOAT16)], [vi("y", [4, 8], T.FLOAT16)], [init("w", w), init("b", b)])


def big_logits() -> onnx.ModelProto:
    """A classifier head whose logits reach ~800 (Inception-v3's do): an absolute 1e-4 rejects a correct
    build of it; the scale-aware check must not."""
    w = np.random.default_rng(3).standard_normal((64, 10)).astype(np.float32) * 60.0
    return model([h.make_node("MatMul", ["x", "w"], ["y"])], [vi("x", [2, 64])], [vi("y", [2, 10])], [init("w", w)])


def control_input() -> onnx.ModelProto:
    """A sample-rate input that selects the branch: random values exercise the wrong one (issue 13 item 5)."""
    nodes = [h.make_node("Equal", ["sr", "k16"], ["is16"]), h.make_node("Mul", ["x", "two"], ["a"]),
             h.make_node("Mul", ["x", "three"], ["b"]), h.make_node("Where", ["is16", "a", "b"], ["y"])]
    return model(nodes, [vi("x", [1, 8]), vi("sr", [1], T.INT64)], [vi("y", [1, 8])],
                 [init("k16", np.array([16000], np.int64)), init("two", np.float32(2)), init("three", np.float32(3))])


def reshape_by_input() -> onnx.ModelProto:
    """The target shape is an input: random integers (0 or 1) are no valid shape, so only --inputs works."""
    return model([h.make_node("Reshape", ["x", "s"], ["y"])], [vi("x", [2, 4]), vi("s", [2], T.INT64)],
                 [vi("y", ["a", "b"])])


def pads_from_sample_rate() -> onnx.ModelProto:
    """Silero VAD's front end: the audio padded by ``sr // 250`` samples, so the shapes depend on the value of an
    int64 scalar input (issue 25); the build needs that value (graphopt.specialize)."""
    nodes = [h.make_node("Div", ["sr", "k250"], ["ctx"]), h.make_node("Unsqueeze", ["ctx", "zero"], ["ctx1"]),
             h.make_node("Concat", ["zeros3", "ctx1"], ["pads"], axis=0),
             h.make_node("Pad", ["x", "pads"], ["y"], name="pad", mode="reflect")]
    return model(nodes, [vi("x", [1, 200]), vi("sr", [], T.INT64)], [vi("y", [1, None])],
                 [init("k250", np.array(250, np.int64)), init("zero", np.array([0], np.int64)),
                  init("zeros3", np.zeros(3, np.int64))])


def opset9_weights_as_inputs() -> onnx.ModelProto:
    w = np.random.default_rng(4).standard_normal((3, 5)).astype(np.float32)
    nodes = [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Relu", ["m"], ["y"])]
    return model(nodes, [vi("x", [2, 3]), vi("w", [3, 5])], [vi("y", [2, 5])], [init("w", w)], opset=9, ir=4)


def npz(d: Path, name: str = "in.npz", **arrays) -> str:
    p = d / name
    np.savez(p, **arrays)
    return str(p)


def zeros_npz(d: Path, member: str, shape: tuple[int, ...], name: str = "bomb.npz") -> str:
    """An .npz holding a compressed all-zero float32 array of ``shape``, written in 4 MB blocks: a 1 GB
    array makes a ~1 MB file without ever being in memory (the size bomb a reader must refuse from the header)."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False, "shape": shape}
    left, block = 4 * int(np.prod(shape)), bytes(1 << 22)
    with zipfile.ZipFile(d / name, "w", zipfile.ZIP_DEFLATED) as z, \
            z.open(member + ".npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, header)
        while left:
            f.write(block[:min(left, len(block))])
            left -= min(left, len(block))
    return str(d / name)


# ---- the cases ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One bad (or edge-case) input and what must happen."""

    name: str
    category: str
    command: str  # a console script name, or "models" (python -m models)
    make: Callable[[Path], list[str]]  # writes its files into the folder, returns the command's arguments
    expect: str = "refuse"  # "refuse" | "ok" | "either" (a clean refusal or a verified success)
    words: tuple[str, ...] = ()  # the refusal line must contain each (case-insensitive)
    before_tvm: bool = True  # refused before TVM loads: cheap to run in-process
    needs_unshare: str = ""  # a mount (shell command run in a private mount namespace) the case needs
    timeout: float = 120.0


def _out(d: Path) -> str:
    return str(d / "out")


def _opt(m: Callable[[], onnx.ModelProto], *extra: str) -> Callable[[Path], list[str]]:
    return lambda d: [save(m(), d), "-o", _out(d), "--skip-graph", "--no-progress", *extra]


def _file(m: Callable[[], onnx.ModelProto], *extra: str) -> Callable[[Path], list[str]]:
    return lambda d: [save(m(), d), *extra]


def _rt(m: Callable[[], onnx.ModelProto], *extra: str) -> Callable[[Path], list[str]]:
    return lambda d: ["roundtrip", save(m(), d), *extra]


def _gopt(m: Callable[[], onnx.ModelProto], *extra: str) -> Callable[[Path], list[str]]:
    return lambda d: ["optimize", save(m(), d), "-o", str(d / "opt.onnx"), "--cost", "analytic", "--no-progress",
                      *extra]


def _list(m: Callable[[], onnx.ModelProto], *extra: str) -> Callable[[Path], list[str]]:
    return lambda d: [save(m(), d), "--list", *extra]


def _bench(m: Callable[[], onnx.ModelProto], *extra: str) -> Callable[[Path], list[str]]:
    return lambda d: [save(m(), d), "--runs", "2", "--skip-graph", "--no-progress", *extra]


def _truncated(d: Path) -> str:
    p = d / "truncated.onnx"
    p.write_bytes(BERT_TINY.read_bytes()[: BERT_TINY.stat().st_size // 3])
    return str(p)


def _text_file(d: Path) -> str:
    p = d / "notes.onnx"
    p.write_text("this is not a protobuf\n" * 20)
    return str(p)


def _empty_file(d: Path) -> str:
    p = d / "empty.onnx"
    p.write_bytes(b"")
    return str(p)


def _fifo(d: Path) -> str:
    os.mkfifo(d / "pipe.onnx")
    return str(d / "pipe.onnx")


def _sparse(d: Path) -> str:
    """A 1 TB file that takes no disk space (a hole): the size bomb a careless copy can leave."""
    with open(d / "huge.onnx", "wb") as f:
        f.truncate(10**12)
    return str(d / "huge.onnx")


def _external_missing(d: Path) -> str:
    m = model([h.make_node("Add", ["x", "w"], ["y"])], [vi("x", [64, 64])], [vi("y", [64, 64])],
              [init("w", np.ones((64, 64), np.float32))])
    onnx.save(m, str(d / "ext.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=0)
    (d / "weights.bin").unlink()
    return str(d / "ext.onnx")


def _external_traversal(d: Path) -> str:
    m = model([h.make_node("Add", ["x", "w"], ["y"])], [vi("x", [4])], [vi("y", [4])], [init("w", np.ones(4, np.float32))])
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = T.EXTERNAL
    t.external_data.add(key="location", value="../../../../etc/passwd")
    sub = d / "m"
    sub.mkdir()
    return save(m, sub)


def _truncated_weight() -> onnx.TensorProto:
    w = init("w", np.ones((2, 3), np.float32))
    w.raw_data = w.raw_data[:8]  # 2 of its 6 floats
    return w


def _structural() -> list[Case]:
    x, y = vi("x", [2, 3]), vi("y", [2, 3])
    add = lambda a, b, o: h.make_node("Add", [a, b], [o])  # noqa: E731
    models = {
        "no-outputs": (lambda: model([h.make_node("Relu", ["x"], ["y"])], [x], []), ("no graph outputs",)),
        "cycle": (lambda: model([add("x", "b", "a"), h.make_node("Relu", ["a"], ["b"]), h.make_node("Relu", ["a"], ["y"])],
                                [x], [y]), ("cycle",)),
        "dangling-input": (lambda: model([add("x", "nowhere", "y")], [x], [y]), ("'nowhere'", "no node")),
        "missing-initializer": (lambda: model([h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Relu", ["m"], ["y"])],
                                              [x], [vi("y", [2, 4])]), ("'w'", "missing initializer")),
        "dangling-output": (lambda: model([h.make_node("Relu", ["x"], ["y"])], [x], [y, vi("q", [2, 3])]),
                            ("graph output 'q'",)),
        "unsorted-nodes": (lambda: model([h.make_node("Relu", ["a"], ["y"]), h.make_node("Relu", ["x"], ["a"])], [x], [y]),
                           ("topological order",)),
        "two-writers": (lambda: model([h.make_node("Relu", ["x"], ["y"]), h.make_node("Neg", ["x"], ["y"])], [x], [y]),
                        ("two nodes",)),
        "writes-an-input": (lambda: model([h.make_node("Relu", ["y"], ["x"]), h.make_node("Relu", ["x"], ["y"])],
                                          [x, vi("y0", [2, 3])], [y]), ("already a graph input",)),
        "opset-30": (lambda: model([h.make_node("Relu", ["x"], ["y"])], [x], [y], opset=30), ("opset 30",)),
        "opset-27": (lambda: model([h.make_node("Relu", ["x"], ["y"])], [x], [y], opset=27), ("opset 27", "onnxruntime")),
        "ir-version-14": (lambda: model([h.make_node("Relu", ["x"], ["y"])], [x], [y], ir=14), ("ir version 14",)),
        "ir-version-99": (lambda: model([h.make_node("Relu", ["x"], ["y"])], [x], [y], ir=99), ("ir version 99",)),
        "custom-domain-op": (lambda: model([h.make_node("Foo", ["x"], ["y"], domain="my.ops")], [x], [y],
                                           domains=["my.ops"]), ("Foo", "my.ops")),
        "unknown-onnx-op": (lambda: model([h.make_node("Fooo", ["x"], ["y"])], [x], [y]), ("Fooo",)),
        "type-mismatch": (lambda: model([add("x", "i", "y")], [x, vi("i", [2, 3], T.INT64)], [y]), ("onnx.checker",)),
        "bad-attribute": (lambda: model([h.make_node("Softmax", ["x"], ["y"], axis=5)], [x], [y]), ("axis",)),
        "matmul-shapes": (lambda: model([h.make_node("MatMul", ["x", "z"], ["y"])], [x, vi("z", [4, 5])], [vi("y", [2, 5])]),
                          ("onnx.checker",)),
        "duplicate-input-names": (lambda: model([add("x", "x", "y")], [x, vi("x", [2, 3])], [y]), ("'x'",)),
        "duplicate-outputs": (lambda: model([h.make_node("Relu", ["x"], ["y"])], [x], [y, y]), ("'y'", "twice")),
        "duplicate-initializers": (lambda: model([add("x", "w", "y")], [x], [y], [init("w", np.ones((2, 3), np.float32)),
                                                                             init("w", np.ones((2, 3), np.float32))]),
                                   ("not unique",)),
        "truncated-weight": (lambda: model([add("x", "w", "y")], [x], [y], [_truncated_weight()]), ("raw_data",)),
        "bfloat16": (lambda: model([h.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 3], T.BFLOAT16)],
                                   [vi("y", [2, 3], T.BFLOAT16)]), ("bfloat16", "not supported")),
        "complex64": (lambda: model([h.make_node("Identity", ["x"], ["y"])], [vi("x", [2], T.COMPLEX64)],
                                    [vi("y", [2], T.COMPLEX64)]), ("complex64", "not supported")),
        "string-input": (lambda: model([h.make_node("Identity", ["x"], ["y"])], [vi("x", [2], T.STRING)],
                                       [vi("y", [2], T.STRING)]), ("string", "not supported")),
        "sequence-input": (lambda: model([h.make_node("SequenceLength", ["s"], ["y"])],
                                         [h.make_tensor_sequence_value_info("s", F, [2])], [vi("y", [], T.INT64)]),
                           ("not a tensor",)),
        "matmul-1e6": (lambda: model([h.make_node("MatMul", ["a", "b"], ["y"])], [vi("a", [10**6, 10**6]),
                                     vi("b", [10**6, 10**6])], [vi("y", [10**6, 10**6])]), ("memory",)),
        "expand-130GB": (lambda: model([h.make_node("Expand", ["x", "s"], ["y"])], [vi("x", [1])], [vi("y", [32_500_000_000])],
                                       [init("s", np.array([32_500_000_000], np.int64))]), ("memory", "'y'")),
        "constantofshape-4TB": (lambda: model([h.make_node("ConstantOfShape", ["s"], ["c"]), h.make_node("Add", ["c", "x"], ["y"])],
                                              [vi("x", [1])], [vi("y", [100000, 100000, 100])],
                                              [init("s", np.array([100000, 100000, 100], np.int64))]), ("memory",)),
    }
    opt, tune, gopt, bench = "optimize-model", "tune-kernels", "graphopt", "bench-model"
    commands = {  # each fault through one command (the validation is shared; the corpus spreads them)
        "no-outputs": opt, "cycle": tune, "dangling-input": gopt, "missing-initializer": bench,
        "dangling-output": opt, "unsorted-nodes": tune, "two-writers": gopt, "writes-an-input": bench,
        "opset-30": opt, "opset-27": tune, "ir-version-14": gopt, "ir-version-99": bench, "custom-domain-op": opt,
        "unknown-onnx-op": tune, "type-mismatch": gopt, "bad-attribute": bench, "matmul-shapes": opt,
        "duplicate-input-names": opt, "duplicate-outputs": opt, "duplicate-initializers": tune,
        "truncated-weight": bench, "bfloat16": tune,
        "complex64": gopt, "string-input": bench, "sequence-input": opt, "matmul-1e6": tune, "expand-130GB": gopt,
        "constantofshape-4TB": bench,
    }
    cases = []
    for name, (make, words) in models.items():
        cmd = commands[name]
        wrap = {"optimize-model": _opt, "tune-kernels": _list, "graphopt": _rt, "bench-model": _bench}[cmd]
        cases.append(Case(f"{name}/{cmd}", "invalid model", cmd, wrap(make), words=words))
    # the three wrong successes of `tune-kernels --list` in issue 17, whatever the rotation gave them
    for name in ("no-outputs", "two-writers", "opset-30"):
        if not any(c.name == f"{name}/tune-kernels" for c in cases):
            cases.append(Case(f"{name}/tune-kernels", "invalid model", "tune-kernels", _list(models[name][0]),
                              words=models[name][1]))
    return cases


def _files() -> list[Case]:
    return [
        Case("missing-file/optimize-model", "file", "optimize-model", lambda d: [str(d / "nope.onnx"), "-o", _out(d)],
             words=("does not exist",)),
        Case("missing-file/graphopt", "file", "graphopt", lambda d: ["roundtrip", str(d / "nope.onnx")],
             words=("does not exist",)),
        Case("directory-as-model/bench-model", "file", "bench-model", lambda d: [str(d)], words=("directory",)),
        Case("text-file/optimize-model", "file", "optimize-model", lambda d: [_text_file(d), "-o", _out(d)],
             words=("not a readable onnx",)),
        Case("truncated/tune-kernels", "file", "tune-kernels", lambda d: [_truncated(d), "--list"],
             words=("truncated.onnx",)),
        Case("empty-file/graphopt", "file", "graphopt", lambda d: ["roundtrip", _empty_file(d)], words=("empty.onnx",)),
        Case("dev-zero/optimize-model", "file", "optimize-model", lambda d: ["/dev/zero", "-o", _out(d)],
             words=("not a regular file",), timeout=30),
        Case("fifo/graphopt", "file", "graphopt", lambda d: ["roundtrip", _fifo(d)], words=("not a regular file",),
             timeout=30),
        Case("sparse-1TB-file/tune-kernels", "file", "tune-kernels", lambda d: [_sparse(d), "--list"], words=("memory",),
             timeout=30),
        Case("external-data-missing/optimize-model", "file", "optimize-model",
             lambda d: [_external_missing(d), "-o", _out(d)], words=("weights.bin",)),
        Case("external-data-traversal/graphopt", "file", "graphopt", lambda d: ["roundtrip", _external_traversal(d)],
             words=("m.onnx",)),
    ]


def _shapes() -> list[Case]:
    dyn = _file(dynamic_relu)
    return [
        Case("dynamic-without-shape/optimize-model", "input shape", "optimize-model", _opt(dynamic_relu),
             words=("symbolic dimensions", "x [N, 8]", "--dim N=N")),
        Case("shape-negative/optimize-model", "input shape", "optimize-model", _opt(dynamic_relu, "--input-shape", "x=-1,8"),
             words=("not positive",)),
        Case("shape-2^63/bench-model", "input shape", "bench-model", lambda d: dyn(d) + ["--input-shape", f"x={2**63},8"],
             words=("too large",)),
        Case("shape-huge/optimize-model", "input shape", "optimize-model",
             _opt(dynamic_relu, "--input-shape", "x=99999999999,8"), words=("memory",)),
        Case("shape-huge/tune-kernels", "input shape", "tune-kernels",
             _list(dynamic_relu, "--input-shape", "x=99999999999,8"), words=("memory",)),
        Case("shape-conflict/graphopt", "input shape", "graphopt",
             _rt(dynamic_relu, "--input-shape", "x=1,8", "--input-shape", "x=2,8"), words=("two shapes",)),
        Case("shape-overrides-static/optimize-model", "input shape", "optimize-model",
             _opt(relu, "--input-shape", "x=4,3"), words=("fixed at 2",)),
        Case("shape-wrong-rank/graphopt", "input shape", "graphopt", _gopt(dynamic_relu, "--input-shape", "x=1,8,1"),
             words=("rank",)),
        Case("shape-unknown-input/bench-model", "input shape", "bench-model",
             lambda d: dyn(d) + ["--input-shape", "nope=1,8"], words=("'nope'", "not a model input")),
        Case("shape-bad-syntax/tune-kernels", "input shape", "tune-kernels", _list(dynamic_relu, "--input-shape", "x:1,8"),
             words=("bad --input-shape",)),
        Case("shape-incompatible/bench-model", "input shape", "bench-model",
             lambda d: [save(model([h.make_node("Reshape", ["x", "s"], ["y"])], [vi("x", ["N", 3])], [vi("y", ["M", 4])],
                                   [init("s", np.array([-1, 4], np.int64))]), d), "--input-shape", "x=3,3"],
             words=("input sizes x=3,3",)),
        Case("shape-of-a-weight/graphopt", "input shape", "graphopt",
             _rt(opset9_weights_as_inputs, "--input-shape", "w=3,5"), words=("weight",)),
        Case("lstm-1e5-steps/optimize-model", "input shape", "optimize-model",
             _opt(lstm, "--input-shape", "x=100000,1,4"), words=("time steps",), before_tvm=False),
        Case("dims-all-unresolved/optimize-model", "input shape", "optimize-model", _opt(named_dims_add),
             words=("inputs have symbolic dimensions: x [batch, seq], m [batch, seq]", "--dim batch=N --dim seq=N")),
        Case("dim-range/bench-model", "input shape", "bench-model", _file(named_dims_add, "--dim", "seq=2:512"),
             words=("a range is for optimize-model", "--dim seq=512")),
        Case("dim-range-top-past-input/optimize-model", "input shape", "optimize-model",
             _opt(named_dims_add, "--dim", "batch=1,seq=2:16", "--input-shape", "x=1,17"),
             words=("outside --dim seq=2:16",)),
        Case("dim-unknown-name/bench-model", "input shape", "bench-model", _file(named_dims_add, "--dim", "sequence=8"),
             words=("'sequence'", "batch, seq")),
        Case("dim-zero/graphopt", "input shape", "graphopt", _rt(named_dims_add, "--dim", "batch=1,seq=0"),
             words=("--dim seq=0", "not positive")),
        Case("dim-not-integer/tune-kernels", "input shape", "tune-kernels", _list(named_dims_add, "--dim", "seq=1.5"),
             words=("whole number",)),
        Case("dim-disagrees-with-shape/optimize-model", "input shape", "optimize-model",
             _opt(named_dims_add, "--dim", "batch=1", "--dim", "seq=8", "--input-shape", "m=1,9"),
             words=("--input-shape m=1,9", "seq=9", "--dim seq=8")),
        Case("dim-partly-resolved/graphopt", "input shape", "graphopt", _rt(named_dims_add, "--dim", "batch=2"),
             words=("x [2, seq], m [2, seq]", "--dim seq=N")),
        Case("dims-fix-every-input/graphopt", "input shape", "graphopt",
             _rt(named_dims_add, "--dim", "batch=2", "--dim", "seq=3"), expect="ok"),
        Case("dims-fix-every-input/optimize-model", "input shape", "optimize-model",
             _opt(named_dims_add, "--dim", "batch=2,seq=3"), expect="ok", before_tvm=False),
        Case("op-shape-huge/tune-kernels", "input shape", "tune-kernels",
             lambda d: ["--op", "matmul", "--shape", "99999999999,8,8", "--trials", "1"], words=("memory",)),
        Case("op-conv-kernel-too-big/tune-kernels", "input shape", "tune-kernels",
             lambda d: ["--op", "conv2d", "--shape", "1,3,4,4,8,7,7", "--trials", "1"], words=("larger than",)),
        Case("op-conv-groups/tune-kernels", "input shape", "tune-kernels",
             lambda d: ["--op", "conv2d", "--shape", "1,3,8,8,8,3,3", "--groups", "2", "--trials", "1"],
             words=("--groups 2",)),
    ]


def _options() -> list[Case]:
    tiny = str(BERT_TINY)
    return [
        Case("target-cuda-sm_foo/optimize-model", "option", "optimize-model",
             lambda d: [tiny, "-o", _out(d), "--target", "cuda:sm_foo"], words=("sm_foo",)),
        Case("target-unknown/bench-model", "option", "bench-model", lambda d: [tiny, "--target", "vulkan"],
             words=("unknown target",)),
        Case("target-llvm-arch/graphopt", "option", "graphopt",
             lambda d: ["optimize", tiny, "-o", str(d / "o.onnx"), "--target", "llvm:znver4"], words=("llvm",)),
        Case("threads-0/optimize-model", "option", "optimize-model", lambda d: [tiny, "-o", _out(d), "--threads", "0"],
             words=("--threads 0",)),
        Case("threads-huge/bench-model", "option", "bench-model", lambda d: [tiny, "--threads", "100000"],
             words=("--threads 100000",)),
        Case("threads-huge/graphopt", "option", "graphopt",
             lambda d: ["optimize", tiny, "-o", str(d / "o.onnx"), "--threads", "100000"], words=("--threads",)),
        Case("trials-negative/optimize-model", "option", "optimize-model", lambda d: [tiny, "-o", _out(d), "--trials", "-1"],
             words=("--trials -1",)),
        Case("runs-0/bench-model", "option", "bench-model", lambda d: [tiny, "--runs", "0"], words=("--runs 0",)),
        Case("scheduler-unknown/optimize-model", "option", "optimize-model",
             lambda d: [tiny, "-o", _out(d), "--scheduler", "fifo"], words=("scheduler",)),
        Case("searcher-unknown/bench-model", "option", "bench-model", lambda d: [tiny, "--searcher", "anneal"],
             words=("searcher",)),
        Case("unknown-option/optimize-model", "option", "optimize-model", lambda d: [tiny, "-o", _out(d), "--fast"],
             words=("--fast",)),
        Case("layout-unknown/optimize-model", "option", "optimize-model",
             lambda d: [tiny, "-o", _out(d), "--layout", "nhwc"], words=("--layout",)),
        Case("layout-unknown/bench-model", "option", "bench-model", lambda d: [tiny, "--layout", "NCHWc"],
             words=("--layout",)),
        Case("seed-not-int/graphopt", "option", "graphopt", lambda d: ["roundtrip", tiny, "--seed", "abc"],
             words=("--seed",)),
        Case("seed-negative/optimize-model", "option", "optimize-model", lambda d: [tiny, "-o", _out(d), "--seed", "-1"],
             words=("--seed",)),
        Case("seed-negative/graphopt", "option", "graphopt", lambda d: ["roundtrip", tiny, "--seed", "-1"],
             words=("--seed",)),
        Case("seed-negative/tune-kernels", "option", "tune-kernels",
             lambda d: ["--op", "matmul", "--shape", "8,8,8", "--trials", "1", "--seed", "-1"], words=("--seed",)),
        Case("seed-negative/models", "option", "models", lambda d: ["build", "mlp", "-o", str(d / "m.onnx"), "--seed", "-1"],
             words=("--seed",)),
        Case("no-subcommand/graphopt", "option", "graphopt", lambda d: [], words=("command",)),
        Case("missing-o/graphopt", "option", "graphopt", lambda d: ["optimize", tiny], words=("-o",)),
        Case("alpha-nan/graphopt", "option", "graphopt",
             lambda d: ["optimize", tiny, "-o", str(d / "o.onnx"), "--alpha", "nan"], words=("--alpha",)),
        Case("time-limit-0/graphopt", "option", "graphopt",
             lambda d: ["optimize", tiny, "-o", str(d / "o.onnx"), "--time-limit", "0"], words=("--time-limit",)),
        Case("models-no-subcommand/models", "option", "models", lambda d: [], words=("command",)),
        Case("models-bad-name/models", "option", "models", lambda d: ["build", "bert-huge", "-o", str(d / "m.onnx")],
             words=("bert-huge",)),
        Case("models-missing-o/models", "option", "models", lambda d: ["build", "mlp"], words=("-o",)),
        Case("tune-model-without-list/tune-kernels", "option", "tune-kernels", lambda d: [tiny], words=("--list",)),
    ]


def _a_file(d: Path) -> str:
    (d / "a-file").write_text("x")
    return str(d / "a-file")


def _default_out_taken(d: Path, model: str) -> list[str]:
    """No -o, and a file where the default folder (MODEL.optimized in the current folder, ``d``) would go."""
    (d / (Path(model).stem + ".optimized")).write_text("x")
    return [model]


def _outputs() -> list[Case]:
    tiny = str(BERT_TINY)
    ro = "mkdir -p {d}/ro && mount -t tmpfs -o size=1m,ro tmpfs {d}/ro"
    small = "mkdir -p {d}/full && mount -t tmpfs -o size=64k tmpfs {d}/full"
    return [
        Case("o-is-a-file/optimize-model", "output path", "optimize-model", lambda d: [tiny, "-o", _a_file(d)],
             words=("is a file",)),
        Case("default-o-is-a-file/optimize-model", "output path", "optimize-model",
             lambda d: _default_out_taken(d, tiny), words=("bert_tiny.optimized", "is a file")),
        Case("o-under-proc/optimize-model", "output path", "optimize-model", lambda d: [tiny, "-o", "/proc/self/out"],
             words=("/proc",)),
        Case("o-read-only/optimize-model", "output path", "optimize-model", lambda d: [tiny, "-o", str(d / "ro" / "out")],
             words=("cannot write",), needs_unshare=ro),
        Case("o-disk-full/optimize-model", "output path", "optimize-model", lambda d: [tiny, "-o", str(d / "full" / "out")],
             words=("no space left on",), needs_unshare=small),
        Case("records-is-a-dir/optimize-model", "output path", "optimize-model",
             lambda d: [tiny, "-o", _out(d), "--trials", "2", "--records", str(d)], words=("--records", "folder")),
        Case("records-is-a-dir/tune-kernels", "output path", "tune-kernels",
             lambda d: ["--op", "matmul", "--shape", "8,8,8", "--trials", "1", "--records", str(d)], words=("--records",)),
        Case("json-under-proc/bench-model", "output path", "bench-model", lambda d: [tiny, "--json", "/proc/x.json"],
             words=("/proc",)),
        Case("json-is-a-dir/graphopt", "output path", "graphopt", lambda d: ["roundtrip", tiny, "--json", str(d)],
             words=("folder",)),
        Case("json-read-only/tune-kernels", "output path", "tune-kernels",
             lambda d: ["--op", "matmul", "--shape", "8,8,8", "--trials", "1", "--json", str(d / "ro" / "r.json")],
             words=("cannot write",), needs_unshare=ro),
        Case("plot-bad-suffix/bench-model", "output path", "bench-model", lambda d: [tiny, "--plot", str(d / "p.xyz")],
             words=(".png",)),
        Case("o-parent-is-a-file/graphopt", "output path", "graphopt",
             lambda d: ["optimize", tiny, "-o", _a_file(d) + "/o.onnx"], words=("is a file",)),
        Case("work-dir-is-a-file/bench-model", "output path", "bench-model", lambda d: [tiny, "--work-dir", _a_file(d)],
             words=("is a file",)),
        Case("models-o-under-dev/models", "output path", "models", lambda d: ["build", "mlp", "-o", "/dev/m.onnx"],
             words=("/dev",)),
        # A build replaces the -o folder in one step (issue 25): what cannot be replaced so is refused first.
        Case("o-holds-a-folder/optimize-model", "output path", "optimize-model",
             lambda d: (d / "out" / "sub").mkdir(parents=True) or [tiny, "-o", _out(d)], words=("holds a folder", "sub")),
        Case("o-is-the-current-folder/optimize-model", "output path", "optimize-model", lambda d: [tiny, "-o", "."],
             words=("current folder",)),
        Case("o-is-a-mount-point/optimize-model", "output path", "optimize-model",
             lambda d: [tiny, "-o", str(d / "mnt")], words=("mount point",),
             needs_unshare="mkdir -p {d}/mnt && mount -t tmpfs tmpfs {d}/mnt"),
    ]


def _inputs_files() -> list[Case]:
    dyn = lambda d: [save(dynamic_relu(), d)]  # noqa: E731
    return [
        Case("inputs-missing/optimize-model", "--inputs", "optimize-model",
             lambda d: _opt(relu)(d) + ["--inputs", str(d / "none.npz")], words=("does not exist",)),
        Case("inputs-not-npz/graphopt", "--inputs", "graphopt",
             lambda d: _rt(relu)(d) + ["--inputs", _text_file(d)], words=("not a readable .npz",)),
        Case("inputs-wrong-name/bench-model", "--inputs", "bench-model",
             lambda d: dyn(d) + ["--inputs", npz(d, z=np.zeros((2, 8), np.float32))], words=("'z'",)),
        Case("inputs-wrong-dtype/graphopt", "--inputs", "graphopt",
             lambda d: _rt(relu)(d) + ["--inputs", npz(d, x=np.zeros((2, 3)))], words=("float64", "float32")),
        Case("inputs-wrong-static-dim/optimize-model", "--inputs", "optimize-model",
             lambda d: _opt(relu)(d) + ["--inputs", npz(d, x=np.zeros((5, 3), np.float32))], words=("fixes 2",)),
        Case("inputs-pickled/graphopt", "--inputs", "graphopt",
             lambda d: _rt(relu)(d) + ["--inputs", npz(d, x=np.array([{"a": 1}], dtype=object))], words=("npz",)),
        Case("inputs-npz-bomb/optimize-model", "--inputs", "optimize-model",  # 1 GB of zeros in a 1 MB file
             lambda d: _opt(relu)(d) + ["--inputs", zeros_npz(d, "x", (2**28, 1))], words=("fixes 2",)),
        Case("inputs-contradict-shape/bench-model", "--inputs", "bench-model",
             lambda d: dyn(d) + ["--inputs", npz(d, x=np.zeros((2, 8), np.float32)), "--input-shape", "x=3,8"],
             words=("contradicts",)),
        Case("random-ints-are-no-shape/graphopt", "--inputs", "graphopt", _rt(reshape_by_input), words=("--inputs",)),
        Case("inputs-make-it-work/graphopt", "--inputs", "graphopt",
             lambda d: _rt(reshape_by_input)(d) + ["--inputs", npz(d, x=np.arange(8, dtype=np.float32).reshape(2, 4),
                                                                    s=np.array([4, 2], np.int64))], expect="ok"),
        Case("value-sets-pads/optimize-model", "--inputs", "optimize-model", _opt(pads_from_sample_rate),
             words=("'sr'", "pads of Pad node 'pad'", "--inputs")),
        Case("value-sets-pads-given/optimize-model", "--inputs", "optimize-model",
             lambda d: _opt(pads_from_sample_rate)(d) + ["--inputs", npz(d, sr=np.array(16000, np.int64))],
             expect="ok", before_tvm=False),
    ]


def int_division() -> onnx.ModelProto:
    """Div and Mod of int64 inputs beside a float MatMul: the graph stage times the Div alone (issue 25)."""
    w = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)
    nodes = [h.make_node("Div", ["a", "b"], ["c"]), h.make_node("Mod", ["a", "b"], ["m"]),
             h.make_node("MatMul", ["x", "w"], ["p"]), h.make_node("Relu", ["p"], ["y"])]
    return model(nodes, [vi("a", [4], T.INT64), vi("b", [4], T.INT64), vi("x", [2, 8])],
                 [vi("c", [4], T.INT64), vi("m", [4], T.INT64), vi("y", [2, 8])], [init("w", w)])


def int_division_samples(d: Path) -> list[str]:
    """Inputs with no zero divisor (onnxruntime refuses one), negative operands (truncation vs floor)."""
    return ["--inputs", npz(d, a=np.array([7, -7, 9, -9]), b=np.array([2, 2, -4, -4]), x=np.ones((2, 8), np.float32))]


def scatter_elements_max() -> onnx.ModelProto:
    idx = np.array([[0, 1, 1, 4], [2, 2, 2, -1], [3, 0, 4, 0]], np.int64)
    return model([h.make_node("ScatterElements", ["x", "idx", "u"], ["y"], axis=1, reduction="max")],
                 [vi("x", [3, 5]), vi("u", [3, 4])], [vi("y", [3, 5])], [init("idx", idx)], opset=18)


def if_outer_scope() -> onnx.ModelProto:
    """An If whose branches read an outer tensor (what exporters write): TVM's importer warns about it."""
    branches = {k: h.make_graph([h.make_node(op, ["x"], [k])], k, [], [vi(k, [2, 3])])
                for k, op in (("then_branch", "Relu"), ("else_branch", "Neg"))}
    nodes = [h.make_node("ReduceSum", ["x"], ["s"], keepdims=0), h.make_node("Greater", ["s", "z"], ["c"]),
             h.make_node("If", ["c"], ["y"], **branches)]
    return model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])], [init("z", np.float32(0))])


def resize_2d() -> onnx.ModelProto:
    """onnxruntime resizes a 2-D tensor; TVM's importer asserts 3-D to 5-D."""
    return model([h.make_node("Resize", ["x", "", "s"], ["y"], mode="nearest")], [vi("x", [4, 6])],
                 [vi("y", [4, 12])], [init("s", np.array([1, 2], np.float32))], opset=18)


def _successes() -> list[Case]:
    """Inputs that must go through, checked: guards against refusing too much."""
    sr = lambda d: ["--inputs", npz(d, x=np.ones((1, 8), np.float32), sr=np.array([16000], np.int64))]  # noqa: E731
    return [
        Case("control-input-with-samples/optimize-model", "edge case", "optimize-model",
             lambda d: _opt(control_input)(d) + sr(d), expect="ok", before_tvm=False),
        Case("control-input-with-samples/bench-model", "edge case", "bench-model",
             lambda d: _bench(control_input)(d) + sr(d), expect="ok", before_tvm=False),
        Case("fp16/optimize-model", "edge case", "optimize-model", _opt(fp16_mlp), expect="ok", before_tvm=False),
        Case("logits-800/optimize-model", "edge case", "optimize-model", _opt(big_logits), expect="ok", before_tvm=False),
        Case("gather-ids/optimize-model", "edge case", "optimize-model", _opt(gather_ids), expect="ok", before_tvm=False),
        Case("dynamic-with-shape/optimize-model", "edge case", "optimize-model",
             _opt(dynamic_relu, "--input-shape", "x=3,8"), expect="ok", before_tvm=False),
        Case("opset9-weights-as-inputs/graphopt", "edge case", "graphopt", _rt(opset9_weights_as_inputs), expect="ok"),
        Case("contrib-op/graphopt", "edge case", "graphopt",
             _rt(lambda: model([h.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft")], [vi("x", [2, 3])],
                               [vi("y", [2, 3])], domains=["com.microsoft"])), expect="ok"),
        Case("contrib-op/optimize-model", "edge case", "optimize-model",  # TVM converts some com.microsoft ops
             _opt(lambda: model([h.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft")], [vi("x", [2, 3])],
                                [vi("y", [2, 3])], domains=["com.microsoft"])), expect="either", words=("FastGelu",),
             before_tvm=False),
        Case("bool-output/optimize-model", "edge case", "optimize-model",
             _opt(lambda: model([h.make_node("Greater", ["x", "z"], ["y"])], [vi("x", [4, 4])], [vi("y", [4, 4], T.BOOL)],
                                [init("z", np.float32(0))])), expect="ok", before_tvm=False),
        Case("target-cuda-no-gpu/optimize-model", "edge case", "optimize-model",
             lambda d: _opt(relu)(d) + ["--target", "cuda"], expect="ok", before_tvm=False),
        Case("graph-stage/graphopt", "edge case", "graphopt", _gopt(big_logits), expect="ok"),
        Case("zero-size-input/optimize-model", "edge case", "optimize-model",  # it built, then run-model refused
             _opt(lambda: model([h.make_node("Relu", ["x"], ["y"])], [vi("x", [0, 3])], [vi("y", [0, 3])])),
             words=("'x'", "zero-size")),  # the only shape it was built for
        Case("scalar-input/optimize-model", "edge case", "optimize-model",
             _opt(lambda: model([h.make_node("Relu", ["x"], ["y"])], [vi("x", [])], [vi("y", [])])), expect="ok",
             before_tvm=False),
        Case("no-nodes/optimize-model", "edge case", "optimize-model",
             _opt(lambda: model([], [vi("x", [2, 3])], [vi("x", [2, 3])])), expect="either", before_tvm=False),
        Case("no-nodes/graphopt", "edge case", "graphopt",
             _rt(lambda: model([], [vi("x", [2, 3])], [vi("x", [2, 3])])), expect="ok"),
        Case("int-div-by-input/optimize-model", "edge case", "optimize-model",  # the graph stage on: it times Div
             lambda d: [save(int_division(), d), "-o", _out(d), "--no-progress", *int_division_samples(d)],
             expect="ok", before_tvm=False),
        Case("int-div-by-input/graphopt", "edge case", "graphopt",
             lambda d: ["optimize", save(int_division(), d), "-o", str(d / "opt.onnx"), "--no-progress",
                        *int_division_samples(d)], expect="ok", before_tvm=False),
        Case("scatter-elements-max/optimize-model", "edge case", "optimize-model", _opt(scatter_elements_max),
             expect="ok", before_tvm=False),
        Case("if-outer-scope/optimize-model", "edge case", "optimize-model", _opt(if_outer_scope), expect="ok",
             before_tvm=False),
        Case("tvm-importer-refuses/optimize-model", "edge case", "optimize-model", _opt(resize_2d),
             words=("Resize",), before_tvm=False),
    ]


def _nan_probes() -> list[Case]:
    probes = {"Relu": {}, "Max": {}, "Min": {}, "Clip": {}, "ReduceMax": {"axes": [1], "keepdims": 0},
              "Softmax": {"axis": -1}}
    cases = []
    for op, attrs in probes.items():
        make = lambda op=op, attrs=attrs: unary_of_log(op, **attrs)  # noqa: E731
        cases.append(Case(f"nan-{op}/optimize-model", "NaN probe", "optimize-model", _opt(make), expect="either",
                          words=("NaN",), before_tvm=False))
        cases.append(Case(f"nan-{op}/graphopt", "NaN probe", "graphopt", _rt(make), expect="ok"))
    cases.append(Case("nan-Relu/bench-model", "NaN probe", "bench-model", _bench(lambda: unary_of_log("Relu")),
                      expect="either", words=("NaN",), before_tvm=False))
    return cases


def all_cases() -> list[Case]:
    return _files() + _structural() + _shapes() + _options() + _outputs() + _inputs_files() + _successes() + _nan_probes()


# ---- running -----------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    case: str
    verdict: str  # clean | internal | hang | wrong success | unexpected | signal
    rc: int | None
    stderr: str
    seconds: float
    detail: str = ""
    mode: str = ""

    def to_dict(self) -> dict:
        return {"case": self.case, "verdict": self.verdict, "rc": self.rc, "seconds": round(self.seconds, 2),
                "detail": self.detail, "mode": self.mode, "stderr": self.stderr[-400:]}


def command_line(command: str, args: list[str]) -> list[str]:
    """The user's command as a subprocess of this checkout (not whatever console scripts are installed)."""
    if command == "models":
        return [sys.executable, "-m", "models", *args]
    fn = ENTRY[command]
    return [sys.executable, "-c", f"import sys; from pipeline.cli import {fn}; sys.exit({fn}())", *args]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TMPDIR")}
    env.update(PYTHONPATH=str(ROOT), TVM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return env


def unshare_available() -> bool:
    """Whether a private mount namespace with a tmpfs can be made here (root, or unprivileged user
    namespaces); the read-only and disk-full cases need it."""
    if not shutil.which("unshare"):
        return False
    try:
        p = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0


def run_subprocess(case: Case, d: Path, args: list[str]) -> tuple[int | None, str, str, float]:
    cmd = command_line(case.command, args)
    if case.needs_unshare:
        mount = case.needs_unshare.format(d=d)
        cmd = ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh", *cmd]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=case.timeout, cwd=d, env=environment())
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return None, "", err, time.perf_counter() - t0
    return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0


class _Timeout(Exception):
    pass


def run_in_process(case: Case, d: Path, args: list[str]) -> tuple[int | None, str, str, float]:
    """The cli_entry-wrapped main called with the arguments (what the console script calls), stdout and
    stderr captured, a SIGALRM time limit (a Python-level hang raises out of it)."""
    if case.command == "models":
        from models.__main__ import main
    else:
        import pipeline.cli as cli

        main = getattr(cli, ENTRY[case.command])
    out, err = io.StringIO(), io.StringIO()

    def alarm(*_):
        raise _Timeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(case.timeout))
    t0 = time.perf_counter()
    cwd = os.getcwd()
    try:
        os.chdir(d)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(args)
    except _Timeout:
        rc = None
    except SystemExit as exc:  # --help and friends
        rc = int(exc.code or 0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.chdir(cwd)
    return rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0


def _error_lines(stderr: str) -> list[str]:
    # TVM's C++ logging writes "[hh:mm:ss] ..." warnings; tqdm progress bars end with '\r'; neither is ours.
    return [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("[")
            and not ln.lstrip().startswith(("note:", "warning:"))]


def judge(case: Case, d: Path, args: list[str], rc: int | None, stdout: str, stderr: str) -> tuple[str, str]:
    """(verdict, detail) of one run (module docstring)."""
    if rc is None:
        return "hang", f"no result after {case.timeout:.0f} s"
    lines = _error_lines(stderr)
    if "Traceback" in stderr or any("error: internal" in ln for ln in lines):
        return "internal", (lines or ["traceback"])[-1][:300]
    if rc == 2:
        if len(lines) != 1 or not lines[0].startswith("error: "):
            return "internal", f"exit 2 with {len(lines)} stderr lines"
        missing = [w for w in case.words if w.lower() not in lines[0].lower()]
        if case.expect == "ok":
            return "unexpected", f"refused: {lines[0][:300]}"
        if missing:
            return "unexpected", f"refusal does not name {missing}: {lines[0][:300]}"
        return "clean", lines[0][:300]
    if rc == 0:
        if case.expect == "refuse":
            return "wrong success", "exit 0 for an input that must be refused"
        problem = verify(case, d, args, stdout)
        return ("wrong success", problem) if problem else ("clean", "verified")
    if rc < 0 or rc > 128:  # killed by a signal (SIGFPE, SIGSEGV, SIGBUS...): no message reached the user
        number = -rc if rc < 0 else rc - 128
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
        return "signal", f"killed by {name}: {(lines or [''])[-1][:300]}"
    return "internal", f"exit code {rc}: {(lines or [''])[-1][:300]}"


def run_case(case: Case, base: Path, in_process: bool) -> Outcome:
    d = base / case.name.replace("/", "__")
    d.mkdir(parents=True, exist_ok=True)
    args = case.make(d)
    mode = "in-process" if in_process else "subprocess"
    rc, stdout, stderr, seconds = (run_in_process if in_process else run_subprocess)(case, d, args)
    verdict, detail = judge(case, d, args, rc, stdout, stderr)
    return Outcome(case.name, verdict, rc, stderr, seconds, detail, mode)


# ---- verifying a success, independently of the product's own check ----------------------------------------

def _close(ref: list[np.ndarray], got: list[np.ndarray]) -> str:
    """numpy's allclose (NaN equal to NaN only) with a loose per-dtype tolerance: "" when equal."""
    if len(ref) != len(got):
        return f"{len(got)} outputs, expected {len(ref)}"
    for i, (r, g) in enumerate(zip(ref, got)):
        r, g = np.asarray(r), np.asarray(g)
        if r.shape != g.shape:
            return f"output {i} has shape {g.shape}, expected {r.shape}"
        if r.dtype.kind in "biu" or g.dtype.kind in "biu":
            if not np.array_equal(r, g):
                return f"output {i} differs"
            continue
        tol = 5e-2 if r.dtype == np.float16 else 1e-3
        if not np.allclose(g.astype(np.float64), r.astype(np.float64), rtol=tol, atol=tol, equal_nan=True):
            return (f"output {i} differs from onnxruntime (NaN positions equal: "
                    f"{bool(np.array_equal(np.isnan(r), np.isnan(g)))})")
    return ""


def _shapes_of(model_path: str, args: list[str]) -> dict[str, tuple[int, ...]]:
    """The input shapes ``args``' ``--input-shape`` and ``--dim`` options give the model at ``model_path``."""
    from graphopt.dims import parse_dims, resolve_dims
    from graphopt.onnx_io import parse_input_shapes

    shapes = parse_input_shapes([args[i + 1] for i, a in enumerate(args) if a == "--input-shape"])
    fixed, _ = parse_dims([args[i + 1] for i, a in enumerate(args) if a == "--dim"])
    return resolve_dims(onnx.load(model_path), fixed, shapes)


def _inputs_for(model_path: str, args: list[str], seed: int = 7) -> dict[str, np.ndarray]:
    from graphopt.feeds import sample_feeds
    from graphopt.onnx_io import import_onnx

    shapes = _shapes_of(model_path, args)
    samples = None
    if "--inputs" in args:
        with np.load(args[args.index("--inputs") + 1]) as z:
            samples = {k: z[k] for k in z.files}
        shapes.update({k: tuple(v.shape) for k, v in samples.items()})
    return sample_feeds(import_onnx(model_path, shapes), samples, seed)


def _ort(model_path: str | onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    src = model_path.SerializeToString() if isinstance(model_path, onnx.ModelProto) else model_path
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def verify(case: Case, d: Path, args: list[str], stdout: str) -> str:
    """"" when the success's artifact is right, else what is wrong.  Recomputed here: the library is loaded
    and run with TVM, the ONNX outputs with onnxruntime, on inputs of another seed than the product's."""
    try:
        if case.command == "optimize-model":
            return _verify_optimize_model(args)
        if case.command == "graphopt":
            return _verify_graphopt(args, stdout)
        if case.command == "bench-model":
            return "" if "onnxruntime" in stdout and "median ms" in stdout else "no latency table printed"
        if case.command == "tune-kernels":
            return "" if "tasks" in stdout else "no task list printed"
        return ""
    except Exception as exc:  # noqa: BLE001 - a verification that cannot run is a failed one
        return f"verification failed: {type(exc).__name__}: {str(exc)[:200]}"


def _verify_optimize_model(args: list[str]) -> str:
    out = Path(args[args.index("-o") + 1])
    missing = [f for f in ("optimized.onnx", "model.so", "report.json") if not (out / f).is_file()]
    if missing:
        return f"missing {missing}"
    report = json.loads((out / "report.json").read_text())
    source = args[0]
    feeds = _inputs_for(source, args)
    ref = _ort(source, feeds)
    problem = _close(ref, _ort(str(out / "optimized.onnx"), feeds))
    if problem:
        return f"optimized.onnx: {problem}"
    compile_stage = report["stages"]["compile"]
    if compile_stage.get("not_run"):  # the kernels cannot run here: the report must say so
        return "" if "graph only" in compile_stage.get("checked", "") else "kernels unchecked but not reported"
    import tvm
    from tvm import relax

    lib = tvm.runtime.load_module(str(out / "model.so"))
    vm = relax.VirtualMachine(lib, tvm.cpu())
    import onnx as _onnx

    names = [i.name for i in _onnx.load(source).graph.input
             if i.name not in {t.name for t in _onnx.load(source).graph.initializer}]
    res = vm["main"](*[tvm.runtime.tensor(feeds[n]) for n in names])
    got = [res.numpy()] if hasattr(res, "numpy") else [r.numpy() for r in res]
    problem = _close(ref, got)
    return f"model.so: {problem}" if problem else ""


def _verify_graphopt(args: list[str], stdout: str) -> str:
    report = json.loads(stdout.strip().splitlines()[-1])
    if not report.get("outputs_equal"):
        return "exit 0 although outputs_equal is false"
    source = args[1]
    feeds = _inputs_for(source, args)
    ref = _ort(source, feeds)
    if args[0] == "optimize":
        return _close(ref, _ort(args[args.index("-o") + 1], feeds))
    from graphopt.onnx_io import export_onnx, import_onnx

    shapes = _shapes_of(source, args)
    return _close(ref, _ort(export_onnx(import_onnx(source, shapes)), feeds))


@dataclass
class Summary:
    outcomes: list[Outcome] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        v = [o.verdict for o in self.outcomes]
        return {"cases": len(v), "clean": v.count("clean"), "internal": v.count("internal"), "hangs": v.count("hang"),
                "wrong_successes": v.count("wrong success"), "unexpected": v.count("unexpected"),
                "signals": v.count("signal")}
