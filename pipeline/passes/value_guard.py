"""model.so checks the value of an input it is specialized on, itself.

A build specialized on a control input (:mod:`graphopt.specialize`: Silero VAD's sample rate decides pads and a
branch) computes a wrong answer for any other value.  The loader refuses another value before the call, but
that check reads report.json, which can be edited, and a plain TVM loader (``tvm.runtime.load_module`` +
``relax.VirtualMachine``) reads no report at all.  So the compiled main function starts with
``R.assert_op(all(input == value))`` for each such input (TVM's assert op, which the VM runs before any
kernel): another value raises, naming the input, whatever loads the library.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import tvm
from tvm import relax

MESSAGE = "input {name!r} is {{}}, but this model.so is built for {name}={value} only: rebuild with that value"


def add_value_guards(mod: tvm.IRModule, values: Mapping[str, np.ndarray]) -> tvm.IRModule:
    """``mod`` whose main first asserts each of ``values`` (input name -> the one value it is built for); an
    input main does not take (pruned by the importer: nothing reads it) needs no guard: it cannot change the
    result."""
    if not values:
        return mod
    main = mod["main"]
    params = {p.name: p for p in main.params}
    guarded = {name: v for name, v in values.items() if name in params}
    if not guarded:
        return mod
    bindings = []
    for name, value in guarded.items():
        param = params[name]
        want = np.asarray(value, dtype=str(param.ty.dtype))
        same = relax.Var(f"{name}_is_built_value", relax.TensorType((), "bool"))
        bindings.append(relax.VarBinding(same, _all_equal(param, want)))
        check = relax.op.assert_op(same, [param], MESSAGE.format(name=name, value=want.tolist()))
        bindings.append(relax.VarBinding(relax.Var(f"{name}_checked", check.ty), check))
    body = main.body
    guarded_body = relax.SeqExpr([relax.BindingBlock(bindings), *body.blocks], body.body)
    out = mod.clone()
    out["main"] = relax.Function(main.params, guarded_body, main.ret_ty, is_pure=False, attrs=main.attrs,
                                 span=main.span)  # impure: the assert must not be removed as dead code
    return relax.transform.Normalize()(out)


def _all_equal(param: relax.Var, want: np.ndarray) -> relax.Expr:
    """A scalar bool: ``param == want`` everywhere (the minimum of the elementwise equality).  A bool input is
    compared as int8: LLVM has no ordered compare of its i1."""
    value: relax.Expr = param
    if want.dtype == np.bool_:
        value, want = relax.op.astype(param, "int8"), want.astype(np.int8)
    equal = relax.op.equal(value, relax.const(want, str(want.dtype)))
    return equal if want.ndim == 0 else relax.op.astype(relax.op.min(relax.op.astype(equal, "int8")), "bool")
