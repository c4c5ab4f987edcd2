"""``--dim NAME=N``: a symbolic dimension fixed once, by its name, in every input (issue 41); ``--dim NAME=LO:HI``
parsed and checked here (the builds that serve a range: tests/test_served.py).

A BERT exported with symbolic ``batch`` and ``sequence`` needed one ``--input-shape`` per input and one try per
input to find that out.  Checked here on a tiny model with three inputs sharing ``batch``/``sequence``: the
parsing and the model checks directly (cheap), every refusal as one line with exit 2, and one end-to-end
build through ``pipeline.optimize(dims=...)`` against onnxruntime.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from graphopt.dims import ShapeRequest, check_dims, parse_dims, shape_request
from graphopt.errors import UserError
from graphopt.onnx_io import import_onnx
from graphopt.validate import check_model
from pipeline.cli import bench_model_main, graphopt_main, optimize_model_main

SEQ = 5


def _model(ids=("batch", "sequence"), mask=("batch", "sequence"), scale=(1, "sequence")) -> onnx.ModelProto:
    """``(ids + mask) * scale``, by default ``ids`` and ``mask`` [batch, sequence] and ``scale`` [1, sequence]:
    the dimension names shared as a BERT's inputs share them."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Add", ["ids", "mask"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["y"])]
    graph = helper.make_graph(nodes, "g", [vi("ids", TensorProto.FLOAT, list(ids)),
                                           vi("mask", TensorProto.FLOAT, list(mask)),
                                           vi("scale", TensorProto.FLOAT, list(scale))],
                              [vi("y", TensorProto.FLOAT, list(ids))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnxruntime reads IR <= 13; the pinned onnx writes 14
    return model


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(_model(), str(p))
    return p


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


# ---- parsing --------------------------------------------------------------------------------------------------

def test_parse_repeated_and_comma_forms():
    assert parse_dims(["batch=1", "sequence=128"]) == ({"batch": 1, "sequence": 128}, {})
    assert parse_dims(["batch=1,sequence=128"]) == ({"batch": 1, "sequence": 128}, {})
    assert parse_dims(["batch=1", "batch=1"]) == ({"batch": 1}, {})  # said twice, the same: no conflict
    assert parse_dims(None) == ({}, {})
    request = shape_request(["x=1,2"], ["batch=2"])
    assert dict(request) == {"x": (1, 2)} and request.dims == {"batch": 2}


def test_ranges_are_parsed_and_one_size_ranges_are_sizes():
    assert parse_dims(["batch=1,sequence=2:512"]) == ({"batch": 1}, {"sequence": (2, 512)})
    assert parse_dims(["sequence=8:8"]) == ({"sequence": 8}, {})
    request = shape_request(None, ["batch=1", "sequence=2:512"], ranges=True)
    assert request.ranges == {"sequence": (2, 512)} and request.sizes == {"batch": 1, "sequence": 128}
    assert shape_request(None, ["sequence=2:64"], ranges=True).sizes == {"sequence": 64}  # 128 moved into it
    with pytest.raises(UserError, match=r"--dim sequence=2:512: a range is for optimize-model.*--dim sequence=512"):
        shape_request(None, ["sequence=2:512"])


@pytest.mark.parametrize("spec, words", [
    ("sequence=512:2", "1 <= LO <= HI"),
    (f"sequence=2:{2**63}", "too large"),
    ("sequence=0", "--dim sequence=0: the size is not positive"),
    ("sequence=-3", "not positive"),
    (f"sequence={2**63}", "too large"),
    ("sequence=1.5", "whole number"),
    ("sequence=abc", "whole number"),
    ("sequence=", "whole number"),
    ("sequence", "bad --dim 'sequence': write NAME=N"),
    ("=8", "bad --dim"),
    ("sequence=16,128", "one size per dimension"),
])
def test_parse_refusals(spec, words):
    with pytest.raises(UserError, match=words):
        parse_dims([spec])


def test_two_sizes_for_one_name():
    with pytest.raises(UserError, match=r"--dim gives 'batch' two sizes \(1 and 2\)"):
        parse_dims(["batch=1", "batch=2"])


def test_api_values_are_checked_the_same_way():
    spell = lambda n, v: f"dims={{{n!r}: {v!r}}}"  # noqa: E731
    assert check_dims({"sequence": np.int64(8)}, spell) == ({"sequence": 8}, {})
    assert check_dims({"sequence": (2, np.int64(512))}, spell) == ({}, {"sequence": (2, 512)})
    with pytest.raises(UserError, match=r"dims=\{'sequence': \(0, 512\)\}: a range is LO:HI"):
        check_dims({"sequence": (0, 512)}, spell)
    with pytest.raises(UserError, match="whole number"):
        check_dims({"sequence": True}, spell)


# ---- against the model ----------------------------------------------------------------------------------------

def test_dim_fixes_every_input_and_onnxruntime_agrees(path):
    model = check_model(path, ShapeRequest(dims={"batch": 2, "sequence": SEQ}))
    assert model.input_shapes == {"ids": (2, SEQ), "mask": (2, SEQ), "scale": (1, SEQ)}
    graph = import_onnx(model.proto, model.input_shapes)
    assert graph.outputs[0].shape == (2, SEQ)
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in model.input_shapes.items()}
    (y,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(y, (feeds["ids"] + feeds["mask"]) * feeds["scale"], rtol=1e-6)


def test_dim_and_input_shape_together(path):
    model = check_model(path, shape_request(["ids=2,5"], ["sequence=5", "batch=2"]))
    assert model.input_shapes == {"ids": (2, SEQ), "mask": (2, SEQ), "scale": (1, SEQ)}


def test_one_error_lists_every_unresolved_input(path, capsys):
    with pytest.raises(UserError) as err:
        check_model(path)
    assert str(err.value) == ("inputs have symbolic dimensions: ids [batch, sequence], mask [batch, sequence], "
                              "scale [1, sequence]: fix them with --dim batch=N --dim sequence=N")
    assert graphopt_main(["roundtrip", str(path)]) == 2
    assert _one_line_error(capsys) == f"error: {err.value}"


def test_a_dim_fixed_in_part_leaves_the_rest_named(path):
    with pytest.raises(UserError, match=r"ids \[2, sequence\], mask \[2, sequence\], scale \[1, sequence\]: "
                                        r"fix them with --dim sequence=N$"):
        check_model(path, ShapeRequest(dims={"batch": 2}))


def test_an_unnamed_dimension_points_to_input_shape(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(_model(mask=(None, "sequence")), str(p))
    with pytest.raises(UserError, match=r"inputs have unknown dimensions: ids \[batch, sequence\], mask \[\?, "
                                        r"sequence\], .*fix them with --dim batch=N --dim sequence=N "
                                        r"--input-shape mask=D1,D2$"):
        check_model(p)
    with pytest.raises(UserError, match=r"^input has unknown dimensions: mask \[\?, 5\]: fix them with "
                                        r"--input-shape mask=D1,5$"):
        check_model(p, ShapeRequest(dims={"batch": 2, "sequence": SEQ}))
    model = check_model(p, shape_request(["mask=2,5"], ["batch=2", "sequence=5"]))
    assert model.input_shapes["mask"] == (2, SEQ)


def test_unknown_name_lists_the_model_s_names(path, tmp_path):
    with pytest.raises(UserError, match=r"--dim seq=8: no input of the model has a dimension named 'seq' "
                                        r"\(its named dimensions: batch, sequence\)"):
        check_model(path, ShapeRequest(dims={"seq": 8}))
    static = tmp_path / "static.onnx"
    onnx.save(_model(ids=(2, SEQ), mask=(2, SEQ), scale=(1, SEQ)), str(static))
    with pytest.raises(UserError, match="it has none: fix the inputs' sizes with --input-shape"):
        check_model(static, ShapeRequest(dims={"sequence": 8}))


def test_disagreement_with_input_shape_and_inputs(path, tmp_path):
    with pytest.raises(UserError, match=r"^--input-shape mask=2,7 sets sequence=7 \(axis 1\), but --dim "
                                        r"sequence=5: make them agree, or drop one$"):
        check_model(path, shape_request(["mask=2,7"], ["sequence=5", "batch=2"]))
    npz = tmp_path / "in.npz"
    np.savez(npz, ids=np.zeros((3, SEQ), np.float32))
    with pytest.raises(UserError, match=r"--inputs ids of shape \[3, 5\] sets batch=3 \(axis 0\), but --dim batch=2"):
        check_model(path, ShapeRequest(dims={"batch": 2, "sequence": SEQ}), npz)


# ---- the command lines: one line, exit 2 ---------------------------------------------------------------------

@pytest.mark.parametrize("main, extra", [(optimize_model_main, ["-o", "OUT", "--skip-graph"]),
                                         (bench_model_main, []), (graphopt_main, None)])
def test_refusals_on_every_command(main, extra, path, tmp_path, capsys):
    def run(*flags):
        argv = ["roundtrip", str(path)] if extra is None else [str(path), *[str(tmp_path / a) if a == "OUT" else a
                                                                           for a in extra]]
        return main(argv + list(flags))

    if main is not optimize_model_main:  # optimize-model builds for a range: tests/test_served.py
        assert run("--dim", "sequence=2:512") == 2
        assert "a range is for optimize-model" in _one_line_error(capsys)
    assert run("--dim", "batch=1", "--dim", "sequence=2:512", "--input-shape", "ids=1,600") == 2
    assert ("outside --dim sequence=2:512" if main is optimize_model_main else "a range is for optimize-model") \
        in _one_line_error(capsys)
    assert run("--dim", "seq=4") == 2
    assert "batch, sequence" in _one_line_error(capsys)
    assert run("--dim", "sequence=0") == 2
    assert "not positive" in _one_line_error(capsys)
    assert run("--dim", "batch=1,sequence=5", "--input-shape", "ids=1,6") == 2
    assert "--input-shape ids=1,6 sets sequence=6" in _one_line_error(capsys)
    assert run() == 2
    assert "--dim batch=N --dim sequence=N" in _one_line_error(capsys)


def test_roundtrip_with_dims(path, tmp_path, capsys):
    """graphopt roundtrip compares the exported graph with the input in onnxruntime at the --dim sizes."""
    out = tmp_path / "r.json"
    assert graphopt_main(["roundtrip", str(path), "--dim", "batch=2,sequence=5", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["outputs_equal"]


def test_help_names_dim(capsys):
    for main in (optimize_model_main, bench_model_main):
        with pytest.raises(SystemExit):
            main(["--help"])
        assert "--dim NAME=N" in capsys.readouterr().out


# ---- one build, end to end -------------------------------------------------------------------------------------

def test_optimize_with_dims_builds_every_input_and_records_them(path, tmp_path):
    import pipeline

    out = tmp_path / "built"
    built = pipeline.optimize(str(path), output=out, threads=1, skip_graph=True, dims={"batch": 2, "sequence": SEQ})
    report = json.loads((out / "report.json").read_text())
    assert report["dims"] == {"batch": 2, "sequence": SEQ}
    assert [i["shape"] for i in report["deploy"]["inputs"]] == [[2, SEQ], [2, SEQ], [1, SEQ]]
    rng = np.random.default_rng(1)
    feeds = {"ids": rng.standard_normal((2, SEQ)), "mask": rng.standard_normal((2, SEQ)),
             "scale": rng.standard_normal((1, SEQ))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    (ref,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = built.run(feeds)
    np.testing.assert_allclose(next(iter(got.values())), ref, rtol=1e-5, atol=1e-6)
