"""Benchmark ONNX models built with ``onnx.helper`` and seeded random weights (see ``python -m models list``)."""
from models.registry import MODELS, build, get_model

__all__ = ["MODELS", "build", "get_model"]
