"""Z3 verifier and property validation: true rules are proved, wrong rules and wrong properties are caught."""
from __future__ import annotations

import pytest

from graphopt.properties import PROPERTIES, E, P, check_property, conv
from graphopt.rules import Pattern, PNode, Rule
from graphopt.verifier import Z3Env, verify_rule

CONV = dict(stride=(1, 1), pad="SAME", groups=1)


def rule(src_nodes, src_out, dst_nodes, dst_out, ranks) -> Rule:
    return Rule("t", Pattern(tuple(src_nodes), tuple(src_out)), Pattern(tuple(dst_nodes), tuple(dst_out)),
                input_ranks=tuple(ranks))


MERGE_MATMUL = rule([PNode.make("matmul", ["x0", "x1"]), PNode.make("matmul", ["x0", "x2"])], ["n0:0", "n1:0"],
                    [PNode.make("concat", ["x1", "x2"], axis=1), PNode.make("matmul", ["x0", "n0:0"]),
                     PNode.make("split", ["n1:0"], 2, axis=1, sizes=("x1.1", "x2.1"))], ["n2:0", "n2:1"], [2, 2, 2])
# BERT: [B,S,H] activation times two [H,H] weights -> one matmul; the concat axis of the result is 2
MERGE_QKV = rule([PNode.make("matmul", ["x0", "x1"]), PNode.make("matmul", ["x0", "x2"])], ["n0:0", "n1:0"],
                 [PNode.make("concat", ["x1", "x2"], axis=1), PNode.make("matmul", ["x0", "n0:0"]),
                  PNode.make("split", ["n1:0"], 2, axis=2, sizes=("x1.1", "x2.1"))], ["n2:0", "n2:1"], [3, 2, 2])
FUSE_RELU = rule([PNode.make("conv2d", ["x0", "x1"], act="none", **CONV), PNode.make("relu", ["n0:0"])], ["n1:0"],
                 [PNode.make("conv2d", ["x0", "x1"], act="relu", **CONV)], ["n0:0"], [4, 4])
MERGE_CONV = rule([PNode.make("conv2d", ["x0", "x1"], act="relu", **CONV),
                   PNode.make("conv2d", ["x0", "x2"], act="relu", **CONV)], ["n0:0", "n1:0"],
                  [PNode.make("concat", ["x1", "x2"], axis=0), PNode.make("conv2d", ["x0", "n0:0"], act="relu", **CONV),
                   PNode.make("split", ["n1:0"], 2, axis=1, sizes=("x1.0", "x2.0"))], ["n2:0", "n2:1"], [4, 4, 4])
TRANSPOSE_MATMUL = rule([PNode.make("transpose", ["x0"], perm=(1, 0)), PNode.make("transpose", ["x1"], perm=(1, 0)),
                         PNode.make("matmul", ["n1:0", "n0:0"])], ["n2:0"],
                        [PNode.make("matmul", ["x0", "x1"]), PNode.make("transpose", ["n0:0"], perm=(1, 0))], ["n1:0"],
                        [2, 2])
MERGE_BIAS = rule([PNode.make("split", ["x0"], 2, axis=2, sizes=("x1.0", "x2.0")),
                   PNode.make("bias_add", ["n0:0", "x1"]), PNode.make("bias_add", ["n0:1", "x2"])], ["n1:0", "n2:0"],
                  [PNode.make("concat", ["x1", "x2"], axis=0), PNode.make("bias_add", ["x0", "n0:0"]),
                   PNode.make("split", ["n1:0"], 2, axis=2, sizes=("x1.0", "x2.0"))], ["n2:0", "n2:1"], [3, 1, 1])


@pytest.fixture(scope="module")
def env():
    return Z3Env()


@pytest.mark.parametrize("r", [MERGE_MATMUL, MERGE_QKV, FUSE_RELU, MERGE_CONV, TRANSPOSE_MATMUL, MERGE_BIAS],
                         ids=["merge_matmul", "merge_qkv", "fuse_relu", "merge_conv", "transpose_matmul", "merge_bias"])
def test_true_rules_are_proved(env, r):
    assert verify_rule(r, env, 10000).status == "verified"


WRONG_RULES = {
    # relu does not distribute over addition
    "relu_add": rule([PNode.make("ewadd", ["x0", "x1"]), PNode.make("relu", ["n0:0"])], ["n1:0"],
                     [PNode.make("relu", ["x0"]), PNode.make("relu", ["x1"]), PNode.make("ewadd", ["n0:0", "n1:0"])],
                     ["n2:0"], [2, 2]),
    # merged QKV with the concat on the wrong axis of a rank-3 result (right only for rank 2)
    "qkv_wrong_axis": rule(MERGE_QKV.src.nodes, MERGE_QKV.src.outputs, MERGE_MATMUL.dst.nodes,
                           MERGE_MATMUL.dst.outputs, [3, 2, 2]),
    # fusing relu into a conv that is then transposed in the wrong order
    "matmul_commute": rule([PNode.make("matmul", ["x0", "x1"])], ["n0:0"], [PNode.make("matmul", ["x1", "x0"])],
                           ["n0:0"], [2, 2]),
}


@pytest.mark.parametrize("name", sorted(WRONG_RULES))
def test_wrong_rule_is_not_verified(env, name):
    assert verify_rule(WRONG_RULES[name], env, 3000).status != "verified"


def test_every_property_validates_on_small_shapes():
    failed = []
    for p in PROPERTIES:
        r = check_property(p, per_params=1)
        if not r.ok:
            failed.append((p.name, r.counterexample))
        assert r.instances >= 1 or not r.ok
    assert not failed


def test_wrong_property_conv_linear_for_every_activation_is_rejected():
    wrong = P("conv_linear_any_act", conv(E("ewadd", "x", "y"), "z", act="$c"),
              E("ewadd", conv("x", "z", act="$c"), conv("y", "z", act="$c")), x=4, y=4, z=4)
    r = check_property(wrong, per_params=1)
    assert not r.ok and "relu" in r.counterexample


def test_wrong_property_would_let_a_wrong_rule_through():
    """Why validation matters: with the wrong axiom added, Z3 'proves' a wrong rule."""
    wrong = P("conv_linear_any_act", conv(E("ewadd", "x", "y"), "z", act="$c"),
              E("ewadd", conv("x", "z", act="$c"), conv("y", "z", act="$c")), x=4, y=4, z=4)
    bad = rule([PNode.make("ewadd", ["x0", "x1"]), PNode.make("conv2d", ["n0:0", "x2"], act="relu", **CONV)], ["n1:0"],
               [PNode.make("conv2d", ["x0", "x2"], act="relu", **CONV), PNode.make("conv2d", ["x1", "x2"], act="relu", **CONV),
                PNode.make("ewadd", ["n0:0", "n1:0"])], ["n2:0"], [4, 4, 4])
    assert verify_rule(bad, Z3Env(), 3000).status != "verified"
    assert verify_rule(bad, Z3Env(PROPERTIES + [wrong]), 3000).status == "verified"
