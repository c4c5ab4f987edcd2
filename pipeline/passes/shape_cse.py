"""One runtime shape object per distinct symbolic shape in a build that serves a range of sizes.

Why: Relax's ``VMShapeLower`` turns every symbolic shape a build uses (each ``alloc_tensor`` of a tensor
whose rows follow the length) into its own ``vm.builtin.make_shape`` call on the shape heap, so a served
MiniLM-L6 made 106 identical-looking shape objects per inference where a static build of one length makes
none.  A symbolic variable is written to its heap slot once (where it is first matched or computed) and
never again, so two ``make_shape`` calls with the same arguments, the later one after the earlier, build
equal shapes: the later binding is dropped and its uses read the earlier one (common-subexpression
elimination for this one builtin, and ``make_prim_value``, the same kind of read of the heap).

It runs after Relax's default build pipeline (``KillAfterLastUse`` runs before ``VMShapeLower``, so no shape
is killed after the use it was made for), on the top-level blocks of each function's body: an ``If``
branch keeps its own calls.

Reference: TVM's ``src/relax/backend/vm/vm_shape_lower.cc`` (the shape heap and ``MakeShape``).
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipeline.passes.relax_rewrite import rewrite_functions

# VM builtins that read the shape heap and build a fresh object from it: pure, given the heap slots they read
HEAP_READS = frozenset({"vm.builtin.make_shape", "vm.builtin.make_prim_value"})


def _key(value) -> tuple | None:
    """(builtin, heap, constant arguments) of a heap read whose other arguments are all constants; else None."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, relax.ExternFunc):
        return None
    name = str(value.op.global_symbol)
    if name not in HEAP_READS or not value.args or not isinstance(value.args[0], relax.Var):
        return None
    consts = []
    for arg in value.args[1:]:  # the heap's slot and kind codes: integer constants
        if not isinstance(arg, tvm.tirx.IntImm):
            return None
        consts.append(int(arg.value))
    return (name, value.args[0], tuple(consts))


@relax.expr_functor.mutator
class _DedupHeapReads(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.seen: dict[tuple, relax.Var] = {}
        self.depth = 0

    def visit_if_(self, op):  # a branch's calls stay as they are: nothing is shared into or out of it
        self.depth += 1
        out = super().visit_if_(op)
        self.depth -= 1
        return out

    def visit_var_binding_(self, binding) -> None:
        key = _key(binding.value) if self.depth == 0 else None
        if key is not None:
            key = (key[0], self.visit_expr(key[1]), key[2])
            first = self.seen.get(key)
            if first is not None:
                self.set_var_remap(binding.var, first)
                return
        super().visit_var_binding_(binding)
        if key is not None:
            self.seen[key] = self.visit_expr(binding.var)  # the var the binding was emitted as


@tvm.transform.module_pass(opt_level=0, name="optimize_model.DedupShapeHeapReads")
def dedup_heap_reads(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """``mod`` with each Relax function's repeated shape-heap reads made once (module docstring); each function
    has its own heap, which the calls' keys name."""
    return rewrite_functions(mod, _DedupHeapReads)
