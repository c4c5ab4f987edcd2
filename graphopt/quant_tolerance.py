"""How close a quantized model's outputs must come to onnxruntime's: a tolerance from its quantization steps.

A float model is compared at the fp32 tolerance (:data:`graphopt.compare.TOLERANCES`).  A quantized model
cannot be: every quantizer rounds, and two correct evaluations that differ by one ulp before a rounding
(another summation order in a layer norm, a requantization multiplier applied in another order) land one
quantization step apart, which the following layers carry to the outputs.  onnxruntime shows the size of
this itself: on a ``quantize_dynamic`` BERT-base its own two graph optimization levels differ by 0.076 on
outputs of magnitude 4.6 (1.7%), while our integer build differed from it by 0.088.

So for each output of a model with quantized operators the allowance is the larger of

* **one quantization step of the output**: the scale of the DequantizeLinear that produces it (a QDQ
  model's logits); 1 for an 8-bit output (the requantization rounding may differ by one step, the integer
  accumulation never does); for any other float output, the step an 8-bit quantizer of its observed range
  would have, ``(max - min) / 255``;
* **twice onnxruntime's own spread**: the largest difference between onnxruntime with all graph
  optimizations and with none, on the same check inputs: what this model's rounding does to two correct
  evaluations.

A wrong kernel is off by the order of the values themselves (a zero point applied twice shifts every element
by ``zp * scale * K``), far above either.  report.json records the rule and the figures.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import onnx

from graphopt.compare import Tolerance, tolerance_for

QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
                           "ConvInteger", "QLinearConv", "QLinearMatMul", "MatMulIntegerToFloat",
                           "DynamicQuantizeMatMul", "QLinearAdd", "QLinearMul", "QGemm"})
EIGHT_BIT_STEPS = 255


def is_quantized(model: onnx.ModelProto) -> bool:
    """Whether any node of the main graph is a quantized operator."""
    return any(n.op_type in QUANTIZED_OPS for n in model.graph.node)


@dataclass
class OutputAllowance:
    """One output's allowance (absolute, in the output's units) and what set it."""

    name: str
    allowance: float
    step: float
    onnxruntime_spread: float
    tolerance: Tolerance


@dataclass
class QuantizedTolerance:
    """The per-output tolerances of a quantized model (``tolerances`` in output order)."""

    outputs: list[OutputAllowance]

    @property
    def tolerances(self) -> list[Tolerance]:
        return [o.tolerance for o in self.outputs]

    def to_json(self) -> dict:
        return {"rule": "max(one quantization step of the output, 2 x onnxruntime's spread between its "
                        "optimization levels)",
                "outputs": [{"name": o.name, "allowance": o.allowance, "step": o.step,
                             "onnxruntime_spread": o.onnxruntime_spread, **asdict(o.tolerance)}
                            for o in self.outputs]}


def quantized_tolerance(model: onnx.ModelProto, references: Sequence[Sequence[np.ndarray]],
                        unoptimized: Sequence[Sequence[np.ndarray]]) -> QuantizedTolerance:
    """The tolerances for ``model``'s outputs from onnxruntime's outputs on the check inputs with all graph
    optimizations (``references``) and with none (``unoptimized``), one list of outputs per input set."""
    steps = _output_steps(model)
    outputs = []
    for i, out in enumerate(model.graph.output):
        refs = [np.asarray(r[i]) for r in references]
        others = [np.asarray(u[i]) for u in unoptimized]
        dtype = refs[0].dtype
        base = tolerance_for(dtype)
        if dtype == np.bool_ or not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
            outputs.append(OutputAllowance(out.name, 0.0, 0.0, 0.0, base))
            continue
        finite = [r[np.isfinite(r)] if np.issubdtype(dtype, np.floating) else r for r in refs]
        # the comparison scales atol by each set's own max |ref|: the smallest one gives every set the allowance
        scale = min((float(np.abs(f).max()) for f in finite if f.size), default=0.0)
        spread = max((_max_diff(r, u) for r, u in zip(refs, others)), default=0.0)
        if np.issubdtype(dtype, np.integer):
            step = 1.0 if dtype.itemsize == 1 else 0.0
        elif out.name in steps:
            step = steps[out.name]
        else:
            lo = min((float(f.min()) for f in finite if f.size), default=0.0)
            hi = max((float(f.max()) for f in finite if f.size), default=0.0)
            step = (hi - lo) / EIGHT_BIT_STEPS
        allowance = max(step, 2.0 * spread)
        atol = max(base.atol, allowance / max(1.0, scale))
        outputs.append(OutputAllowance(out.name, allowance, step, spread, Tolerance(atol, base.rtol)))
    return QuantizedTolerance(outputs)


def model_tolerance(model: onnx.ModelProto, sets: list[dict[str, np.ndarray]],
                    references: Sequence[Sequence[np.ndarray]], threads: int = 0) -> QuantizedTolerance | None:
    """The tolerances to compare ``model``'s outputs with (None: a float model, the dtype table applies):
    onnxruntime runs it once more on ``sets`` with its graph optimizations off, for its spread."""
    if not is_quantized(model):
        return None
    from graphopt.feeds import run_ort_sets

    return quantized_tolerance(model, references, run_ort_sets(model, sets, threads, optimize=False))


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape or a.size == 0:
        return 0.0
    both = np.isfinite(a.astype(np.float64)) & np.isfinite(b.astype(np.float64))
    return float(np.abs(a.astype(np.float64)[both] - b.astype(np.float64)[both]).max()) if both.any() else 0.0


def _output_steps(model: onnx.ModelProto) -> dict[str, float]:
    """Graph outputs produced by a DequantizeLinear with a constant per-tensor scale: that scale."""
    consts = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute:
            consts[n.output[0]] = next((a.t for a in n.attribute if a.name == "value"), None)
    out_names = {o.name for o in model.graph.output}
    steps = {}
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.output[0] in out_names and len(n.input) > 1:
            t = consts.get(n.input[1])
            if t is not None:
                scale = onnx.numpy_helper.to_array(t).astype(np.float64)
                if scale.size >= 1 and np.all(np.isfinite(scale)):
                    steps[n.output[0]] = float(np.abs(scale).max())
    return steps
