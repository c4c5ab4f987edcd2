"""The one output comparison: every "does this model compute what onnxruntime computes" verdict is taken here.

Used by ``optimize-model`` (compiled model vs onnxruntime), ``bench-model`` (every engine), the graph stage
(``graphopt optimize``: optimized vs input model) and ``graphopt roundtrip``.

The test, element by element, is numpy's ``allclose`` form ``|ours - ref| <= atol' + rtol * |ref|`` with the
tolerance of the output's dtype (:data:`TOLERANCES`), where ``atol' = atol * max(1, max |ref|)`` is the
absolute limit in units of the output's scale.  An absolute limit alone rejects correct builds of models
whose outputs are large (Inception-v3's logits reach ~800, where a re-associated fp32 sum is off by 1e-3
while the relative error is 1.6e-6; onnxruntime moves 3.4e-4 between its own optimization levels); a
relative limit alone rejects them too, at the elements near zero: an element's rounding error is set by the
magnitude of the terms summed into it (cancellation), which the output's scale estimates, not by the
element itself.  A wrong build is off by the order of the scale and fails either way.  See
https://numpy.org/doc/stable/reference/generated/numpy.allclose.html.

Non-finite values are compared by position, not by difference: a NaN or an infinity in one result must be
the same NaN or the same-signed infinity in the other.  (``max(err, nan)`` keeps ``err``, so a comparison
built on ``max`` cannot see a NaN at all; a Relu of a NaN is NaN in onnxruntime but 0 in a kernel written
as ``max(x, 0)``.)  Integer and boolean outputs must be equal.

For classifier-like outputs (float, rank 2 or 3, last axis of at least 2 classes) the fraction of rows
whose arg-max agrees is reported too (``top1_agreement``): what a user of a classifier cares about.  It is
reported, not judged: near-ties may flip within tolerance.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence, Union

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    """``|ours - ref| <= atol * max(1, max |ref|) + rtol * |ref|`` (module docstring)."""

    atol: float
    rtol: float


EXACT = Tolerance(0.0, 0.0)
# Per output dtype.  fp32: kernels that re-associate sums (tiling, vectorized reductions) differ from
# onnxruntime by ~1e-6 relative on one layer and grow with depth (BERT-base: 6.5e-5 absolute on outputs of
# order 1); 1e-4 + 1e-4|ref| leaves room for that and is still 1e3-1e4 times tighter than any wrong kernel
# we have seen (a wrong build is off by the order of the values themselves).  fp16 has a 10-bit mantissa
# (eps 9.8e-4), so its accumulations are 2^13 times coarser: 1e-2 + 1e-2|ref|.  Integers and booleans exact.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-7, 1e-7),
    "float32": Tolerance(1e-4, 1e-4),
    "float16": Tolerance(1e-2, 1e-2),
    "bfloat16": Tolerance(5e-2, 5e-2),
}


def tolerance_for(dtype: np.dtype | str) -> Tolerance:
    """The tolerance of an output of this dtype (exact for integers and booleans)."""
    return TOLERANCES.get(np.dtype(dtype).name if not isinstance(dtype, str) else dtype, EXACT)


@dataclass
class Comparison:
    """The verdict on one or more runs of a model against a reference (all outputs, all input sets).

    ``max_rel_err`` is the largest difference relative to its output's scale (``max |d| / max |ref|``; an
    element-wise ratio is noise where ``ref`` is near 0, which ``atol`` covers); ``worst`` is the largest
    ``|d| / (atol max(1, max|ref|) + rtol |ref|)``, so ``ok`` needs ``worst <= 1`` (an exact comparison reports 0 or inf)."""

    ok: bool = True
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    worst: float = 0.0
    atol: float = TOLERANCES["float32"].atol  # of the output that came closest to its limit
    rtol: float = TOLERANCES["float32"].rtol
    nan_mismatch: int = 0  # elements NaN in exactly one of the two results
    inf_mismatch: int = 0  # elements infinite in one result and not the same infinity in the other
    shape_mismatch: list[str] = field(default_factory=list)  # "output 0: (2, 3) vs (3, 2)"
    top1_agreement: float | None = None  # classifier-like outputs only; lowest over outputs and input sets
    outputs: int = 0
    input_sets: int = 0
    quantization: dict | None = None  # a quantized model's per-output tolerances (graphopt.quant_tolerance)

    def reason(self) -> str:
        """What failed, in words ("" when ok)."""
        if self.ok:
            return ""
        if self.shape_mismatch:
            return f"output shapes differ ({self.shape_mismatch[0]})"
        parts = []
        if self.nan_mismatch:
            parts.append(f"{self.nan_mismatch} values are NaN in only one of the two results")
        if self.inf_mismatch:
            parts.append(f"{self.inf_mismatch} values are infinite in only one of the two results")
        if self.worst > 1.0:
            parts.append(f"max abs err {self.max_abs_err:.3g}, max rel err {self.max_rel_err:.3g} exceed "
                         f"atol {self.atol:g} x max(1, max|ref|) + rtol {self.rtol:g} x |ref|")
        return "; ".join(parts)

    def summary(self) -> str:
        """One phrase for a CLI's closing line."""
        text = (f"max abs err {self.max_abs_err:.3g}, max rel err {self.max_rel_err:.3g} "
                f"(atol {self.atol:g}, rtol {self.rtol:g}, {self.input_sets} input set"
                f"{'s' if self.input_sets != 1 else ''})")
        if self.top1_agreement is not None:
            text += f", top-1 agreement {self.top1_agreement:.1%}"
        return text

    def to_dict(self) -> dict:
        """For report.json and --json outputs (infinities as strings, which JSON cannot hold)."""
        out = asdict(self)
        for k, v in out.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = str(v)
        return out

    def merge(self, other: "Comparison") -> "Comparison":
        """The verdict over both (e.g. several input sets): worst of each figure."""
        mine_limits = self.worst >= other.worst
        top1 = [t for t in (self.top1_agreement, other.top1_agreement) if t is not None]
        return Comparison(
            ok=self.ok and other.ok, max_abs_err=max(self.max_abs_err, other.max_abs_err),
            max_rel_err=max(self.max_rel_err, other.max_rel_err), worst=max(self.worst, other.worst),
            atol=self.atol if mine_limits else other.atol, rtol=self.rtol if mine_limits else other.rtol,
            nan_mismatch=self.nan_mismatch + other.nan_mismatch, inf_mismatch=self.inf_mismatch + other.inf_mismatch,
            shape_mismatch=self.shape_mismatch + other.shape_mismatch,
            top1_agreement=min(top1) if top1 else None, outputs=max(self.outputs, other.outputs),
            input_sets=self.input_sets + other.input_sets, quantization=self.quantization or other.quantization)


def _classifier_like(ref: np.ndarray) -> bool:
    return np.issubdtype(ref.dtype, np.floating) and ref.ndim in (2, 3) and ref.shape[-1] >= 2 and ref.size > 0


def _compare_one(ref: np.ndarray, got: np.ndarray, index: int, tol: Tolerance | None) -> Comparison:
    if ref.shape != got.shape:
        return Comparison(ok=False, max_abs_err=math.inf, max_rel_err=math.inf, worst=math.inf,
                          shape_mismatch=[f"output {index}: {ref.shape} vs {got.shape}"], outputs=1)
    t = tol or tolerance_for(ref.dtype)
    res = Comparison(atol=t.atol, rtol=t.rtol, outputs=1)
    if ref.size == 0:
        return res
    numeric = not (ref.dtype == np.bool_ or got.dtype == np.bool_)
    r = ref.astype(np.float64) if numeric else ref.astype(bool)
    g = got.astype(np.float64) if numeric else got.astype(bool)
    if not numeric:
        bad = int(np.count_nonzero(r != g))
        res.max_abs_err = float(bad)
        res.worst = math.inf if bad else 0.0
        res.ok = bad == 0
        return res
    r_nan, g_nan = np.isnan(r), np.isnan(g)
    res.nan_mismatch = int(np.count_nonzero(r_nan != g_nan))
    r_inf, g_inf = np.isinf(r), np.isinf(g)
    res.inf_mismatch = int(np.count_nonzero((r_inf | g_inf) & ~(r_nan | g_nan) & (r != g)))
    finite = np.isfinite(r) & np.isfinite(g)
    every = bool(finite.all())  # the usual case: no copies of the finite elements (a 100 MB output each)
    if every or finite.any():
        d = np.abs(r - g) if every else np.abs(r[finite] - g[finite])
        a = np.abs(r) if every else np.abs(r[finite])
        res.max_abs_err = float(d.max())
        scale = float(a.max())
        limit = t.atol * max(1.0, scale) + t.rtol * a
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(limit > 0, d / np.where(limit > 0, limit, 1.0), np.where(d > 0, np.inf, 0.0))
        res.worst = float(ratio.max())
        res.max_rel_err = res.max_abs_err / scale if scale > 0 else (0.0 if res.max_abs_err == 0 else math.inf)
    res.ok = res.worst <= 1.0 and res.nan_mismatch == 0 and res.inf_mismatch == 0
    if _classifier_like(ref) and every:
        res.top1_agreement = float(np.mean(np.argmax(r, axis=-1) == np.argmax(g, axis=-1)))
    return res


Tolerances = Union[Tolerance, Sequence[Tolerance], None]


def compare_outputs(ref: Sequence[np.ndarray], got: Sequence[np.ndarray],
                    tolerance: Tolerances = None) -> Comparison:
    """Compare one run's outputs (in output order) with the reference's; ``tolerance`` (one for all
    outputs, or one per output: a quantized model's, :mod:`graphopt.quant_tolerance`) overrides the
    per-dtype table (:data:`TOLERANCES`)."""
    if len(ref) != len(got):
        return Comparison(ok=False, max_abs_err=math.inf, max_rel_err=math.inf, worst=math.inf,
                          shape_mismatch=[f"{len(ref)} outputs vs {len(got)}"], outputs=len(ref), input_sets=1)
    total: Comparison | None = None
    for i, (x, y) in enumerate(zip(ref, got)):
        tol = tolerance if tolerance is None or isinstance(tolerance, Tolerance) else tolerance[i]
        one = _compare_one(np.asarray(x), np.asarray(y), i, tol)
        total = one if total is None else total.merge(one)
    total = total or Comparison()
    total.outputs = len(ref)
    total.input_sets = 1
    return total


def compare_runs(pairs: Sequence[tuple[Sequence[np.ndarray], Sequence[np.ndarray]]],
                 tolerance: Tolerances = None) -> Comparison:
    """The verdict over several input sets: ``pairs`` holds (reference outputs, our outputs) per set."""
    total: Comparison | None = None
    for ref, got in pairs:
        one = compare_outputs(ref, got, tolerance)
        total = one if total is None else total.merge(one)
    return total if total is not None else Comparison()


def max_abs_err(ref: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> float:
    """The largest absolute difference, inf when shapes or non-finite positions differ (tests' shorthand)."""
    c = compare_outputs(ref, got)
    return math.inf if (c.shape_mismatch or c.nan_mismatch or c.inf_mismatch) else c.max_abs_err
