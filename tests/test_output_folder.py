"""The -o folder has one writer and changes in one step (issue 25).

Two optimize-model runs into one folder: the second is refused at once, naming the folder and the first's
PID.  A run killed with SIGTERM at any moment leaves the previous build or its own, each complete (run-model
--check accepts it), and no temporary file beside or in the folder.  Files of the user's in the folder are
kept (the tuning records too); stale build files and a killed writer's temporaries are not.  A model whose
file name is not UTF-8 builds, and the reports name it readably.  The builds are real (tiny models)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper as h

import bad_inputs as B
from graphopt import fileio
from graphopt.errors import UserError
from pipeline.cli import optimize_model_main, run_model_main

BUILD = ["model.so", "optimized.onnx", "report.json", "report.md"]


@pytest.fixture(scope="module")
def old_build(tmp_path_factory) -> Path:
    """A complete build of a 4x8 Relu: the previous good build a new run must not lose."""
    from pipeline.context import BuildContext
    from pipeline.optimize_model import optimize_model

    d = tmp_path_factory.mktemp("old")
    optimize_model(B.save(B.relu((4, 8)), d, "old.onnx"), str(d / "build"),
                   BuildContext.create(threads=1, skip_graph=True))
    return d / "build"


def _start(model: str, out: Path) -> subprocess.Popen:
    """optimize-model as the user runs it, in its own process."""
    cmd = B.command_line("optimize-model", [model, "-o", str(out), "--skip-graph", "--no-progress", "--threads", "1"])
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=B.environment())


def _checked(out: Path, scratch: Path) -> str:
    """The model a complete build in ``out`` was built from, after run-model --check accepted it (on a copy at
    a new path: the process loads each model.so once per path)."""
    assert sorted(p.name for p in out.iterdir()) == BUILD
    copy = scratch / f"check-{time.monotonic_ns()}"
    shutil.copytree(out, copy)
    assert run_model_main([str(copy), "--check", "--repeat", "1"]) == 0
    return json.loads((out / "report.json").read_text())["model"]


def _entries(d: Path) -> set[str]:
    with contextlib.suppress(FileNotFoundError):
        return set(os.listdir(d))
    return set()


def _weighty() -> onnx.ModelProto:
    """One MatMul with 8 MB of weights: compiled in seconds, written in a few tenths (optimized.onnx and
    model.so each hold the weights), which gives the kills a window to land in."""
    w = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    return B.model([h.make_node("MatMul", ["x", "w"], ["y"])], [B.vi("x", [1, 2048])], [B.vi("y", [1, 1024])],
                   [B.init("w", w)])


def _kill_when(p: subprocess.Popen, out: Path, delay: float, on_write: bool) -> None:
    """SIGTERM ``delay`` s after the start or, ``on_write``, after the run first changes the folder or what
    is beside it (other than its write probe and lock file, made before the work): the moment the results
    are being written."""
    before, beside = _entries(out), _entries(out.parent)
    deadline = time.monotonic() + 120
    while on_write and p.poll() is None and time.monotonic() < deadline:
        changed = (_entries(out) ^ before) | (_entries(out.parent) ^ beside)
        if any(".write-probe." not in n and not n.endswith(".lock") for n in changed):
            break
        time.sleep(0.001)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(signal.SIGTERM)


def test_sigterm_at_any_moment_leaves_the_old_build_or_the_new_one(old_build, tmp_path):
    new = B.save(_weighty(), tmp_path, "new.onnx")
    old = json.loads((old_build / "report.json").read_text())["model"]
    work = tmp_path / "work"
    out = work / "build"
    rng = random.Random(25)
    seen = []
    for i in range(3):  # 2 kills while the results are written (0.2-0.3 s), 1 at any moment of the 7 s run
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        shutil.copytree(old_build, out)
        p = _start(new, out)
        on_write = i != 2
        _kill_when(p, out, rng.uniform(0, 0.25) if on_write else rng.uniform(0, 7), on_write)
        _, err = p.communicate(timeout=120)
        assert p.returncode in (0, 130, -signal.SIGTERM), err[-2000:]
        assert "Traceback" not in err, err[-2000:]
        assert _entries(work) == {"build"}, (i, err[-2000:])  # no staging folder, no lock file left
        built = _checked(out, tmp_path)
        assert built in (old, new)
        seen.append((p.returncode, built == new))
    assert any(rc != 0 for rc, _ in seen), seen  # some kills landed during the run


def test_a_second_run_into_a_folder_being_written_is_refused_at_once(old_build, tmp_path, capsys):
    first_model = B.save(B.relu((2, 3)), tmp_path, "first.onnx")
    out = tmp_path / "build"
    first = _start(first_model, out)
    try:
        deadline = time.monotonic() + 60
        while first.poll() is None and not any(n.endswith(".lock") for n in _entries(tmp_path)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        rc = optimize_model_main([B.save(B.relu((3, 5)), tmp_path, "second.onnx"), "-o", str(out), "--skip-graph",
                                  "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert f"-o {str(out)!r} is being written by another run (PID {first.pid})" in err[0]
        assert time.monotonic() - t0 < 10
        assert first.wait(timeout=120) == 0, first.stderr.read()[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert _checked(out, tmp_path) == first_model  # the first run's build, whole
    assert _entries(tmp_path) == {"build", "first.onnx", "second.onnx"} | {p.name for p in tmp_path.glob("check-*")}


def test_a_killed_writers_lock_and_staging_folder_do_not_stay(tmp_path):
    out = tmp_path / "build"
    code = ("import os, signal, sys; from graphopt.fileio import lock_output_dir\n"
            "with lock_output_dir(sys.argv[1]) as folder, folder.replace(()) as new:\n"
            "    (new / 'half').write_text('x'); os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code, str(out)], env=B.environment(), capture_output=True, timeout=60)
    assert p.returncode == -signal.SIGKILL and len(_entries(tmp_path)) == 2, (p.stderr, _entries(tmp_path))
    with fileio.lock_output_dir(out) as folder:  # the dead run's lock does not block, its staging is removed
        assert _entries(tmp_path) == {".build.optimize-model.lock"}
        with folder.replace(()) as new:
            (new / "report.json").write_text("{}")
    assert _entries(tmp_path) == {"build"} and _entries(out) == {"report.json"}


def test_the_users_files_stay_and_stale_build_files_go(tmp_path, monkeypatch):
    """Also where the filesystem cannot exchange two names in one call (NFS): the fallback renames."""
    out = tmp_path / "build"
    out.mkdir()
    os.chmod(out, 0o750)
    for name in ("notes.txt", "records.jsonl", "tuning.png", "model.so", ".model.k3j_0abc.so"):
        (out / name).write_text(name)
    records = os.stat(out / "records.jsonl").st_ino
    with fileio.lock_output_dir(out) as folder:
        with folder.replace(("model.so", "tuning.png")) as new:
            (new / "model.so").write_text("new")
    assert _entries(out) == {"notes.txt", "records.jsonl", "model.so"} and (out / "model.so").read_text() == "new"
    assert os.stat(out / "records.jsonl").st_ino == records and os.stat(out).st_mode & 0o777 == 0o750
    assert _entries(tmp_path) == {"build"}

    def unsupported(a, b):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fileio, "_rename_exchange", unsupported)
    with fileio.lock_output_dir(out) as folder:
        with folder.replace(("model.so",)) as new:
            (new / "model.so").write_text("newer")
    assert _entries(out) == {"notes.txt", "records.jsonl", "model.so"} and (out / "model.so").read_text() == "newer"
    assert _entries(tmp_path) == {"build"}


def test_a_failed_write_names_the_folder_and_changes_nothing(old_build, tmp_path):
    out = tmp_path / "build"
    shutil.copytree(old_build, out)
    with pytest.raises(UserError, match=f"^no space left on {out}: model.so was not written"):
        with fileio.lock_output_dir(out) as folder, folder.replace(()) as new:
            with fileio.atomic_path(new / "model.so"):
                raise OSError(errno.ENOSPC, "No space left on device")
    assert _entries(tmp_path) == {"build"} and _entries(out) == set(BUILD)


def test_a_model_name_that_is_not_utf8_builds_and_is_named_readably(old_build, tmp_path, capsys):
    from pipeline.context import BuildContext
    from pipeline.optimize_model import optimize_model

    src = B.save(B.relu((2, 3)), tmp_path, os.fsdecode(b"m\xff.onnx"))
    out = tmp_path / "build"
    shutil.copytree(old_build, out)
    assert optimize_model_main([src, "-o", str(out), "--skip-graph", "--no-progress"]) == 0, capsys.readouterr().err
    shown = f"{tmp_path}/m\\xff.onnx"
    assert json.loads((out / "report.json").read_bytes().decode("utf-8"))["model"] == shown
    assert f"# optimize-model: {shown} on llvm" in (out / "report.md").read_bytes().decode("utf-8")
    assert _checked(out, tmp_path) == shown
    odd = tmp_path / os.fsdecode(b"build\xfe")  # a folder of such a name too (staged beside it, swapped)
    shutil.copytree(old_build, odd)
    optimize_model(src, str(odd), BuildContext.create(threads=1, skip_graph=True))
    assert _checked(odd, tmp_path) == shown
