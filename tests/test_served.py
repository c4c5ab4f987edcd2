"""Builds that serve a range of sizes (``--dim NAME=LO:HI``, :mod:`pipeline.symbolic`): one model.so, every
size in the range, equal to onnxruntime at sizes nobody named at build time; outside the range one line, from
the loader and from model.so itself.

The model is a one-head attention block with an MLP and a layer norm, ``sequence`` symbolic: its kernels have
a symbolic row extent (the projections), a symbolic vector axis (the scores ``Q K^T``) and a symbolic reduction
(``scores V``), so each way a template meets a symbolic extent runs here at sizes no tile divides.
"""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import te

from graphopt.errors import UserError
from graphopt.feeds import run_ort
from kerneltune import templates
from kerneltune.targets.parse import parse_target
from kerneltune.tir_rewrite import rewrite_stmts
from pipeline.cli import run_model_main
from pipeline.symbolic import Served, specialize

HIDDEN = 32


def _attention_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = lambda *shape: numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.2)  # noqa: E731
    inits = []
    for name, shape in (("wq", (HIDDEN, HIDDEN)), ("wk", (HIDDEN, HIDDEN)), ("wv", (HIDDEN, HIDDEN)),
                        ("w1", (HIDDEN, 2 * HIDDEN)), ("w2", (2 * HIDDEN, HIDDEN)), ("b1", (2 * HIDDEN,))):
        t = w(*shape)
        t.name = name
        inits.append(t)
    inits += [numpy_helper.from_array(np.ones(HIDDEN, np.float32), "gamma"),
              numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "beta")]
    n = helper.make_node
    nodes = [n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]), n("MatMul", ["x", "wv"], ["v"]),
             n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), n("MatMul", ["q", "kt"], ["s"]),
             n("Softmax", ["s"], ["p"], axis=-1), n("MatMul", ["p", "v"], ["c"]), n("Add", ["c", "x"], ["r"]),
             n("LayerNormalization", ["r", "gamma", "beta"], ["h"], axis=-1),
             n("MatMul", ["h", "w1"], ["m"]), n("Add", ["m", "b1"], ["mb"]), n("Relu", ["mb"], ["a"]),
             n("MatMul", ["a", "w2"], ["y"])]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "attention", [vi("x", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])],
                              [vi("y", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.fixture(scope="module")
def served_build(tmp_path_factory):
    import pipeline

    folder = tmp_path_factory.mktemp("served")
    path = folder / "attention.onnx"
    onnx.save(_attention_model(), str(path))
    model = pipeline.optimize(str(path), output=folder / "built", threads=1, skip_graph=True,
                              dims={"batch": 1, "sequence": (2, 40)})
    return path, folder / "built", model


@pytest.mark.parametrize("length", [2, 17, 29, 32, 40])
def test_one_build_matches_onnxruntime_at_sizes_never_named(served_build, length):
    path, _, model = served_build
    x = np.random.default_rng(length).standard_normal((1, length, HIDDEN)).astype(np.float32)
    want = run_ort(onnx.load(str(path)), {"x": x})[0]
    got = model.run({"x": x})["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_softmax_over_a_symbolic_row_reduces_in_vectors_and_is_exact_at_every_length(tmp_path):
    """A softmax whose row is the served length is cut at ``n // 16 * 16`` (pipeline.passes.lane_softmax): the
    body's max and sum reduce in 16-lane partials (``_rf`` blocks), its elementwise passes over the row run in
    whole vectors and one masked vector, and a length with no body
    (< 16) or no tail (a multiple of 16), whose empty reduction never initializes, is still exact, on two
    threads."""
    import pipeline
    from pipeline.chain import ChainRequest, Until, run_chain
    from pipeline.compile import schedule
    from pipeline.context import BuildContext

    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "softmax",
                              [vi("x", TensorProto.FLOAT, [1, 4, "sequence", "sequence"])],
                              [vi("y", TensorProto.FLOAT, [1, 4, "sequence", "sequence"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = tmp_path / "softmax.onnx"
    onnx.save(model, str(path))
    built = pipeline.optimize(str(path), output=tmp_path / "built", threads=2, skip_graph=True,
                              dims={"sequence": (2, 80)})
    for length in (2, 15, 16, 32, 33, 80):
        x = (np.random.default_rng(length).standard_normal((1, 4, length, length)) * 4).astype(np.float32)
        x[0, 0, -1, length // 2:] = -np.inf  # a causal mask's row
        e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
        np.testing.assert_allclose(built.run({"x": x})["y"], e / e.sum(axis=-1, keepdims=True), rtol=1e-5, atol=1e-7)
    ctx = BuildContext.create("llvm", threads=2, skip_graph=True)
    served = Served({"sequence": (2, 80)}, {"sequence": 40})
    lowered = run_chain(ctx, ChainRequest(model, {"x": [1, 4, 40, 40]}, served=served, original=model,
                                          until=Until.PARTITION)).lowered
    scheduled, _ = schedule(lowered.part, ctx.spec)
    (script,) = [f.script() for gv, f in scheduled.functions_items() if "softmax" in gv.name_hint]
    assert script.count("_rf = ") == 2
    # the three passes over the row (x - max, its exponentials, the normalized output) in whole vectors, the
    # mask only on the last, partial one (kerneltune.templates.full_tiles)
    assert len(re.findall(r"for \w+_whole in T.vectorized", script)) == 3
    # one buffer of exponentials over the whole row, which the normalization reads straight (two buffers, the
    # body's in vectors, and a select between them ran 18-22% slower at 8 and 77 tokens, alike at 128 and 384)
    assert "lane_delta_body" not in script and "lane_delta" in script


def test_report_and_signature_record_the_range(served_build):
    _, out, _ = served_build
    report = json.loads((out / "report.json").read_text())
    assert report["served"]["ranges"] == {"sequence": [2, 40]}
    assert report["served"]["representative"] == {"sequence": 40}  # 128, moved into the range
    assert [c["sizes"] for c in report["served"]["checked"]] == [{"sequence": 2}, {"sequence": 21}]
    (x,) = report["deploy"]["inputs"]
    assert x["shape"] == [1, 40, HIDDEN] and x["ranges"] == [{"axis": 1, "dim": "sequence", "min": 2, "max": 40}]
    matmuls = [t for t in report["tasks"] if t["kind"] in ("matmul", "batch_matmul")]
    assert matmuls and all(t["schedule"] == "template" for t in matmuls)
    # each kernel's FLOPs grow with the length as its extents say: a projection's with its rows, the scores'
    # (Q K^T) with rows and columns, a weight's bytes not at all (a per-length profile scales by them)
    growth = {tuple(map(tuple, t["shapes"][:2])): t["scaling"]["sequence"] for t in matmuls}
    assert growth[((1, 40, HIDDEN), (HIDDEN, HIDDEN))][0] == pytest.approx(1.0, abs=0.01)
    assert growth[((1, 40, HIDDEN), (1, HIDDEN, 40))][0] == pytest.approx(2.0, abs=0.01)
    assert all(t["scaling"]["sequence"][1] < 1.0 for t in matmuls if len(t["shapes"][1]) == 2)
    assert "serves sequence 2..40 (measured at sequence=40)" in (out / "report.md").read_text()


def test_sizes_outside_the_range_are_one_line_from_the_loader_and_from_model_so(served_build):
    _, out, model = served_build
    with pytest.raises(UserError, match=r"'x' has sequence=41 \(axis 1\), outside the sizes 2\.\.40 model\.so serves: "
                                        r"rebuild with --dim sequence=LO:HI covering 41"):
        model.run({"x": np.zeros((1, 41, HIDDEN), np.float32)})
    with pytest.raises(UserError, match=r"compiled for \[1, sequence=2\.\.40, 32\]"):
        model.run({"x": np.zeros((2, 8, HIDDEN), np.float32)})
    # a plain TVM loader reads no report: model.so asserts the range itself
    from tvm import relax

    vm = relax.VirtualMachine(tvm.runtime.load_module(str(out / "model.so")), tvm.cpu())
    with pytest.raises(AssertionError, match="sequence is 1, outside the sizes 2..40 this model.so serves"):
        vm["main"](tvm.runtime.tensor(np.zeros((1, 1, HIDDEN), np.float32)))


def test_run_model_draws_inputs_at_any_size_in_the_range(served_build, tmp_path, capsys):
    _, out, _ = served_build
    stats = tmp_path / "s.json"
    assert run_model_main([str(out), "--dim", "sequence=13", "--check", "--repeat", "2", "--json", str(stats)]) == 0
    assert json.loads(stats.read_text())["check"]["ok"]
    capsys.readouterr()
    assert run_model_main([str(out), "--dim", "sequence=41", "--repeat", "1"]) == 2
    assert "outside the sizes 2..40" in capsys.readouterr().err


def test_check_sizes_are_the_ends_and_an_odd_size_between():
    served = Served({"sequence": (2, 512)}, {"sequence": 128})
    assert served.check_sizes() == [{"sequence": 2}, {"sequence": 512}, {"sequence": 257}]
    assert Served({"s": (1, 3)}, {"s": 3}).check_sizes() == [{"s": 1}]  # the middle (odd: 1) is the low end


@pytest.mark.parametrize("rows", [1, 5, 77])
def test_symbolic_matmul_with_the_tiles_of_its_instance(rows):
    """The CPU template applied to a kernel whose rows are symbolic, with the default config of its instance at
    128 rows: the rows padded to whole register tiles and cropped, exact at sizes no tile divides."""
    n = tvm.tirx.Var("n", "int64")
    a = te.placeholder((n, 64), name="a")
    b = te.placeholder((64, 48), name="b")
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((n, 48), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="matmul")
    func = te.create_prim_func([a, b, c])
    instance = templates.task_for("matmul", specialize(func, {"n": 128}))
    assert instance is not None and instance.kind == "matmul"
    target = parse_target("llvm", 1).target
    import dataclasses

    scheduled = templates.apply(dataclasses.replace(instance, func=func),
                                templates.default_config(instance, target), target)
    lib = tvm.tirx.build(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=target)
    rng = np.random.default_rng(rows)
    av, bv = rng.standard_normal((rows, 64)).astype(np.float32), rng.standard_normal((64, 48)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((rows, 48), np.float32))
    lib["main"](tvm.runtime.tensor(av), tvm.runtime.tensor(bv), out)
    np.testing.assert_allclose(out.numpy(), av @ bv, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 8, 9, 17, 77])
def test_register_tiles_past_a_symbolic_end_are_skipped(rows):
    """Rows tiled 2 x 8 inside a k-block (S2 = 2, a calibrated row repeat) pad a symbolic length to 16: the second
    tile of each pair is skipped when it starts past the length (at 8 rows GPT-2's matmuls computed 16), and
    every row still computed: the output starts as NaN, a needed tile skipped would leave zeros or NaN."""
    import dataclasses

    n = tvm.tirx.Var("n", "int64")
    i64 = lambda v: tvm.tirx.IntImm("int64", v)  # noqa: E731
    a = te.placeholder((n, i64(64)), name="a")
    b = te.placeholder((i64(64), i64(48)), name="b")
    k = te.reduce_axis((i64(0), i64(64)), name="k")
    func = te.create_prim_func([a, b, te.compute((n, i64(48)), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k),
                                                 name="matmul")])
    instance = templates.task_for("matmul", specialize(func, {"n": 128}))
    target = parse_target("llvm", 1).target
    space = templates.space_for(instance, target)
    config = space.as_dict(templates.default_config(instance, target))
    config.update(tile_i=(1, 8, 2, 8), tile_k=(1, 64))
    scheduled = templates.apply(dataclasses.replace(instance, func=func), tuple(config[k] for k in space.names),
                                target)
    guards = []

    def visit(s):
        if isinstance(s, tvm.tirx.IfThenElse) and isinstance(s.then_case, tvm.tirx.For) and \
                any(v.name == "n" for v in tvm.tirx.analysis.undefined_vars(s.condition)):
            guards.append(s)

    rewrite_stmts(scheduled.body, lambda s: visit(s))  # visits every statement, rewrites none
    assert guards, "no register tile guarded by the length"
    lib = tvm.tirx.build(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=target)
    rng = np.random.default_rng(rows)
    av, bv = rng.standard_normal((rows, 64)).astype(np.float32), rng.standard_normal((64, 48)).astype(np.float32)
    out = tvm.runtime.tensor(np.full((rows, 48), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(av), tvm.runtime.tensor(bv), out)
    np.testing.assert_allclose(out.numpy(), av @ bv, rtol=1e-5, atol=1e-4)


def test_batch_and_sequence_served_together(tmp_path):
    """Two symbolic dimensions in one build (issue 41's dynamic batch with a dynamic sequence)."""
    import pipeline

    path = tmp_path / "attention.onnx"
    onnx.save(_attention_model(seed=1), str(path))
    model = pipeline.optimize(str(path), output=tmp_path / "built", threads=1, skip_graph=True,
                              dims={"batch": (1, 3), "sequence": (2, 16)})
    assert model.report["served"]["representative"] == {"batch": 3, "sequence": 16}
    for batch, length in ((1, 2), (2, 11), (3, 16)):
        x = np.random.default_rng(batch * length).standard_normal((batch, length, HIDDEN)).astype(np.float32)
        np.testing.assert_allclose(model.run({"x": x})["y"], run_ort(onnx.load(str(path)), {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)
    with pytest.raises(UserError, match="batch=4"):
        model.run({"x": np.zeros((4, 8, HIDDEN), np.float32)})


def test_int8_build_serves_the_range_with_integer_kernels(tmp_path):
    """--precision int8 (onnxruntime's quantize_dynamic for a transformer) with a range: the integer products
    keep their template (rows padded to whole register tiles), and the build matches onnxruntime's int8 model
    at a length never named."""
    import pipeline

    path = tmp_path / "attention.onnx"
    onnx.save(_attention_model(seed=2), str(path))
    model = pipeline.optimize(str(path), output=tmp_path / "built", threads=1, skip_graph=True, precision="int8",
                              dims={"batch": 1, "sequence": (2, 24)})
    products = [t for t in model.report["tasks"] if t["kind"] == "matmul" and t["dtype"] == "int32"]
    assert products and all(t["schedule"] == "template" for t in products), model.report["tasks"]
    x = np.random.default_rng(13).standard_normal((1, 13, HIDDEN)).astype(np.float32)
    comparison = model.check({"x": x})  # onnxruntime on optimized.onnx, the int8 model
    assert comparison.max_abs_err < 2e-3, comparison.reason()


def test_run_model_runs_several_lengths_one_line_each(served_build, tmp_path, capsys):
    _, out, _ = served_build
    stats = tmp_path / "s.json"
    assert run_model_main([str(out), "--dim", "sequence=3,17,40", "--check", "--repeat", "2",
                           "--json", str(stats)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [f"{out} at sequence={n}" for n in (3, 17, 40)]
    runs = json.loads(stats.read_text())["runs"]
    assert [r["sizes"] for r in runs] == [{"sequence": n} for n in (3, 17, 40)] and all(r["check"]["ok"] for r in runs)
    assert run_model_main([str(out), "--dim", "sequence=3,17", "--dim", "batch=1,2"]) == 2
    assert "several sizes of sequence and batch" in capsys.readouterr().err


def test_bench_model_times_a_served_build_at_each_length(served_build, tmp_path, capsys, monkeypatch):
    """bench-model DIR --dim sequence=A,B: the shipped build and onnxruntime at each size, a table each and
    one row per size (issue 41); --json holds every size, --plot the latency over the size."""
    from pipeline import bench_shipped
    from pipeline.benchmark import Peer
    from pipeline.cli import bench_model_main

    monkeypatch.setattr(bench_shipped, "openvino_for", lambda *a, **k: Peer(skipped="not in this test"))
    _, out, _ = served_build
    data, png = tmp_path / "b.json", tmp_path / "b.png"
    assert bench_model_main([str(out), "--dim", "sequence=5,33", "--runs", "2", "--json", str(data),
                             "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "sequence=5 " in printed and "sequence=33 " in printed
    lengths = json.loads(data.read_text())["lengths"]
    assert [r["sizes"] for r in lengths] == [{"sequence": 5}, {"sequence": 33}]
    assert all(r["shipped_ms"] > 0 and r["ort_ms"] > 0 and r["max_abs_err"] < 2e-3 for r in lengths)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert bench_model_main([str(out), "--dim", "sequence=41", "--runs", "1"]) == 2  # outside 2..40


def test_kernels_of_a_build_with_symbolic_sizes_keep_restricted_pointers():
    """A module with symbolic sizes gains Relax's ``shape_func``, which sorts after a ``fused_*`` kernel; TVM's
    LLVM codegen compiles every function with the no-alias flag of the last one it declares
    (:func:`pipeline.compile._helpers_noalias`), so without the helper marked the kernel's buffers may alias and
    LLVM keeps its accumulators in memory.  The kernel's compute function takes ``noalias`` pointers."""
    import re

    from pipeline.compile import build

    n = tvm.tirx.Var("n", "int64")
    bb = tvm.relax.BlockBuilder()
    x = tvm.relax.Var("x", tvm.relax.TensorType((1, n, 64), "float32"))
    w = tvm.relax.Var("w", tvm.relax.TensorType((64, 32), "float32"))
    with bb.function("main", [x, w]):
        bb.emit_func_output(bb.emit(tvm.relax.op.matmul(x, w)))
    mod = tvm.relax.transform.LegalizeOps()(bb.get())
    mod = tvm.IRModule({gv: (f.with_attr("tirx.noalias", True) if isinstance(f, tvm.tirx.PrimFunc) else f)
                        for gv, f in mod.functions_items()})
    ex = build(mod, parse_target("llvm", 1))
    source = "".join(m.inspect_source("ll") for m in [ex.mod, *ex.mod.imports] if m.kind == "llvm")
    computes = re.findall(r"define internal fastcc \w+ @(\w+)_compute_\(([^)]*)\)", source)
    # TVM keeps a compute function out of line only when its pointers are restricted
    assert "matmul" in [name for name, _ in computes], "the kernel's compute function was inlined: its pointers alias"
    for name, params in computes:
        pointers = [p for p in params.split(",") if p.strip().startswith("ptr")]
        assert pointers and all("noalias" in p for p in pointers), (name, params)


def _loop_around(script: str, marker: str) -> str:
    """The innermost loop variable around the first line holding ``marker`` in a kernel's TVMScript."""
    lines = script.splitlines()
    at = next(i for i, x in enumerate(lines) if marker in x)
    depth = len(lines[at]) - len(lines[at].lstrip())
    for x in reversed(lines[:at]):
        indent = len(x) - len(x.lstrip())
        if indent < depth:
            if x.lstrip().startswith("for "):  # ``for v in range(..)`` or ``for u, v in T.grid(..)``: v
                return x.lstrip()[4:].split(" in ")[0].split(",")[-1].strip()
            depth = indent
    raise AssertionError(f"no loop around {marker}")


def test_symbolic_rows_prefetch_the_next_panel_where_rows_share_it_else_the_next_k_block():
    """A pre-packed weight's next panel is prefetched while several row tiles share the current one; at a
    length of one row tile the kernel reads each panel once, and prefetches the current panel's next k-block.
    The served instance's tile does not repeat down the rows (``cpu.SERVED_ROW_REPEAT``), so, as in a static
    kernel, that prefetch is spread over the steps inside the k-block (``k_1``).  A config that repeats the
    tile (S2 = 2: outside the served space a tuner searches, applied to the kernel as a task that does not
    say it is served) prefetches the next k-block whole at the top of the k-block (``k_0``)
    and still skips the tile past the length (:mod:`kerneltune.templates.tail_tiles`).  Bound to 8 rows, the
    one prefetch left reads the current panel; bound to 64, the next one (``min(panel + 1, last)``).  Both
    kernels equal numpy at 8 and 77 rows."""
    import dataclasses

    from kerneltune import prepack
    from kerneltune.templates import cpu

    n = tvm.tirx.Var("n", "int64")
    i64 = lambda v: tvm.tirx.IntImm("int64", v)  # noqa: E731 - as imported models index: int64 throughout
    a = te.placeholder((n, i64(256)), name="a")
    b = te.placeholder((i64(256), i64(384)), name="b")
    k = te.reduce_axis((i64(0), i64(256)), name="k")
    func = te.create_prim_func([a, b, te.compute((n, i64(384)), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k),
                                                 name="matmul")])
    instance = dataclasses.replace(templates.task_for("matmul", specialize(func, {"n": 128})), weights=("b",),
                                   served=frozenset({"i"}))
    target = parse_target("llvm", 2).target
    space = templates.space_for(instance, target)
    config = templates.default_config(instance, target)
    tiles = space.as_dict(config)
    assert tiles["pack"] == "prepack" and tiles["tile_i"][2] == cpu.SERVED_ROW_REPEAT == 1
    s0, s1, _, s3 = tiles["tile_i"]
    repeated = space.from_dict({**tiles, "tile_i": (s0, s1 // 2, 2, s3)})
    assert not space.contains(repeated)  # tuners search served tiles that keep their registers
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((256, 384)).astype(np.float32)
    for cfg, k_loop in ((config, "k_1"), (repeated, "k_0")):
        task = dataclasses.replace(instance, func=func, served=instance.served if cfg is config else frozenset())
        scheduled, packings = prepack.strip(templates.apply(task, cfg, target))
        if k_loop == "k_0":
            assert re.search(r"if .* \* T.int64\(8\) < n:", scheduled.script())  # the tail guard
        for rows, next_panel in ((8, False), (64, True)):
            bound = tvm.tirx.transform.StmtSimplify()(tvm.IRModule({"main": specialize(scheduled, {"n": rows})}))
            script = bound["main"].script()
            (line,) = [x for x in script.splitlines() if "T.prefetch(" in x]
            assert ("T.min(" in line) == next_panel, (rows, line)
            if not next_panel:
                assert _loop_around(script, "for prefetch_line") == k_loop
        lib = tvm.tirx.build(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=target)
        for rows in (8, 77):
            x = rng.standard_normal((rows, 256)).astype(np.float32)
            packed = prepack.pack_inputs([x, weight], packings)
            out = tvm.runtime.tensor(np.full((rows, 384), np.nan, np.float32))
            lib["main"](*(tvm.runtime.tensor(v) for v in packed), out)
            np.testing.assert_allclose(out.numpy(), x @ weight, rtol=1e-4, atol=1e-4, err_msg=f"{rows} rows")


def _positions_model() -> onnx.ModelProto:
    """GPT-2's shape in miniature: positions ``Range(0, sequence, 1)`` gathered from a table and added to the
    tokens, a Reshape with an inferred size after them, and a head whose 53 columns split into no vector
    (its weight padded and the output sliced: :func:`pipeline.relax_import._padded_weight`)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 16)).astype(np.float32), "table"),
             numpy_helper.from_array(rng.standard_normal((16, 53)).astype(np.float32), "head"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array([1, -1, 16], np.int64), "shape")]
    n = helper.make_node
    nodes = [n("Shape", ["x"], ["len1"], start=1, end=2), n("Squeeze", ["len1"], ["length"]),
             n("Range", ["zero", "length", "one"], ["positions"]), n("Gather", ["table", "positions"], ["pe"]),
             n("Add", ["x", "pe"], ["h"]), n("Reshape", ["h", "shape"], ["r"]), n("MatMul", ["r", "head"], ["y"])]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "positions", [vi("x", TensorProto.FLOAT, [1, "sequence", 16])],
                              [vi("y", TensorProto.FLOAT, [1, "sequence", 53])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_positions_of_a_symbolic_length_are_served(tmp_path):
    """A decoder's positions, ``Range(0, sequence, 1)``, keep the length symbolic (TVM's importer gave the Range
    a size of its own, and the Reshape after it refused to import: GPT-2), and its padded head's slice works
    on a symbolic shape: right at lengths nobody named."""
    import pipeline

    path = tmp_path / "positions.onnx"
    onnx.save(_positions_model(), str(path))
    model = pipeline.optimize(str(path), output=tmp_path / "built", threads=1, skip_graph=True,
                              dims={"sequence": (2, 64)})
    for length in (2, 13, 64):
        x = np.random.default_rng(length).standard_normal((1, length, 16)).astype(np.float32)
        np.testing.assert_allclose(model.run({"x": x})["y"], run_ort(onnx.load(str(path)), {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)


def test_scores_with_a_symbolic_vector_axis_write_whole_tiles_unmasked():
    """Attention's scores ``Q K^T`` (the columns are the tokens) with the tiles of the 128-token instance: its
    write-back is split into the tiles inside the output, stored without a mask (in vectors), and the rest,
    masked (:mod:`kerneltune.templates.full_tiles`).  Only ``K^T``, padded along the columns, is copied; ``Q``,
    padded on its rows, is read through with its rows clamped (:func:`kerneltune.templates.common.prepare`).
    Equal to numpy at lengths no tile divides."""
    import dataclasses

    n = tvm.tirx.Var("n", "int64")
    i64 = lambda v: tvm.tirx.IntImm("int64", v)  # noqa: E731
    q = te.placeholder((i64(12), n, i64(64)), name="q")
    kt = te.placeholder((i64(12), i64(64), n), name="kt")
    r = te.reduce_axis((i64(0), i64(64)), name="r")
    scores = te.compute((i64(12), n, n), lambda b, i, j: te.sum(q[b, i, r] * kt[b, r, j], axis=r), name="matmul")
    func = te.create_prim_func([q, kt, scores])
    instance = templates.task_for("matmul", specialize(func, {"n": 128}))
    target = parse_target("llvm", 2).target
    scheduled = templates.apply(dataclasses.replace(instance, func=func), templates.default_config(instance, target),
                                target)
    script = scheduled.script()
    assert "if " in script and script.count("T.where") == 1  # two write-backs: the whole tiles' unmasked
    assert "kt_pad = T.sblock_alloc_buffer" in script and "q_pad" not in script
    lib = tvm.tirx.build(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=target)
    for length in (2, 17, 64, 77):
        rng = np.random.default_rng(length)
        qv = rng.standard_normal((12, length, 64)).astype(np.float32)
        kv = rng.standard_normal((12, 64, length)).astype(np.float32)
        out = tvm.runtime.tensor(np.full((12, length, length), np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(qv), tvm.runtime.tensor(kv), out)
        np.testing.assert_allclose(out.numpy(), qv @ kv, rtol=1e-4, atol=1e-4, err_msg=f"{length} tokens")


def test_specialize_binds_sizes_folded_into_another_dimension():
    """MiniLM's attention folds its heads into the batch (``[batch * 12, sequence, 32]``): a kernel whose buffers
    hold ``batch`` only inside such a product takes it as a scalar parameter.  The instance at the
    representative sizes has every dimension bound, the products included (TIR's Specialize refused the
    product, and a build serving both batch and sequence stopped with an internal error)."""
    from tvm import relax

    batch, sequence = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("sequence", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([batch, 2, sequence, 4], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            folded = bb.emit(relax.op.reshape(x, [batch * 2, sequence, 4]))
            out = bb.emit_output(relax.op.permute_dims(folded, [0, 2, 1]))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    shapes = []
    for func in funcs:
        instance = specialize(func, {"batch": 3, "sequence": 5})
        shapes.append(sorted(tuple(int(d) for d in p.shape) for p in instance.params))
    assert sorted(shapes) == [[(3, 2, 5, 4), (6, 5, 4)], [(6, 4, 5), (6, 5, 4)]]


def test_a_served_batch_stays_whole_and_the_cores_split_the_other_axes():
    """A batch axis whose extent follows a served size is not tiled (a tile pads it: batch 1 computed as 2) and
    does not feed the cores (at batch 1 one core would idle): its S0 is the whole batch, and the rows and
    columns give the parallel chunks.  A static batch is split as before."""
    import dataclasses

    from kerneltune.task import make_task
    from kerneltune.templates import cpu

    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})  # any host
    static = make_task("batch_matmul", "4,128,384,1536")
    served = dataclasses.replace(static, served=frozenset({"b0", "i"}))
    tiles = {name: dict(zip(cpu.space(t).names, cpu.default_config(t, avx512, row_repeat=1)))
             for name, t in (("static", static), ("served", served))}
    assert tiles["served"]["tile_b0"] == (4, 1, 1, 1)
    assert tiles["served"]["tile_i"][0] * tiles["served"]["tile_j"][0] >= 2
    assert tiles["static"]["tile_b0"] != (4, 1, 1, 1)


def _partition_of(model: onnx.ModelProto, shapes: dict, served: Served):
    """The served build's fused module and tasks (the chain up to the partition)."""
    from pipeline.chain import ChainRequest, Until, run_chain
    from pipeline.context import BuildContext

    ctx = BuildContext.create("llvm", threads=2, skip_graph=True)
    return run_chain(ctx, ChainRequest(model, shapes, served=served, original=model,
                                       until=Until.PARTITION)).lowered.part


def test_reshape_groups_carry_a_symbolic_dimension_alone():
    from pipeline.passes.grouped_reshape import groups

    n = tvm.tirx.Var("n", "int64")
    i = lambda *v: [tvm.tirx.IntImm("int64", x) if isinstance(x, int) else x for x in v]  # noqa: E731
    assert groups(i(1, n, 384), i(1, n, 12, 32)) == [([1], [1]), ([2], [2, 3])]
    assert groups(i(1, 12, n, 32), i(12, n, 32)) == [([1], [0]), ([2], [1]), ([3], [2])]
    assert groups(i(6, 4, n), i(3, 8, n)) == [([0, 1], [0, 1]), ([2], [2])]
    assert groups(i(n, 12), i(12, n)) is None  # a symbolic dimension moved across a fixed one
    assert groups(i(2, n), i(n, 2)) is None


@pytest.mark.parametrize("src,dst", [((6, 4, "n"), (3, 8, "n")), ((1, "n", 24), ("n", 2, 3, 4)),
                                     ((2, 1, "n", 6), (1, 2, "n", 2, 3))])
def test_grouped_reshape_equals_numpy_at_any_size(src, dst):
    from pipeline.passes.grouped_reshape import grouped_reshape, groups

    n = tvm.tirx.Var("n", "int64")
    dims = lambda s: [n if d == "n" else tvm.tirx.IntImm("int64", d) for d in s]  # noqa: E731
    x = te.placeholder(dims(src), name="x")
    plan = groups(dims(src), dims(dst))
    assert plan is not None
    y = grouped_reshape(x, dims(dst), plan)
    lib = tvm.tirx.build(tvm.IRModule({"main": te.create_prim_func([x, y]).with_attr("global_symbol", "main")}),
                         target="llvm")
    for size in (1, 5):
        value = np.arange(np.prod([size if d == "n" else d for d in src]), dtype=np.float32)
        value = value.reshape([size if d == "n" else d for d in src])
        out = tvm.runtime.tensor(np.zeros([size if d == "n" else d for d in dst], np.float32))
        lib["main"](tvm.runtime.tensor(value), out)
        np.testing.assert_array_equal(out.numpy(), value.reshape(out.shape))


def test_head_reshapes_of_a_symbolic_length_index_without_dividing_and_fuse(tmp_path):
    """The keys' head split as attention exports it (reshape, transpose, reshape, transpose, reshape) over a
    symbolic length: every kernel indexes without dividing by the length (:mod:`pipeline.passes.grouped_reshape`;
    TOPI's reshape divided by it, and nothing fused with it), the chain is one kernel, and the build is exact."""
    import pipeline

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) * 0.2).astype(np.float32), "wk")
    shape = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    n = helper.make_node
    nodes = [n("MatMul", ["x", "wk"], ["k"]), n("Reshape", ["k", "heads"], ["k4"]),
             n("Transpose", ["k4"], ["kt"], perm=[0, 2, 1, 3]), n("Reshape", ["kt", "folded"], ["k3"]),
             n("Transpose", ["k3"], ["kT"], perm=[0, 2, 1]), n("Reshape", ["kT", "unfolded"], ["y0"]),
             n("Mul", ["y0", "scale"], ["y"])]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "heads", [vi("x", TensorProto.FLOAT, [1, "sequence", HIDDEN])],
                              [vi("y", TensorProto.FLOAT, [1, 4, HIDDEN // 4, "sequence"])],
                              [w, shape("heads", [1, -1, 4, HIDDEN // 4]), shape("folded", [4, -1, HIDDEN // 4]),
                               shape("unfolded", [1, 4, HIDDEN // 4, -1]),
                               numpy_helper.from_array(np.array(0.5, np.float32), "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    part = _partition_of(model, {"x": [1, 20, HIDDEN]}, Served({"sequence": (2, 40)}, {"sequence": 20}))
    scripts = {gv.name_hint: f.script() for gv, f in part.mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert not [name for name, s in scripts.items() if "// sequence" in s or "% sequence" in s]
    (chain,) = [name for name in scripts if "reshape" in name]  # the whole chain and the scale: one kernel
    assert chain.startswith("fused_reshape_transpose_reshape") and "multiply" in chain
    path = tmp_path / "heads.onnx"
    onnx.save(model, str(path))
    built = pipeline.optimize(str(path), threads=2, skip_graph=True, dims={"sequence": (2, 40)})
    for length in (2, 17, 40):
        x = np.random.default_rng(length).standard_normal((1, length, HIDDEN)).astype(np.float32)
        np.testing.assert_allclose(built.run({"x": x})["y"], run_ort(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_a_guarded_softmax_is_one_kernel_and_exact_on_rows_masked_whole(tmp_path):
    """``where(isnan(softmax(s)), 0, softmax(s))``, as torch's dynamo exports attention, is folded into the
    softmax's last write (:func:`pipeline.passes.lane_softmax._nan_guards`): one kernel, and a row masked whole
    (every score -inf: NaN) comes out 0, at lengths with and without a vector body or tail."""
    import pipeline

    n = helper.make_node
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([n("Softmax", ["x"], ["p"], axis=-1), n("IsNaN", ["p"], ["bad"]),
                               n("Where", ["bad", "zero", "p"], ["y"])], "guarded",
                              [vi("x", TensorProto.FLOAT, [1, 2, "sequence", "sequence"])],
                              [vi("y", TensorProto.FLOAT, [1, 2, "sequence", "sequence"])],
                              [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    part = _partition_of(model, {"x": [1, 2, 40, 40]}, Served({"sequence": (2, 80)}, {"sequence": 40}))
    (task,) = part.tasks  # no kernel of its own for the guard
    assert task.name.startswith("split_softmax")
    path = tmp_path / "guarded.onnx"
    onnx.save(model, str(path))
    built = pipeline.optimize(str(path), threads=2, skip_graph=True, dims={"sequence": (2, 80)})
    for length in (2, 15, 16, 33, 80):
        x = (np.random.default_rng(length).standard_normal((1, 2, length, length)) * 4).astype(np.float32)
        x[0, 0, -1, :] = -np.inf  # a row masked whole
        x[0, 1, 0, length // 2:] = -np.inf
        got = built.run({"x": x})["y"]
        e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
        with np.errstate(invalid="ignore"):
            p = e / e.sum(axis=-1, keepdims=True)
        want = np.where(np.isnan(p), 0.0, p)
        assert not np.isnan(got).any() and np.all(got[0, 0, -1] == 0.0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_served_build_makes_each_symbolic_shape_once_and_computes_the_same():
    """Relax's VMShapeLower makes a shape object for every allocation whose shape follows the length (106 per
    MiniLM-L6 inference); :mod:`pipeline.passes.shape_cse` keeps one per distinct shape, and the build still
    computes what numpy does at every length."""
    from pipeline.compile import build
    from pipeline.passes.shape_cse import dedup_heap_reads

    n = tvm.tirx.Var("n", "int64")
    bb = tvm.relax.BlockBuilder()
    x = tvm.relax.Var("x", tvm.relax.TensorType((1, n, 16), "float32"))
    with bb.function("main", [x]):
        a = bb.emit(tvm.relax.op.add(x, x))
        b = bb.emit(tvm.relax.op.nn.relu(a))
        c = bb.emit(tvm.relax.op.multiply(b, a))
        d = bb.emit(tvm.relax.op.permute_dims(c, [0, 2, 1]))
        e = bb.emit(tvm.relax.op.subtract(d, tvm.relax.op.permute_dims(a, [0, 2, 1])))
        bb.emit_func_output(e)
    mod = tvm.relax.transform.LegalizeOps()(bb.get())
    target = parse_target("llvm", 1)

    def make_shapes(m) -> int:
        return m["main"].script().count("vm.builtin.make_shape")

    with target.target:
        lowered = tvm.relax.get_pipeline("default")(mod)
    before, after = make_shapes(lowered), make_shapes(dedup_heap_reads(lowered))
    assert before >= 5 and after == 3, (before, after)  # the storages' bytes, (1, n, 16) and (1, 16, n)
    assert make_shapes(lowered) == before  # the pass leaves its input module as it was

    vm = tvm.relax.VirtualMachine(build(mod, target), tvm.cpu())
    for length in (2, 7, 33):
        xs = np.random.default_rng(length).standard_normal((1, length, 16)).astype(np.float32)
        a_ = xs + xs
        want = (np.maximum(a_, 0) * a_).transpose(0, 2, 1) - a_.transpose(0, 2, 1)
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(xs)).numpy(), want, rtol=1e-6)
