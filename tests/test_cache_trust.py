"""The per-CPU caches are never required and never trusted (issue "trust round 4"): an entry of the wrong type
or range is ignored by every reader and flushed away, a special file is never opened, an unusable folder
leaves the build in memory with one warning naming ``$OPTIMIZE_MODEL_CACHE``, an empty variable means the
default folder; and an unknown ``$OPTIMIZE_MODEL_POOL`` is warned about, not ignored silently."""
from __future__ import annotations

import ctypes.util
import errno
import json
import logging
import math
import os
import signal
import stat
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from graphopt.cost import cache as cost_cache
from graphopt.cost.cache import CostCache, cache_dir
from test_console import BERT_TINY, command, environment

# What JSON can hold where a number belongs, and numbers no cache stores (a negative or infinite time).
POISON = ["abc", math.nan, [1.0], {"s": 1.0}, True, -1.0, math.inf]
POSIX_ONLY = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch, caplog):
    """A cache folder of the test's own, the once-per-process warning not given yet, warnings captured."""
    monkeypatch.setenv("OPTIMIZE_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost_cache, "_warned", False, raising=False)
    caplog.set_level(logging.WARNING)


def _poison(path: Path, good: dict[str, float] | None = None, keys: list[str] | None = None) -> None:
    """Write ``path`` with each of ``keys`` (default: one per poison) holding a poison, beside ``good``."""
    keys = keys or [f"bad{i}" for i in range(len(POISON))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**{k: POISON[i % len(POISON)] for i, k in enumerate(keys)}, **(good or {})}))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


class Blocked(Exception):
    """Not an OSError (TimeoutError is one): code that shrugs off a failed read must not swallow it."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: a blocked open() of a FIFO is interrupted by SIGALRM."""
    def expire(signum, frame):
        raise Blocked(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---- entries of the wrong type or range -------------------------------------------------------------------

def test_bad_entries_are_ignored_and_a_flush_writes_the_file_without_them(tmp_path):
    from graphopt.cost.cache import flag

    path = tmp_path / "cost.json"
    _poison(path, {"t": 2e-3, "verdict": 0.5})
    cache = CostCache(path)
    assert [cache.get(f"bad{i}") for i in range(len(POISON))] == [None] * len(POISON)
    assert cache.get("t") == 2e-3
    assert cache.get("verdict", flag) is None  # a number, but not the shape its reader expects
    cache.put("new", 1e-3)
    cache.flush()
    assert json.loads(path.read_text()) == {"new": 1e-3, "t": 2e-3}


@pytest.mark.parametrize("bad", [*POISON, 2.5, 0.0], ids=repr)
def test_a_calibration_of_the_wrong_shape_is_measured_again(bad, tmp_path, monkeypatch):
    from kerneltune import calibrate
    from kerneltune.targets.host import host_cpu, llvm_target

    target = llvm_target(1)
    path = tmp_path / "cache" / f"calibration-{host_cpu()}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({f"v{calibrate.VERSION}|fact|{calibrate.target_key(target)}": bad}))
    monkeypatch.setattr(calibrate, "_VALUES", {})
    assert calibrate.calibrated("fact", target, 1, lambda t: 3) == 3


def test_a_poisoned_machine_probe_is_measured_again(tmp_path):
    from graphopt.cost.analytic import measure_machine

    path = tmp_path / "cache" / "machine.json"
    _poison(path, keys=["peak_flops", "bandwidth"])
    rates = measure_machine()
    assert all(isinstance(v, float) and 0 < v < math.inf for v in rates.values()), rates
    assert json.loads(path.read_text()) == rates


def test_a_poisoned_graph_stage_verdict_is_not_replayed(tmp_path):
    from graphopt.cost.runners import OrtRunner
    from graphopt.cost.measured import MeasuredCost
    from graphopt.ir import Graph, Node, TensorInfo
    from graphopt.stage import check_end_to_end
    from graphopt.verdicts import VerdictStore

    def graph(op: str) -> Graph:
        x, y = TensorInfo("x", "float32", (4,)), TensorInfo("y", "float32", (4,))
        return Graph(nodes=[Node(op, ["x"], ["y"], name="n")], inputs=[x], outputs=[y])

    original, candidate = graph("Relu"), graph("Identity")
    path, verdicts = tmp_path / "cost.json", tmp_path / "verdicts.json"
    prices = f"kernels2|{original.structural_hash()}|{candidate.structural_hash()}"
    _poison(path, keys=[f"{prices}|0", f"{prices}|1"])
    cost = MeasuredCost(OrtRunner(1), path=path, verdicts=VerdictStore(verdicts))
    key = cost.verdicts.key(original.structural_hash(), candidate.structural_hash())
    for poison in [*POISON, [], [1.0, 1.0], [1.0, 1.0, -0.5], [1.0, 1.0, *[0.9] * 8], [1.0, "x", 0.9]]:
        verdicts.write_text(json.dumps({key: poison}))
        cost = MeasuredCost(OrtRunner(1), path=path, verdicts=VerdictStore(verdicts))
        assert cost.kernel_times([original, candidate]) is None  # onnxruntime's: the poisoned prices are not used
        check = check_end_to_end(original, candidate, cost, {"rule": 1}, deadline=time.perf_counter() - 1)
        assert check.status == "skipped: time limit", poison  # measured again (no time left), not "recorded"
    # the same key holding evidence is replayed with today's margin, without timing
    verdicts.write_text(json.dumps({key: [2.0, 1.0, 0.5, 0.5, 0.5]}))
    cost = MeasuredCost(OrtRunner(1), path=path, verdicts=VerdictStore(verdicts))
    check = check_end_to_end(original, candidate, cost, {"rule": 1}, deadline=time.perf_counter() - 1)
    assert (check.status, check.kept, check.ratios) == ("recorded", "optimized", (0.5, 0.5, 0.5))


def test_poisoned_layout_prices_and_verdicts_are_measured_again(tmp_path, monkeypatch):
    from kerneltune.targets.parse import parse_target
    from graphopt.verdicts import VerdictStore
    from pipeline.layout.cost import VERSION, Pricer

    path = tmp_path / "layout.json"
    _poison(path, keys=[f"v{VERSION}|transform|1x16x4x4|nchw>8c"])
    _poison(tmp_path / "verdicts.json", keys=["layout|k"])
    pricer = Pricer(parse_target("llvm", 1), path=path, verdicts=VerdictStore(tmp_path / "verdicts.json"))
    monkeypatch.setattr(pricer, "_time", lambda mod: 4e-6)
    assert pricer.transform((1, 16, 4, 4), None, 8) == 4e-6
    assert pricer.verdicts.store.recall("layout|k") is None


def test_poisoned_kernel_prices_are_measured_again(tmp_path, monkeypatch):
    from kerneltune.targets.parse import parse_target
    from pipeline.pricing import kernel_price

    path = tmp_path / "kernels.json"
    _poison(path)
    pricer = kernel_price.KernelPricer(parse_target("llvm", 1), path=path)
    monkeypatch.setattr(kernel_price, "time_cold", lambda func, spec: 5e-6)
    price = kernel_price.GraphPrice()
    assert [pricer._seconds(f"bad{i}", None, price) for i in range(len(POISON))] == [5e-6] * len(POISON)
    assert price.measured == len(POISON)


# ---- special files, unusable folders -------------------------------------------------------------------

@POSIX_ONLY
def test_a_fifo_is_never_opened_nor_replaced(tmp_path, caplog):
    path = tmp_path / "cost.json"
    os.mkfifo(path)
    with _deadline(10):
        cache = CostCache(path)
        cache.put("t", 1e-3)
        cache.flush()
    assert cache.get("t") == 1e-3 and stat.S_ISFIFO(os.stat(path).st_mode)  # in memory only
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(path) in warnings[0] and "OPTIMIZE_MODEL_CACHE" in warnings[0], warnings


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC], ids=errno.errorcode.get)
def test_a_folder_that_cannot_be_written_is_warned_about_once(code, tmp_path, monkeypatch, caplog):
    from graphopt import fileio

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fileio.tempfile, "mkstemp", refuse)  # as a read-only folder or a full disk answers
    caches = [CostCache(tmp_path / name) for name in ("a.json", "b.json")]
    for cache in caches:
        cache.put("t", 1e-3)
        cache.flush()
        assert cache.get("t") == 1e-3
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(tmp_path / "a.json") in warnings[0] and "OPTIMIZE_MODEL_CACHE" in warnings[0]
    assert os.strerror(code) in warnings[0]


@pytest.mark.parametrize("make", [lambda p: p.write_text("x"), lambda p: p.symlink_to(p)], ids=["file", "loop"])
def test_a_cache_folder_that_is_not_a_folder_is_warned_about(make, tmp_path, caplog):
    folder = tmp_path / "cache"
    make(folder)
    cache = CostCache(folder / "cost.json")
    cache.put("t", 1e-3)
    cache.flush()
    assert cache.get("t") == 1e-3
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(folder) in warnings[0] and "OPTIMIZE_MODEL_CACHE" in warnings[0], warnings


def test_an_empty_cache_variable_means_the_default_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_MODEL_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "optimize-model"
    monkeypatch.setenv("OPTIMIZE_MODEL_CACHE", "relative")
    monkeypatch.chdir(tmp_path)
    cache = CostCache(cache_dir() / "cost.json")
    cache.put("t", 1e-3)
    cache.flush()
    assert json.loads((tmp_path / "relative" / "cost.json").read_text()) == {"t": 1e-3}


# ---- OPTIMIZE_MODEL_POOL ----------------------------------------------------------------------------------

def test_an_unknown_pool_value_is_warned_about_once(monkeypatch, caplog):
    from pipeline import cpu_pool

    libc = Path(ctypes.util.find_library("c"))  # a library without the launcher: install() changes nothing
    for value in ("", "tvm", "TVM", "own", "native"):
        monkeypatch.setenv("OPTIMIZE_MODEL_POOL", value)
        assert not cpu_pool.install(libc, 1)
    assert _warnings(caplog) == []
    monkeypatch.setenv("OPTIMIZE_MODEL_POOL", "garbage-trust-round-4")
    cpu_pool.install(libc, 1)
    cpu_pool.install(libc, 1)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "OPTIMIZE_MODEL_POOL" in warnings[0] and "tvm" in warnings[0], warnings
    assert "garbage-trust-round-4" in warnings[0]


# ---- end to end ----------------------------------------------------------------------------------------

def test_a_build_succeeds_with_a_poisoned_cache_folder_and_a_fifo(tmp_path, monkeypatch):
    """Every cache file a first build leaves (--skip-graph: the calibrations), each entry poisoned, plus a FIFO
    named as a cache file: the next build (a process of its own, so a hang is a timeout) neither fails nor
    hangs, leaves the files it read clean and the FIFO a FIFO (test_a_fifo_is_never_opened_nor_replaced has a
    reader meet one)."""
    from kerneltune import calibrate
    from pipeline.cli import optimize_model_main

    folder = tmp_path / "cache"
    # one thread in both builds: the calibrations are keyed by it, so the second reads what the first wrote
    args = [str(BERT_TINY), "--target", "llvm", "--threads", "1", "--skip-graph", "--skip-tune", "--no-progress",
            "-o"]
    monkeypatch.setattr(calibrate, "_VALUES", {})  # this process's calibrations are not the folder's
    assert optimize_model_main([*args, str(tmp_path / "first")]) == 0
    files = sorted(folder.glob("*.json"))
    assert files
    for path in files:
        _poison(path, keys=list(json.loads(path.read_text())))
    fifo = folder / "machine.json"
    if hasattr(os, "mkfifo"):
        os.mkfifo(fifo)
    second = subprocess.run(command("optimize-model", *args, str(tmp_path / "second")), capture_output=True,
                            text=True, env=environment() | {"OPTIMIZE_MODEL_CACHE": str(folder)}, timeout=240)
    assert second.returncode == 0, second.stderr[-2000:]
    assert not hasattr(os, "mkfifo") or stat.S_ISFIFO(os.stat(fifo).st_mode)
    for path in files:
        entries = json.loads(path.read_text())
        assert entries and all(isinstance(v, float) and math.isfinite(v) for v in entries.values()), entries
