"""Ops TVM's loop vectorizer would scalarize are kept in vector form (kerneltune.vector_intrinsics): the
requantization's round half to even (``tirx.nearbyint``) stays one vector instruction per vector, and
rounds as numpy does (ties to even)."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from tvm import s_tir, te, tirx  # noqa: E402

from kerneltune.task import build_func  # noqa: E402 - importing it registers the marks
from kerneltune.targets.host import missing_cpu_features  # noqa: E402
from kerneltune.targets.parse import parse_target  # noqa: E402


@pytest.mark.parametrize("lanes, mcpu", [(8, "x86-64-v3"), (16, "x86-64-v4")])
def test_a_vectorized_nearbyint_stays_a_vector_and_rounds_half_to_even(lanes, mcpu):
    a = te.placeholder((4, 64), "float32", name="a")
    c = te.compute((4, 64), lambda i, j: tirx.nearbyint(a[i, j] * 2.0), name="c")
    sch = s_tir.Schedule(te.create_prim_func([a, c]))
    _, j = sch.get_loops(sch.get_sblock("c"))
    sch.vectorize(sch.split(j, [None, lanes])[1])
    target = parse_target(f"llvm -mcpu={mcpu}", 1).target
    lib = build_func(sch.mod["main"], target)
    assert f"llvm.nearbyint.v{lanes}f32" in lib.inspect_source("ll")
    missing = missing_cpu_features(target)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} to run it (the vector form was checked in the IR)")
    x = np.random.default_rng(0).uniform(-50, 50, (4, 64)).astype("float32")
    x[0, :6] = [0.25, 0.75, 1.25, -0.25, -0.75, -1.25]  # x * 2 at .5: ties go to the even neighbour
    out = tvm.runtime.empty((4, 64), "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy(), np.rint(x * np.float32(2.0)))
