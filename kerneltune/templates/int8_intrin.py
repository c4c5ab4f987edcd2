"""The u8 x s8 -> s32 dot-product instructions as TVM tensor intrinsics, for the int8 template.

Each intrinsic computes ``lanes`` int32 results ``C[i] += sum_k A[k] * B[i, k]`` over ``depth``
consecutive ``k``, A's ``depth`` bytes broadcast to every lane and B's ``lanes x depth`` bytes contiguous
(the weight is packed so at build time).  Which one a target gets (:func:`instruction_for`), best first:

* AVX-512 VNNI ``vpdpbusd`` (16 lanes x 4): one instruction (Intel's intrinsics guide, ``_mm512_dpbusd_epi32``);
* ``vpdpbusd`` on 256-bit registers (8 x 4): AVX-VNNI (Alder Lake and later clients), or AVX-512 VNNI's
  VL form, for products whose columns are a multiple of 8 but not 16 (MobileNet-v2's 24 channels);
* AVX-512BW / AVX2 without VNNI (16 x 2 / 8 x 2): ``vpmaddwd`` of B's 16-bit values against A's two bytes
  zero-extended: exact.  B is an int8 weight stored as int16 at build time (:mod:`pipeline.passes.int8`, the
  ``weight`` of these instructions); sign-extended in the loop instead (``vpmovsxbw``), it cost a
  shuffle-port uop per 16 products and the products ran at about the fp32 FMA rate.  The alternative
  ``vpmaddubsw`` (u8 x s8 pairs, then ``vpmaddwd`` by ones: 3 vector uops per 32 products with the add,
  against our 4) saturates its 16-bit pair sums (255 x 127 x 2 > 32767), which onnxruntime's documentation
  warns about (its ``reduce_range`` option); we compute the exact sums.

TVM ships the VNNI description with a ``global`` accumulator (``tvm.s_tir.tensor_intrin.x86``); ours
accumulate into a ``local`` buffer, the register tile the template keeps across the k loop, so that
tensorize matches it.  LLVM 20's signatures take the byte operands as ``<N x i8>``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import tvm
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.target import codegen


@dataclass(frozen=True)
class Instruction:
    """One dot-product intrinsic: its registered name, int32 lanes, values of ``k`` per lane, the CPU features it
    needs (all of one of the alternatives), the LLVM intrinsic it calls (:func:`registered`) and the weight's
    element type."""

    name: str
    lanes: int
    depth: int
    requires: tuple[tuple[str, ...], ...]
    llvm: str
    weight: str = "int8"  # B's element type: the 16-bit multiply-adds read the weight widened at build time

    def available(self, target: tvm.target.Target) -> bool:
        return any(all(codegen.target_has_features(f, target) for f in alt) for alt in self.requires)


def _desc(lanes: int, depth: int, weight: str):
    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((depth,), "uint8", offset_factor=1),
             B: T.Buffer((lanes, depth), weight, offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:depth], B[0:lanes, 0:depth])
            T.writes(C[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, depth):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")
    return desc


def _vnni(lanes: int, intrinsic: str):
    """``vpdpbusd``: ``lanes`` x 4 bytes."""
    nbytes = lanes * 4

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((4,), "uint8", offset_factor=1),
             B: T.Buffer((lanes, 4), "int8", offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            a = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
            C[T.ramp(T.int32(0), 1, lanes)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(intrinsic), C.vload([0], dtype=f"int32x{lanes}"),
                T.reinterpret(T.broadcast(a, lanes), dtype=f"int8x{nbytes}"),
                B.vload([0, 0], dtype=f"int8x{nbytes}"), dtype=f"int32x{lanes}")
    return impl


def _widened(lanes: int, intrinsic: str):
    """``vpmaddwd``: ``lanes`` x 2 values of a 16-bit B against A's 2 bytes zero-extended, exact."""
    halves = lanes * 2

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((2,), "uint8", offset_factor=1),
             B: T.Buffer((lanes, 2), "int16", offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:2], B[0:lanes, 0:2])
            T.writes(C[0:lanes])
            a = T.reinterpret(T.cast(A.vload([0], "uint8x2"), "int16x2"), dtype="int32")
            C[T.ramp(T.int32(0), 1, lanes)] = C.vload([0], dtype=f"int32x{lanes}") + T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(intrinsic), B.vload([0, 0], dtype=f"int16x{halves}"),
                T.reinterpret(T.broadcast(a, lanes), dtype=f"int16x{halves}"), dtype=f"int32x{lanes}")
    return impl


VNNI_512 = Instruction("optimize_model_dot_16x4_vnni", 16, 4, (("avx512vnni", "avx512bw"),),
                       "llvm.x86.avx512.vpdpbusd.512")
VNNI_256 = Instruction("optimize_model_dot_8x4_vnni256", 8, 4, (("avxvnni",), ("avx512vnni", "avx512vl")),
                       "llvm.x86.avx512.vpdpbusd.256")
MADD_512 = Instruction("optimize_model_dot_16x2_pmaddwd512", 16, 2, (("avx512bw",),), "llvm.x86.avx512.pmaddw.d.512",
                       "int16")
MADD_256 = Instruction("optimize_model_dot_8x2_pmaddwd256", 8, 2, (("avx2",),), "llvm.x86.avx2.pmadd.wd", "int16")
INSTRUCTIONS = (VNNI_512, VNNI_256, MADD_512, MADD_256)  # best first
_REGISTERED: set[str] = set()
_REGISTERING = threading.Lock()  # templates are applied from the build threads too


def registered(ins: Instruction) -> str:
    """``ins``'s name, its TVM tensor intrinsic registered in this process on first use.  Not at import: TVMScript
    parses each function with ``inspect.stack()``, which walks every loaded module, and the eight took 2.6-4.3 s
    of every command that imported the templates (torch loaded, Intel Xeon), int8 model or not."""
    with _REGISTERING:
        if ins.name not in _REGISTERED:
            impl = (_vnni if ins.depth == 4 else _widened)(ins.lanes, ins.llvm)
            TensorIntrin.register(ins.name, _desc(ins.lanes, ins.depth, ins.weight), impl, override=True)
            _REGISTERED.add(ins.name)
    return ins.name


# the deepest instruction's depth: convs pad their input channels to it, so every target's depth divides K
MAX_DEPTH = max(i.depth for i in INSTRUCTIONS)


def instruction_for(target: tvm.target.Target, columns: int | None = None) -> Instruction | None:
    """The best dot-product instruction ``target`` has whose lanes divide ``columns`` (any, when None);
    None: not an x86 CPU with AVX2 or better, or no width divides the columns."""
    if target.kind.name != "llvm":
        return None
    for ins in INSTRUCTIONS:
        if ins.available(target) and (columns is None or columns % ins.lanes == 0):
            return ins
    return None
