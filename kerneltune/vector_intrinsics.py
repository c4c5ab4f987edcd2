"""TIR intrinsics that TVM's loop vectorizer leaves scalar, marked vectorizable where LLVM has their vector form.

TVM's ``VectorizeLoop`` keeps a call in vector form only when its op carries the ``TVectorizable`` attribute;
any other call scalarizes the whole vectorized loop.  TVM 0.27 does not mark ``tirx.nearbyint``, the
round-half-to-even that ONNX's QuantizeLinear and Round use (``relax.round`` legalizes to it), so every
requantization epilogue of an int8 kernel became a scalar loop.  LLVM's own loop vectorizer then vectorized
it again, but at 8 lanes on the Intel Xeons whose tuning prefers 256-bit vectors, and behind a copy of the
accumulator tile through memory.  ``llvm.nearbyint`` takes vectors (``vrndscaleps``/``vroundps``), so the mark
is all it needs; the result is bit-identical (round half to even either way).

Measured on an Intel Xeon (Emerald Rapids, 2 threads), ResNet-50's 3136 x 256 x 64 int8 1x1 conv timed
cold: 0.735 -> 0.661 ms alone, 1.208 -> 0.877 ms with its residual add and requantization.

Registered when this module is imported (by :mod:`kerneltune.task`, which every kernel and model build
imports first); registering is idempotent.

A conversion that rounds (:func:`rounding_conversion`): a requantization ``u8(clip(round(x) + zp))`` compiled
as written is ``vrndscaleps`` (two port-0 micro-ops on Intel), a float clamp and a truncating ``vcvttps2dq``;
``llvm.lrint`` of the clamped value is one ``vcvtps2dq`` (rounding half to even, the default MXCSR mode, as
``nearbyint`` does).  With a reduction of 64 or fewer input channels the epilogue's port-0 work rivals the
``vpdpbusd`` instructions themselves (onnxruntime's MLAS requantizes with ``cvtps2dq`` too).  Measured on the
same Xeon: MobileNet-v2's 12544 x 96 x 16 kernel 0.160 -> 0.147 ms, the whole int8 model 0.94-0.97x in one
A/B run of three rounds; ResNet-50 int8 unchanged (its short reductions are a smaller share).
"""
from __future__ import annotations

import tvm

from kerneltune.targets.host import arch_of

VECTORIZABLE = ("tirx.nearbyint",)


def register() -> None:
    """Mark :data:`VECTORIZABLE` ops ``TVectorizable`` (those TVM already marks are left alone)."""
    for name in VECTORIZABLE:
        if not tvm.ir.Op.get(name).get_attr("TVectorizable"):
            tvm.ir.register_op_attr(name, "TVectorizable", True)


register()


def rounding_conversion(spec) -> bool:
    """Whether ``llvm.lrint`` on vectors is one instruction for ``spec`` (a kerneltune ``TargetSpec``): LLVM
    code for x86 (``cvtps2dq``); elsewhere the requantization keeps ``round`` then a conversion."""
    return spec.kind == "llvm" and arch_of(spec.triple) == "x86_64"


def lrint_i32(value: "tvm.tirx.PrimExpr") -> "tvm.tirx.PrimExpr":
    """``value`` (float32) rounded half to even to int32 in one conversion (see the module docstring)."""
    return tvm.tirx.call_llvm_pure_intrin("int32", "llvm.lrint", value)
