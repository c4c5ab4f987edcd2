"""What every console script shares (graphopt.console, graphopt.errors): --version, -v/-q through logging,
progress bars only on a terminal, and a reader closing the pipe (`| head`) ends the command quietly.

The scripts are read from pyproject.toml's [project.scripts], so a new one is covered without editing this
file; each runs as a real subprocess of this checkout where the terminal or the pipe is what is tested."""
from __future__ import annotations

import fcntl
import logging
import os
import pty
import struct
import subprocess
import sys
import termios
import tomllib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import fresh_cache
from graphopt import console
from graphopt.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
BERT_TINY = ROOT / "models" / "bert_tiny.onnx"


def command(script: str, *args: str) -> list[str]:
    """The console script ``script`` of this checkout (not whatever is installed) with ``args``."""
    module, fn = SCRIPTS[script].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {fn}; sys.exit({fn}())", *args]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), TVM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return env


def entry(script: str):
    module, fn = SCRIPTS[script].split(":")
    return getattr(__import__(module, fromlist=[fn]), fn)


def test_every_console_script_prints_the_pyproject_version(capsys):
    assert set(SCRIPTS) >= {"optimize-model", "run-model", "bench-model", "tune-kernels", "graphopt"}
    wanted = PYPROJECT["project"]["version"]
    assert console.version() == wanted
    for script in SCRIPTS:
        with pytest.raises(SystemExit) as stop:
            entry(script)(["--version"])
        assert stop.value.code == 0
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"{script} {wanted} (tvm "), line
    with pytest.raises(SystemExit):  # a sub-command takes it too
        entry("graphopt")(["rules", "show", "--version"])
    assert capsys.readouterr().out.startswith(f"graphopt rules show {wanted}")


def test_every_console_script_lists_debug_in_its_help(capsys):
    """cli_entry takes --debug off the command line before parsing; --help must still say it exists (issue 43),
    and the option still works wherever it stands."""
    for script in SCRIPTS:
        with pytest.raises(SystemExit) as stop:
            entry(script)(["--help"])
        assert stop.value.code == 0
        assert "--debug" in capsys.readouterr().out, script
    with pytest.raises(SystemExit):
        entry("graphopt")(["optimize", "--help"])
    assert "--debug" in capsys.readouterr().out
    with pytest.raises(UserError):  # re-raised, not reduced to one line: --debug still reaches cli_entry
        entry("run-model")(["--debug", "--repeat", "0", "nowhere"])


def _closed_pipe_run(args: list[str]) -> subprocess.CompletedProcess:
    """``args`` with stdout a pipe nobody reads any more (what `| head` leaves after its lines)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(args, stdout=write, stderr=subprocess.PIPE, text=True, env=environment(), timeout=300)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [("graphopt", "rules", "show"), ("tune-kernels", str(BERT_TINY), "--list"),
                                  ("run-model", "--help")] + [(s, "--version") for s in
                                                             ("optimize-model", "bench-model", "graphopt")],
                         ids=lambda a: " ".join(Path(x).name for x in a))
def test_a_closed_pipe_ends_the_command_quietly(args):
    p = _closed_pipe_run(command(*args))
    assert p.returncode == 0 and "Error" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-1500:]


def test_verbosity_levels_reach_our_loggers_only(capsys):
    """-v shows log.info of our packages, -vv debug, -q errors only; other libraries stay at warnings."""
    parser = __import__("graphopt.errors", fromlist=["ArgumentParser"]).ArgumentParser(prog="x")
    ours, theirs = logging.getLogger("pipeline.somewhere"), logging.getLogger("someone.else")
    try:
        for flags, shown in (([], {"warning", "error"}), (["-v"], {"info", "warning", "error"}),
                             (["-vv"], {"debug", "info", "warning", "error"}), (["-q"], {"error"})):
            parser.parse_args(flags)
            capsys.readouterr()
            for level in ("debug", "info", "warning", "error"):
                getattr(ours, level)("%s line", level)
            theirs.info("not ours")
            err = capsys.readouterr().err
            assert {w for w in ("debug", "info", "warning", "error") if f"{w} line" in err} == shown, (flags, err)
            assert "not ours" not in err
    finally:
        parser.parse_args([])  # the default levels for the tests that follow


def _mlp(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_optimize_model_stage_lines_with_v_and_silence_with_q(tmp_path, capsys):
    main = entry("optimize-model")
    model = _mlp(tmp_path / "m.onnx")
    try:
        assert main([str(model), "--skip-graph", "--threads", "1", "-o", str(tmp_path / "a"), "-v"]) == 0
        err = capsys.readouterr().err
        assert "partition stage:" in err and "compile stage:" in err, err
        assert main([str(model), "--skip-graph", "--threads", "1", "-o", str(tmp_path / "b"), "-q"]) == 0
        captured = capsys.readouterr()
        assert "stage:" not in captured.err and "wrote" in captured.out  # the result line stays
    finally:
        console.configure(0)


def test_progress_bars_only_on_a_terminal(tmp_path):
    """stderr redirected to a file: not one carriage-return redraw; the same command on a terminal draws
    its bar (the control that the command does show one)."""
    model = _mlp(tmp_path / "m.onnx")
    args = command("graphopt", "optimize", str(model), "-o", str(tmp_path / "o.onnx"), "--cost", "analytic")
    log = tmp_path / "stderr.txt"
    with open(log, "w") as f:
        p = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=f, env=environment(), timeout=300)
    text = log.read_text()
    assert p.returncode == 0 and "\r" not in text and "graph search" not in text, text[-1000:]

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # tqdm draws nothing 0 wide
    try:
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=follower, env=environment())
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert p.wait(timeout=300) == 0
    finally:
        os.close(leader)
    drawn = b"".join(chunks).decode(errors="replace")
    assert "graph search" in drawn and "\r" in drawn, drawn[-1000:]


# ---- TVM's own output (issue 25 item 3): its importer's Python warnings and native log lines ---------------
def _save(nodes, inputs, outputs, inits, path: Path, opset: int = 17) -> Path:
    g = helper.make_graph(nodes, path.stem, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _if_model(path: Path) -> Path:
    """An If whose branches read the outer ``x``: the ONNX checker TVM's importer runs warns about it, and
    the importer's BlockBuilder logs "destroyed with remaining blocks!" natively."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    branch = {k: helper.make_graph([helper.make_node(op, ["x"], [k])], k, [],
                                   [helper.make_tensor_value_info(k, TensorProto.FLOAT, [2, 3])])
              for k, op in (("then_branch", "Relu"), ("else_branch", "Neg"))}
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0), helper.make_node("Greater", ["s", "z"], ["c"]),
             helper.make_node("If", ["c"], ["y"], **branch)]
    return _save(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                 [numpy_helper.from_array(np.float32(0), "z")], path)


def _dotted_names_model(path: Path) -> Path:
    """PyTorch's names: TVM's importer warns "Renaming name input.1 to input_1"."""
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["input.1", "w"], ["m"]), helper.make_node("Relu", ["m"], ["out.1"])]
    return _save(nodes, [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [2, 8])],
                 [helper.make_tensor_value_info("out.1", TensorProto.FLOAT, [2, 8])], [w], path)


def _conv_and_gather_model(path: Path) -> Path:
    """A conv (so the layout stage runs) whose output is indexed by a Gather, as ViT's q/k/v split: the
    layout stage's FoldConstant legalizes every Gather, and TOPI's fast take warned natively ("Fast mode
    segfaults when there are out-of-bounds indices") each time, 74 lines on ViT-B/16."""
    w = numpy_helper.from_array(np.random.default_rng(2).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    rows = numpy_helper.from_array(np.array([0, 2], np.int64), "rows")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Gather", ["c", "rows"], ["y"], axis=1)]
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])], [w, rows], path)


# One model keeps the check in CI (each run is a whole graph stage on a fresh cost cache, ~30 s for the
# bigger two); the other two run with -m slow.
@pytest.mark.parametrize("make", [_if_model, pytest.param(_dotted_names_model, marks=pytest.mark.slow),
                                  pytest.param(_conv_and_gather_model, marks=pytest.mark.slow)],
                         ids=["if", "dotted-names", "conv-gather"])
def test_tvm_importer_output_stays_off_stderr_of_a_successful_run(make, tmp_path):
    """The graph stage (a fresh cost cache: each operator imported alone) and the build, both quiet."""
    model = make(tmp_path / "m.onnx")
    env = environment() | {"OPTIMIZE_MODEL_CACHE": str(fresh_cache(tmp_path / "cache"))}
    p = subprocess.run(command("optimize-model", str(model), "-o", str(tmp_path / "out"), "-q"), capture_output=True,
                       text=True, env=env, timeout=600)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-2000:]


def test_tvm_importer_warnings_are_logged_at_v(tmp_path, caplog):
    from pipeline.relax_import import import_model

    with caplog.at_level(logging.INFO, logger="pipeline.relax_import"):
        import_model(str(_dotted_names_model(tmp_path / "m.onnx")))
    assert "Renaming name input.1 to input_1" in caplog.text


def test_tvm_importer_refusal_is_one_stderr_line(tmp_path):
    """A 2-D Resize, which onnxruntime runs and TVM's importer asserts against; its BlockBuilder's native
    "destroyed with remaining blocks!" came before and after the error line."""
    resize = helper.make_node("Resize", ["x", "", "s"], ["y"], mode="nearest")
    model = _save([resize], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 12])],
                  [numpy_helper.from_array(np.array([1, 2], np.float32), "s")], tmp_path / "m.onnx", opset=18)
    env = environment() | {"OPTIMIZE_MODEL_CACHE": str(fresh_cache(tmp_path / "cache"))}
    p = subprocess.run(command("optimize-model", str(model), "-o", str(tmp_path / "out")), capture_output=True,
                       text=True, env=env, timeout=600)
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert lines[0].startswith("error: TVM's ONNX importer rejected the model at its Resize node"), lines[0]
