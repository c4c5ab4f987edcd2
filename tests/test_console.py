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

from graphopt import console

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
