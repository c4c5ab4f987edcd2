"""The u8 x s8 -> s32 dot-product instructions as TVM tensor intrinsics, for the int8 template.

One intrinsic computes 16 int32 lanes ``C[i] += sum_k A[k] * B[i, k]`` over 4 consecutive ``k``: the
operation of AVX-512 VNNI's ``vpdpbusd`` (A's 4 bytes broadcast to every lane, B's 16 x 4 bytes one
register; Intel's intrinsics guide, ``_mm512_dpbusd_epi32``).  TVM ships the same description with a
``global`` accumulator (``tvm.s_tir.tensor_intrin.x86``); ours accumulate into a ``local`` buffer, the
register tile the template keeps across the k loop, so that tensorize matches it.
"""
from __future__ import annotations

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

LANES, DEPTH = 16, 4  # int32 lanes of a 512-bit register; u8/s8 products summed into each lane
VNNI_512 = "optimize_model_dot_16x4_vnni_local"


@T.prim_func(s_tir=True)
def _dot_desc(A: T.Buffer((4,), "uint8", offset_factor=1),
              B: T.Buffer((16, 4), "int8", offset_factor=1),
              C: T.Buffer((16,), "int32", offset_factor=1, scope="local")) -> None:
    with T.sblock("root"):
        T.reads(C[0:16], A[0:4], B[0:16, 0:4])
        T.writes(C[0:16])
        for i in T.serial(0, 16):
            for k in T.serial(0, 4):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")


@T.prim_func(s_tir=True)
def _dot_vnni(A: T.Buffer((4,), "uint8", offset_factor=1),
              B: T.Buffer((16, 4), "int8", offset_factor=1),
              C: T.Buffer((16,), "int32", offset_factor=1, scope="local")) -> None:
    with T.sblock("root"):
        T.reads(C[0:16], A[0:4], B[0:16, 0:4])
        T.writes(C[0:16])
        # LLVM 20's signature: (<16 x i32> acc, <64 x i8> u8 operand, <64 x i8> s8 operand)
        a = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
        C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
            T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
            C.vload([0], dtype="int32x16"), T.reinterpret(T.broadcast(a, 16), dtype="int8x64"),
            B.vload([0, 0], dtype="int8x64"), dtype="int32x16")


TensorIntrin.register(VNNI_512, _dot_desc, _dot_vnni, override=True)
