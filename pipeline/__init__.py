"""optimize-model's pipeline; the Python API is :func:`optimize` and :func:`load` (see :mod:`pipeline.api`).

They are resolved on first use, so ``import pipeline`` (and every console script's start) loads no TVM."""
from __future__ import annotations

from typing import Any

__all__ = ["optimize", "load", "Model"]


def __getattr__(name: str) -> Any:
    if name in ("optimize", "load"):
        from pipeline import api

        return getattr(api, name)
    if name == "Model":
        from pipeline.artifact import Model

        return Model
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
