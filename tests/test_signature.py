"""What the deploy signature protects: everything the run depends on is under report.json's checksum (the CPU
features the code needs included), and a build specialized on an input's value checks that value in its own
compiled code, so an edited report.json with a recomputed checksum (or a plain TVM loader, which reads no
report) cannot run it on another value.  Also the loader's casts: a value the input's dtype cannot hold is
refused, not wrapped."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from graphopt.errors import UserError
from pipeline.artifact import REPORT, Model, TensorSpec, _cast, section_checksum
from tests.test_specialize import vad_like

X = np.random.default_rng(0).standard_normal((1, 600)).astype(np.float32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from pipeline.context import BuildContext, TuneOptions
    from pipeline.optimize_model import optimize_model

    work = tmp_path_factory.mktemp("signature")
    onnx.save(vad_like(), str(work / "vad.onnx"))
    np.savez(work / "in.npz", x=X, sr=np.array(8000, np.int64))
    ctx = BuildContext.create("llvm", threads=2, skip_graph=True, tuning=TuneOptions(skip=True, progress=False),
                              inputs=str(work / "in.npz"))
    optimize_model(str(work / "vad.onnx"), str(work / "out"), ctx)
    return work / "out"


def _edit(folder, change) -> None:
    """Edit report.json's deploy section and recompute its checksum, as someone who read the code could."""
    path = folder / REPORT
    report = json.loads(path.read_text())
    change(report["deploy"])
    report["deploy"]["checksum"] = section_checksum(report["deploy"])
    path.write_text(json.dumps(report))


def _copy(built, tmp_path):
    import shutil

    return shutil.copytree(built, tmp_path / "copy")


def test_the_built_value_is_checked_by_model_so_itself(built, tmp_path):
    folder = _copy(built, tmp_path)
    feeds = {"x": X, "sr": np.array(16000, np.int64)}
    with pytest.raises(UserError, match="built for sr=8000"):
        Model.load(folder).run(feeds)  # the loader's own check, from report.json
    _edit(folder, lambda dep: dep["inputs"][1].update(value=16000))
    with pytest.raises(UserError) as e:
        Model.load(folder).run(feeds)  # report.json now says 16000: model.so's assertion refuses it
    assert "\n" not in str(e.value) and "sr" in str(e.value) and "8000" in str(e.value)
    assert Model.load(built).run({"x": X, "sr": np.array(8000, np.int64)})  # its own value runs


def test_a_plain_tvm_loader_meets_the_same_check(built):
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(tvm.runtime.load_module(str(built / "model.so")), tvm.cpu())
    x = tvm.runtime.tensor(X)
    vm["main"](x, tvm.runtime.tensor(np.array(8000, np.int64)))
    with pytest.raises(AssertionError, match="8000"):
        vm["main"](x, tvm.runtime.tensor(np.array(16000, np.int64)))


def test_the_cpu_features_are_under_the_checksum(built, tmp_path):
    folder = _copy(built, tmp_path)
    report = json.loads((folder / REPORT).read_text())
    target = json.loads(report["deploy"]["target"])
    assert target["kind"] == "llvm"
    lacking = _a_feature_this_cpu_lacks()
    report["deploy"]["target"] = json.dumps(target | {"mattr": [f"+{lacking}"]})
    (folder / REPORT).write_text(json.dumps(report))
    with pytest.raises(UserError, match="checksum"):
        Model.load(folder)  # edited without the checksum: refused before anything loads
    _edit(folder, lambda dep: None)  # checksum recomputed: the features the code needs are still checked
    with pytest.raises(UserError, match="lacks"):
        Model.load(folder).run({"x": X, "sr": np.array(8000, np.int64)})


def _a_feature_this_cpu_lacks() -> str:
    from tvm.target import codegen

    from kerneltune.targets.host import llvm_target

    have = codegen.llvm_get_cpu_features(llvm_target(1))
    for feature in ("sse4a", "fma4", "xop", "avx512fp16", "amx-tile", "avx10.2-512"):  # AMD-only, Intel-only
        if feature not in have:
            return feature
    pytest.skip("this CPU has every candidate feature")


@pytest.mark.parametrize("dtype,value,ok", [
    ("int32", np.array(4294967298, np.int64), False),  # would wrap to 2
    ("int32", np.array(2, np.int64), True),
    ("int8", np.array([-1, 300], np.int16), False),
    ("float32", np.array([1e300]), False),
    ("float32", np.array([0.1, np.inf]), True),  # an infinity given stays one
])
def test_a_cast_keeps_every_value_or_is_refused(dtype, value, ok):
    spec = TensorSpec("sr", dtype, value.shape)
    if ok:
        np.testing.assert_array_equal(_cast(spec, value), value.astype(dtype))
    else:
        with pytest.raises(UserError, match="cannot represent"):
            _cast(spec, value)


def test_an_omitted_specialized_input_takes_its_value_without_the_random_warning(built, tmp_path, caplog):
    np.savez(tmp_path / "x.npz", x=X)
    with caplog.at_level("WARNING"):
        feeds = Model.load(built).read_inputs(tmp_path / "x.npz")
    assert int(feeds["sr"]) == 8000 and np.array_equal(feeds["x"], X)
    assert not any("random" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_the_value_guard_compiles_for_bool_and_tensor_inputs():
    """A bool input is compared as int8 (LLVM refused the i1 compare: every build specialized on a bool failed
    to compile); a tensor input is checked element by element."""
    import tvm
    from tvm import relax

    from pipeline.passes.value_guard import add_value_guards

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2,), "float32"))
    c = relax.Var("c", relax.TensorType((), "bool"))
    k = relax.Var("k", relax.TensorType((2,), "int32"))
    with bb.function("main", [x, c, k]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.add(x, x)))
        bb.emit_func_output(y)
    mod = add_value_guards(bb.get(), {"c": np.array(False), "k": np.array([3, 4], np.int32)})
    vm = relax.VirtualMachine(relax.build(relax.transform.LegalizeOps()(mod), "llvm"), tvm.cpu())
    args = [tvm.runtime.tensor(np.ones(2, np.float32))]
    good = [tvm.runtime.tensor(np.array(False)), tvm.runtime.tensor(np.array([3, 4], np.int32))]
    np.testing.assert_array_equal(vm["main"](*args, *good).numpy(), [2, 2])
    for bad in ([tvm.runtime.tensor(np.array(True)), good[1]],
                [good[0], tvm.runtime.tensor(np.array([3, 5], np.int32))]):
        with pytest.raises(AssertionError, match="built for"):
            vm["main"](*args, *bad)
