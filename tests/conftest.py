"""Suite-wide settings."""
import pytest


@pytest.fixture(autouse=True)
def _one_latency_round(monkeypatch):
    """optimize-model times every finished build against onnxruntime for report.json (3 rounds of blocks with
    0.5 s idle gaps); the tests check that figure's plumbing, not its precision, so one round is enough and
    saves about 2 s per optimize-model run in the suite."""
    import pipeline.optimize_model

    monkeypatch.setattr(pipeline.optimize_model, "LATENCY_ROUNDS", 1)
