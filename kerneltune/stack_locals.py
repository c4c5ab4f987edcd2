"""Register tiles on the stack: the TIR pipeline every CPU kernel of this project is built with.

Every CPU template accumulates its output tile in a ``local`` buffer allocated inside the parallel loop (one
per tile: :mod:`kerneltune.templates.common`).  TVM 0.27's ``LowerTVMBuiltin`` keeps an allocation on the
stack only when its scope is ``global`` and it is under 1 KiB; every ``local`` one, even the 4 bytes of the
VNNI intrinsic's broadcast operand, becomes a ``TVMBackendAllocWorkspace`` / ``TVMBackendFreeWorkspace``
pair, a call into the runtime's thread-local pool, once per tile.  A ResNet-50 int8 1x1 conv (3136 x 256 x 64)
runs 1792 tiles of 448 ``vpdpbusd`` each, so four runtime calls sat beside every 448 instructions.

:data:`PIPELINE` is TVM's own s_tir pipeline with one pass after it, before ``LowerTVMBuiltin``: every
``local`` allocation of a constant size up to :data:`STACK_BYTES` is annotated ``disable_lower_builtin``
(the escape ``LowerTVMBuiltin`` honours), so LLVM allocates it on the stack, and it is then free to keep the
tile in registers.  The annotation goes on after the pipeline because ``StorageRewrite`` rebuilds every
allocation without its annotations.

Reference: TVM's ``src/tirx/transform/lower_tvm_builtin.cc`` (``kMaxStackAlloca``, ``disable_lower_builtin``).
"""
from __future__ import annotations

import math

import tvm
from tvm import tirx

from .tir_rewrite import rewrite_stmts

# The pipeline's name for tvm.tirx.build(pipeline=) and relax.build(tir_pipeline=).
PIPELINE = "optimize_model"
# Largest tile kept on the stack: a thread's stack is megabytes; the largest register tile of the templates
# is 32 vectors of 64 bytes (2 KiB), and a write-back tile of a few of them stays far below this.
STACK_BYTES = 64 * 1024
_KEY = "disable_lower_builtin"


def _stack_size(buffer) -> int | None:
    """The bytes of a ``local`` buffer of constant shape, else None."""
    if buffer.scope() != "local":
        return None
    try:
        elems = math.prod(int(d) for d in buffer.shape)
    except TypeError:  # a symbolic extent
        return None
    return elems * tvm.DataType(str(buffer.dtype)).bits // 8


def _on_stack(stmt):
    """A constant-size ``local`` allocation marked for the stack; None for any other statement (searched
    inside by :func:`~kerneltune.tir_rewrite.rewrite_stmts`; an allocation has nothing inside)."""
    if not isinstance(stmt, tirx.AllocBuffer):
        return None
    size = _stack_size(stmt.buffer)
    if size is None or size > STACK_BYTES or _KEY in (stmt.annotations or {}):
        return None
    annotations = {**dict(stmt.annotations or {}), _KEY: tirx.IntImm("int32", 1)}  # LowerTVMBuiltin reads an IntImm
    return tirx.AllocBuffer(stmt.buffer, annotations, stmt.span)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="optimize_model.StackLocals")
def stack_locals(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """``func`` with its constant-size ``local`` allocations on the stack (module docstring); a GPU kernel's
    ``local`` buffers are registers already and stay as they are."""
    target = func.attrs.get("target") if func.attrs is not None else None
    if target is None or target.kind.name != "llvm":
        return func
    body, changed = rewrite_stmts(func.body, _on_stack)
    return func.with_body(body) if changed else func


def _pipeline():
    from tvm.s_tir.pipeline import default_s_tir_pipeline, finalize_device_passes, finalize_host_passes

    lower, _, _ = default_s_tir_pipeline()
    return (tvm.transform.Sequential([lower, stack_locals]), finalize_host_passes, finalize_device_passes)


tvm.tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)
