"""Suite-wide settings."""
import pytest


@pytest.fixture(autouse=True)
def _one_latency_round(monkeypatch):
    """optimize-model times every finished build against onnxruntime for report.json (3 rounds of blocks with
    0.5 s idle gaps); the tests check that figure's plumbing, not its precision, so one round without idle
    gaps is enough and saves about 3 s per optimize-model run in the suite."""
    import pipeline.optimize_model

    monkeypatch.setattr(pipeline.optimize_model, "LATENCY_ROUNDS", 1)
    monkeypatch.setattr(pipeline.optimize_model, "LATENCY_GAP_S", 0.0)


@pytest.fixture(scope="session")
def rpc_tracker():
    """``127.0.0.1:PORT:testcpu``: a tracker with one device server registered under ``testcpu``, shared by the
    tests that measure or run through one (starting the two processes took about 10 s)."""
    import rpc_device

    with rpc_device.tracker("testcpu") as rpc:
        yield rpc


@pytest.fixture(autouse=True, scope="session")
def _verdicts_of_this_run(tmp_path_factory):
    """The whole-model verdicts (graphopt.verdicts) of this test run in a file of its own: a verdict a test
    timed with a fake timer must not be replayed by a real build on this machine, nor by the next test run
    (which would then find "recorded" where it checks "measured").  Tests in one run share it, as builds do."""
    import graphopt.verdicts

    patch = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("verdicts") / "verdicts.json"
    patch.setattr(graphopt.verdicts, "store_path", lambda: path)
    yield
    patch.undo()


def fresh_cache(folder):
    """An empty price cache at ``folder`` that still knows this CPU: the calibration files (practical peak,
    bandwidth, the matmul rows tile; ``kerneltune.calibrate``) are copied from the user's cache where they exist.
    A test that wants every operator priced afresh is not about calibrating the CPU, and calibrating took 9 of
    a bert-tiny build's 32 s (Intel Xeon, 2 cores).  Returns ``folder``."""
    import shutil
    from pathlib import Path

    from graphopt.cost.cache import cache_dir

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for path in cache_dir().glob("calibration-*.json"):
        if path.is_file():
            shutil.copyfile(path, folder / path.name)
    return folder
