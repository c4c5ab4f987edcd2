"""Graph IR and ONNX import/export on hand-built models: the properties every other stage relies on."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.errors import UserError
from graphopt.compare import max_abs_err
from graphopt.feeds import random_inputs, run_ort
from graphopt.onnx_io import export_onnx, import_onnx, parse_input_shapes


def _model(dynamic: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch" if dynamic else 2, 4])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((7, 3)).astype(np.float32), "emb")]
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(3, np.float32))),
        helper.make_node("MatMul", ["x", "w"], ["t"]),
        helper.make_node("Identity", ["t"], ["t2"]),
        helper.make_node("Add", ["t2", "c"], ["y"]),          # graph output, also consumed below
        helper.make_node("Gather", ["emb", "ids"], ["g"]),
        helper.make_node("Gelu", ["y"], ["u"], domain="com.microsoft"),  # an op nobody here understands
        helper.make_node("Add", ["u", "g"], ["z"]),
    ]
    graph = helper.make_graph(nodes, "g", [x, ids], [y, z], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8  # onnxruntime 1.31 reads IR <= 13; onnx 1.23 writes 14 by default
    return model


def test_import_keeps_every_computation_and_exports_equal():
    model = _model()
    g = import_onnx(model)
    assert [n.op_type for n in g.nodes] == ["MatMul", "Add", "Gather", "Gelu", "Add"]
    assert "c" in g.initializers                      # Constant folded into a weight
    assert g.nodes[3].domain == "com.microsoft"       # opaque node kept with its domain
    assert g.shape("t") == (2, 3)
    out = export_onnx(g)
    assert [i.name for i in out.graph.input] == ["x", "ids"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    feeds = random_inputs(g, seed=1)
    assert feeds["ids"].max() < 7                     # token ids bounded by the embedding table
    assert max_abs_err(run_ort(model, feeds), run_ort(out, feeds)) == 0.0


def test_topo_sort_and_networkx_view():
    g = import_onnx(_model())
    g.nodes.reverse()
    g.topo_sort()
    pos = {n.outputs[0]: i for i, n in enumerate(g.nodes)}
    assert pos["t"] < pos["y"] < pos["u"] < pos["z"]
    nxg = g.to_networkx()
    assert nxg.number_of_nodes() == 5 and nxg.number_of_edges() == 4


def test_structural_hash_ignores_names_but_not_computation():
    a = import_onnx(_model())
    b = a.copy()
    b.nodes[0].outputs = ["renamed"]
    b.nodes[1].inputs = ["renamed", "c"]
    assert a.structural_hash() == b.structural_hash()
    b.nodes[1].op_type = "Sub"
    assert a.structural_hash() != b.structural_hash()


def test_dynamic_input_needs_shape():
    with pytest.raises(UserError, match=r"input has symbolic dimensions: x \[batch, 4\]: fix them with --dim batch=N"):
        import_onnx(_model(dynamic=True))
    g = import_onnx(_model(dynamic=True), parse_input_shapes(["x=2,4"]))
    assert g.shape("t") == (2, 3)


def test_bad_input_shape_option():
    with pytest.raises(UserError, match="NAME=D1"):
        parse_input_shapes(["x:2,4"])
    with pytest.raises(UserError, match="not a model input"):
        import_onnx(_model(), {"nope": (1,)})


def test_unsupported_dtype_is_a_user_error():
    x = helper.make_tensor_value_info("x", TensorProto.STRING, [2])
    y = helper.make_tensor_value_info("y", TensorProto.STRING, [2])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))
    with pytest.raises(UserError, match="dtype"):
        import_onnx(model)


def test_remove_unused_drops_dead_nodes_and_weights():
    g = import_onnx(_model())
    g.outputs = [o for o in g.outputs if o.name == "y"]
    assert g.remove_unused() == 3
    assert "emb" not in g.initializers and "w" in g.initializers


def test_identity_cache_is_bounded_and_forgets_dead_objects():
    """The weight-hash and compiled-pattern caches are keyed by id(): bounded, and an entry made for an
    object that died is never handed to a new object that reuses its id."""
    import gc

    from graphopt.memo import IdentityCache

    cache: IdentityCache[str] = IdentityCache(4)
    arrays = [np.full(3, i, np.float32) for i in range(6)]
    for i, a in enumerate(arrays):
        cache.put(a, f"v{i}")
    assert len(cache) == 4 and cache.get(arrays[0]) is None and cache.get(arrays[5]) == "v5"
    dead = np.zeros(2)
    cache.put(dead, "dead")
    dead_id = id(dead)
    del dead
    gc.collect()
    reborn = [np.ones(2) for _ in range(50)]  # some may reuse the dead array's id
    assert all(cache.get(r) is None for r in reborn if id(r) == dead_id)
    assert all(cache.get(r) != "dead" for r in reborn)


def test_structural_hash_of_a_20000_node_chain_needs_no_recursion():
    """The hash walks producers with an explicit stack: a chain of any length (12,000 nodes hit Python's
    recursion limit when it recursed once per node), the same hash for the same computation."""
    def chain(n: int, prefix: str):
        nodes, prev = [], "x"
        for i in range(n):
            nodes.append(helper.make_node("Add" if i % 2 == 0 else "Mul", [prev, "c"], [f"{prefix}{i}"]))
            prev = f"{prefix}{i}"
        nodes[-1].output[0] = "y"
        g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.array(1.5, np.float32), "c")])
        return import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {})

    a, b = chain(20000, "t"), chain(20000, "renamed")
    assert a.structural_hash() == b.structural_hash() != chain(19999, "t").structural_hash()
