"""Register tiles on the stack (kerneltune.stack_locals): TVM 0.27 turns every ``local`` allocation of a CPU
kernel into a runtime workspace call per tile; the project's TIR pipeline keeps them on the stack."""
from __future__ import annotations

import re

import numpy as np
import tvm

from kerneltune import templates
from kerneltune.stack_locals import PIPELINE
from kerneltune.targets.host import llvm_target
from kerneltune.task import build_func, make_task, run_func

LLVM = llvm_target(2)


def _workspace_locals(lib) -> list[str]:
    """The ``local`` buffers the kernel takes from the runtime's workspace allocator (one call per tile): LLVM
    IR names the allocator's result after the buffer (``%matmul_local = tail call ptr %16(i32 1, ...)``)."""
    return re.findall(r"%(\w*local\w*) = tail call ptr %\d+\(i32 1,", lib.inspect_source("ll"))


def test_a_template_kernel_keeps_its_tile_on_the_stack_and_stays_exact():
    task = make_task("matmul", "64,96,48")
    func = templates.apply(task, templates.default_config(task, LLVM), LLVM)
    # TVM's own pipeline calls the runtime's workspace allocator for the tile (the reason for the pass) ...
    plain = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=LLVM)
    assert _workspace_locals(plain)
    # ... the project's does not, and the product is the same
    lib = build_func(func, LLVM)
    assert _workspace_locals(lib) == []
    a, b = task.make_inputs(seed=2)[:2]
    (out,) = run_func(lib, task, [a, b], tvm.cpu())
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


def test_only_cpu_functions_are_rewritten():
    """A GPU kernel's ``local`` buffers are registers: the pipeline leaves them (and builds CUDA as before)."""
    task = make_task("matmul", "64,64,64")
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host=LLVM)
    func = templates.apply(task, templates.default_config(task, cuda), cuda)
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    source = tvm.tirx.build(mod, target=cuda, pipeline=PIPELINE).imports[0].inspect_source()
    assert "__global__" in source
