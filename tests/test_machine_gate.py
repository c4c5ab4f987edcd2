"""kerneltune.machine_gate: builds side by side, measurements alone; and the process-wide redirections a build
makes stay right when two builds interleave them."""
import os
import signal
import threading
import time

import numpy as np
import pytest

from kerneltune import machine_gate as gate
from kerneltune.native_log import quiet_native_stderr


def _fd2() -> tuple[int, int]:
    st = os.fstat(2)
    return st.st_dev, st.st_ino


def test_a_measurement_waits_for_other_builds_and_holds_new_ones_back():
    log: list[str] = []
    started, release = threading.Event(), threading.Event()

    def build_a():
        with gate.building():
            log.append("a starts")
            started.set()
            release.wait(5)
            log.append("a ends")

    def measure():
        with gate.measuring():
            log.append("measure")
            time.sleep(0.05)
            log.append("measure done")

    def build_b():
        time.sleep(0.02)  # asks while the measurement waits for a: starts after the measurement
        with gate.building():
            log.append("b starts")

    a = threading.Thread(target=build_a)
    a.start()
    started.wait(5)
    m, b = threading.Thread(target=measure), threading.Thread(target=build_b)
    m.start()
    time.sleep(0.05)
    assert log == ["a starts"]  # the measurement has not begun beside a
    b.start()
    release.set()
    for t in (a, m, b):
        t.join(5)
    assert log == ["a starts", "a ends", "measure", "measure done", "b starts"]


def test_a_measurement_inside_code_generation_is_refused():
    with gate.building():
        with pytest.raises(RuntimeError):
            with gate.measuring():
                pass
    with gate.measuring():  # nothing left counted as building
        pass


def test_builds_that_measure_while_another_generates_code_do_not_deadlock():
    """Each build: its Python side under the lock, a calibration there, then code generation unlocked."""
    done = []

    def build(name):
        for _ in range(3):
            with gate.serial():
                time.sleep(0.005)
                with gate.measuring():
                    time.sleep(0.005)
            with gate.building():
                time.sleep(0.01)
        done.append(name)

    gate.build_concurrently([lambda n=n: build(n) for n in "abcd"])
    assert sorted(done) == list("abcd")


def test_build_concurrently_keeps_order_raises_a_failure_and_restores_sigint():
    handler = signal.getsignal(signal.SIGINT)
    assert gate.build_concurrently([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]

    def fails():
        raise ValueError("bad build")
    with pytest.raises(ValueError, match="bad build"):
        gate.build_concurrently([lambda: 1, fails])
    assert signal.getsignal(signal.SIGINT) is handler


def test_batches_are_built_only_once_the_last_ones_results_are_taken():
    started: list[int] = []

    def build(i):
        def run():
            started.append(i)
            return i
        return run

    results = gate.built_in_batches([build(i) for i in range(5)], 2)
    assert next(results) == 0 and sorted(started) == [0, 1]  # the first batch only
    assert next(results) == 1 and sorted(started) == [0, 1]
    assert list(results) == [2, 3, 4] and sorted(started) == [0, 1, 2, 3, 4]


def test_interleaved_quiet_stderr_leaves_fd2_where_it_was():
    """Two threads silencing fd 2 with overlapping spans (first in, first out): each saving and restoring its
    own copy left fd 2 on /dev/null."""
    before = _fd2()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    inside_b_after_a: list[tuple[int, int]] = []

    def a():
        with quiet_native_stderr():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with quiet_native_stderr():
            b_in.set()
            a_out.wait(5)
            inside_b_after_a.append(_fd2())

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start(), tb.start()
    ta.join(5), tb.join(5)
    assert inside_b_after_a and inside_b_after_a[0] != before  # still silenced while b is inside
    assert _fd2() == before


def test_tvm_runner_builds_whole_models_side_by_side(tmp_path):
    """Two models built at once by the TVM runner (the end-to-end check's path) each compute what
    onnxruntime computes."""
    pytest.importorskip("tvm")
    from graphopt.cost.runners import timing_feeds
    from graphopt.ir import Graph, Node, TensorInfo
    from graphopt.onnx_io import export_onnx
    from pipeline.pricing.graph_runner import TvmRunner
    from pipeline.stages import compile_graph, compile_model

    def graph(op: str) -> Graph:
        w = np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32)
        return Graph(nodes=[Node("MatMul", ["x", "w"], ["m"], name="mm"), Node(op, ["m"], ["y"], name="act")],
                     inputs=[TensorInfo("x", "float32", (8, 16))], outputs=[TensorInfo("y", "float32", (8, 16))],
                     initializers={"w": w}, opset_imports={"": 17})

    graphs = [graph("Relu"), graph("Sigmoid")]
    runner = TvmRunner(compile_graph, 1, compile_model=compile_model)
    calls = runner.prepare_models(graphs)
    import onnxruntime as ort
    for g, call in zip(graphs, calls):
        got = call()
        got = (got[0] if isinstance(got, (list, tuple)) else got).numpy()
        feeds = timing_feeds(g)
        sess = ort.InferenceSession(export_onnx(g).SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(got, sess.run(None, feeds)[0], rtol=1e-5, atol=1e-5)
