"""The correctness check of a measured kernel: its outputs against the task's reference.

The reference is the unscheduled PrimFunc built with plain LLVM (:meth:`kerneltune.task.Task.reference`),
computed on the host; a wrong fast kernel must never become the best one, so the measurer checks the first
successful config of a task and every config that beats the best so far.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# Tolerance, relative to the reference's largest magnitude: a different summation order of fp32 dot
# products differs by ~1e-6 of it; a wrong kernel by O(1).
REL_TOL = 1e-4


def output_error(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> str | None:
    """None when every output matches the reference within :data:`REL_TOL`, else the reason."""
    err = max(float(np.max(np.abs(o - r))) if r.size else 0.0 for o, r in zip(outputs, reference))
    scale = max(1.0, max(float(np.max(np.abs(r))) if r.size else 0.0 for r in reference))
    if not np.isfinite(err) or err > REL_TOL * scale:
        return f"wrong result: max err {err:.3g} (reference max {scale:.3g})"
    return None
