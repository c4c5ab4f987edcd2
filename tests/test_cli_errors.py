"""Bad input to the console scripts: one line on stderr naming the problem and the fix, exit 2, no traceback.

Each case runs the installed console script (or ``python -m``) in a subprocess, as a user would.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BERT_TINY = ROOT / "models" / "bert_tiny.onnx"


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    # PYTHONPATH: the installed console scripts import this checkout, not whichever one the venv points at
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"PATH": str(BIN), "TVM_NUM_THREADS": "1", "HOME": str(ROOT), "PYTHONPATH": str(ROOT)})


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in err.splitlines() if not ln.startswith("[")]  # TVM's C++ warnings start with [time]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "notonnx.onnx").write_text("this is not a protobuf\n" * 20)
    data = BERT_TINY.read_bytes()
    (d / "truncated.onnx").write_bytes(data[: len(data) // 3])
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.COMPLEX64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.COMPLEX64, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(d / "complex.onnx"))
    return d


@pytest.mark.parametrize("script", ["optimize-model", "bench-model"])
def test_missing_file(script, tmp_path):
    extra = ["-o", str(tmp_path / "o")] if script == "optimize-model" else []
    assert_user_error(run([str(BIN / script), str(tmp_path / "nope.onnx"), *extra]), "does not exist")


def test_not_onnx(files, tmp_path):
    assert_user_error(run([str(BIN / "optimize-model"), str(files / "notonnx.onnx"), "-o", str(tmp_path)]),
                      "not", "onnx")


def test_truncated(files, tmp_path):
    assert_user_error(run([str(BIN / "bench-model"), str(files / "truncated.onnx")]), "truncated.onnx")


@pytest.mark.parametrize("script", ["optimize-model", "bench-model"])
def test_unknown_target(script, tmp_path):
    extra = ["-o", str(tmp_path / "o")] if script == "optimize-model" else []
    assert_user_error(run([str(BIN / script), str(BERT_TINY), "--target", "vulkan", *extra]),
                      "unknown target", "llvm")


def test_unsupported_dtype(files, tmp_path):
    assert_user_error(run([str(BIN / "optimize-model"), str(files / "complex.onnx"), "-o", str(tmp_path)]),
                      "complex64", "not supported")


def test_unknown_model_name(tmp_path):
    assert_user_error(run([sys.executable, "-m", "models", "build", "bert-huge", "-o", str(tmp_path / "m.onnx")]),
                      "bert-huge")


def test_bad_option_is_one_line(tmp_path):
    assert_user_error(run([str(BIN / "optimize-model"), str(BERT_TINY), "-o", str(tmp_path), "--scheduler", "fifo"]),
                      "scheduler")


def test_an_interrupt_inside_a_constructor_prints_one_line_not_the_destructors_traceback(tmp_path):
    """A Ctrl-C (or the SIGTERM handler's KeyboardInterrupt) that lands inside a library's constructor leaves
    a half-built object whose destructor fails later (TVM's TempDirectory: no ``temp_dir`` yet).  The user
    sees the one interrupt line and exit 130, not "Exception ignored in ..." with a traceback."""
    script = tmp_path / "interrupted.py"
    script.write_text(
        "import sys\n"
        "from graphopt.errors import cli_entry\n"
        "class Temp:\n"
        "    def __init__(self):\n"
        "        raise KeyboardInterrupt  # before self.path is set\n"
        "    def __del__(self):\n"
        "        print(self.path)\n"
        "def main(argv):\n"
        "    Temp()\n"
        "sys.exit(cli_entry(main)([]))\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 130
    assert p.stderr.strip() == "error: interrupted; tuning records written so far are kept, rerun to resume"
