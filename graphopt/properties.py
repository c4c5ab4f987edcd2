"""Operator properties: the axioms the verifier proves rules from (TASO's table 2, plus transformer ops).

Each property is an equation between two *terms* over tensor variables (``x``, ``y``...) and integer
parameter variables (``"$a"`` axis, ``"$s"`` stride, ``"$p"`` padding, ``"$c"`` activation, ``"$k"``
kernel, ``"$g"`` groups), optionally guarded by tensor ranks (the verifier models ``rank: T -> Int`` so a
property about "the last axis" cannot be used at the wrong rank).

The same term is used two ways:

* :func:`z3_axiom` turns it into a universally quantified Z3 formula over the uninterpreted tensor sort
  (operators are uninterpreted functions, see :mod:`graphopt.verifier`);
* :func:`check_property` *validates* it: it executes both sides with the numpy references on arrays of Z3
  real variables (relu an uninterpreted function) for small concrete shapes (every dim in 1..4) and
  parameter values, and proves the two results equal element by element.  A wrong property - e.g. "conv is
  linear for every activation" - has a counterexample there.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from graphopt import ops
from graphopt.generator import propagate_tree


@dataclass(frozen=True)
class Term:
    op: str
    args: tuple  # Term | str (tensor variable)
    params: tuple[tuple[str, Any], ...] = ()
    out: int = 0


def E(op: str, *args: Any, out: int = 0, **params: Any) -> Term:
    return Term(op, tuple(args), tuple(sorted(params.items())), out)


# concrete values tried for each parameter variable when validating
PARAM_VALUES: dict[str, tuple] = {
    "$s": ((1, 1), (2, 2), (1, 2)),
    "$p": ("SAME", "VALID"),
    "$c": ("none", "relu"),
    "$a": (0, 1, 2, 3),
    "$b": (0, 1, 2, 3),
    "$k": ((3, 3), (1, 3), (1, 1)),
    "$g": (1, 2),
}


@dataclass(frozen=True)
class Cond:
    """A side condition on a property's parameters, in its two forms kept together: ``python`` (dict param ->
    value -> bool) decides which concrete parameter values validation tries, ``z3`` ((dict param -> Z3 Int,
    rank fn) -> BoolRef) guards the axiom."""

    python: Callable[[dict], bool]
    z3: Callable[..., Any]


@dataclass(frozen=True)
class Property:
    """``lhs == rhs`` for all tensors of the given ranks (``ranks``: var -> rank; vars in ``guard`` also get a
    Z3 rank guard) and all parameter values satisfying ``cond`` (a :class:`Cond`: its Python predicate for
    validation, its Z3 form for the axiom).  ``tree_vars`` are tensors that a ``split`` reads: when validating they are
    built as a concat along ``$a`` of two fresh tensors (TASO's split-tree semantics)."""

    name: str
    lhs: Any
    rhs: Any
    ranks: tuple[tuple[str, int], ...]
    guard: tuple[str, ...] = ()
    cond: Cond | None = None
    tree_vars: tuple[str, ...] = ()
    origin: str = "taso"  # "taso" (TASO's table 2) or "ours" (transformer and bias ops)
    triggers: tuple = ()  # extra Z3 multi-patterns (tuples of terms), e.g. "both halves of a split exist"


def P(name, lhs, rhs, origin="taso", guard=(), cond=None, tree_vars=(), triggers=(), **ranks) -> Property:
    return Property(name=name, lhs=lhs, rhs=rhs, ranks=tuple(sorted(ranks.items())), guard=tuple(guard), cond=cond,
                    tree_vars=tuple(tree_vars), origin=origin, triggers=tuple(triggers))


N = dict(act="none")
PERMS = ((1, 0), (0, 2, 1), (1, 0, 2))


def _inv(perm: tuple[int, ...], a: int) -> int:
    return perm.index(a)


def conv(x, y, act="none", groups="$g", stride="$s", pad="$p"):
    return E("conv2d", x, y, stride=stride, pad=pad, act=act, groups=groups)


def _build() -> list[Property]:
    props: list[Property] = []
    add = props.append
    T2 = dict(x=2, y=2, z=2)
    # ---- element-wise algebra -----------------------------------------------------------------------
    add(P("ewadd_assoc", E("ewadd", "x", E("ewadd", "y", "z")), E("ewadd", E("ewadd", "x", "y"), "z"), **T2))
    add(P("ewadd_comm", E("ewadd", "x", "y"), E("ewadd", "y", "x"), x=2, y=2))
    add(P("ewmul_assoc", E("ewmul", "x", E("ewmul", "y", "z")), E("ewmul", E("ewmul", "x", "y"), "z"), **T2))
    add(P("ewmul_comm", E("ewmul", "x", "y"), E("ewmul", "y", "x"), x=2, y=2))
    add(P("ewmul_distrib", E("ewmul", E("ewadd", "x", "y"), "z"),
          E("ewadd", E("ewmul", "x", "z"), E("ewmul", "y", "z")), **T2))
    add(P("smul_assoc", E("smul", E("smul", "x", "y"), "w"), E("smul", "x", E("smul", "y", "w")), x=2, y=0, w=0))
    add(P("smul_distrib", E("smul", E("ewadd", "x", "y"), "w"), E("ewadd", E("smul", "x", "w"), E("smul", "y", "w")),
          x=2, y=2, w=0))
    add(P("smul_ewmul", E("smul", E("ewmul", "x", "y"), "w"), E("ewmul", "x", E("smul", "y", "w")), x=2, y=2, w=0))
    add(P("smul_matmul", E("smul", E("matmul", "x", "y"), "w"), E("matmul", "x", E("smul", "y", "w")),
          x=2, y=2, w=0))
    add(P("smul_matmul_left", E("matmul", E("smul", "x", "w"), "y"), E("smul", E("matmul", "x", "y"), "w"),
          x=2, y=2, w=0, origin="ours"))
    add(P("smul_concat", E("smul", E("concat", "x", "y", axis="$a"), "w"),
          E("concat", E("smul", "x", "w"), E("smul", "y", "w"), axis="$a"), x=2, y=2, w=0))
    add(P("smul_conv_input", E("smul", conv("x", "y"), "w"), conv(E("smul", "x", "w"), "y"), x=4, y=4, w=0))
    add(P("smul_conv_kernel", E("smul", conv("x", "y"), "w"), conv("x", E("smul", "y", "w")), x=4, y=4, w=0))
    add(P("smul_split", E("smul", E("split", "x", axis="$a", out=0), "w"),
          E("split", E("smul", "x", "w"), axis="$a", out=0), x=2, w=0, tree_vars=("x",), origin="ours"))
    # ---- relu --------------------------------------------------------------------------------------------
    add(P("conv_relu_fuse", E("relu", conv("x", "y")), conv("x", "y", act="relu"), x=4, y=4))
    add(P("relu_concat", E("relu", E("concat", "x", "y", axis="$a")),
          E("concat", E("relu", "x"), E("relu", "y"), axis="$a"), x=3, y=3))
    add(P("relu_split", E("relu", E("split", "x", axis="$a", out=1)), E("split", E("relu", "x"), axis="$a", out=1),
          x=2, tree_vars=("x",), origin="ours"))
    for perm in PERMS:
        r = len(perm)
        tag = "".join(map(str, perm))
        add(P(f"relu_transpose_{tag}", E("relu", E("transpose", "x", perm=perm)),
              E("transpose", E("relu", "x"), perm=perm), x=r))
        add(P(f"smul_transpose_{tag}", E("smul", E("transpose", "x", perm=perm), "w"),
              E("transpose", E("smul", "x", "w"), perm=perm), x=r, w=0))
        add(P(f"transpose_ewadd_{tag}", E("transpose", E("ewadd", "x", "y"), perm=perm),
              E("ewadd", E("transpose", "x", perm=perm), E("transpose", "y", perm=perm)), x=r, y=r))
        add(P(f"transpose_ewmul_{tag}", E("transpose", E("ewmul", "x", "y"), perm=perm),
              E("ewmul", E("transpose", "x", perm=perm), E("transpose", "y", perm=perm)), x=r, y=r))
        if tuple(perm[p] for p in perm) == tuple(range(r)):
            add(P(f"transpose_involution_{tag}", E("transpose", E("transpose", "x", perm=perm), perm=perm), "x", x=r))
        for a in range(r):
            add(P(f"transpose_concat_{tag}_axis{a}", E("transpose", E("concat", "x", "y", axis=a), perm=perm),
                  E("concat", E("transpose", "x", perm=perm), E("transpose", "y", perm=perm), axis=_inv(perm, a)),
                  x=r, y=r))
    add(P("transpose_matmul", E("transpose", E("matmul", "x", "y"), perm=(1, 0)),
          E("matmul", E("transpose", "y", perm=(1, 0)), E("transpose", "x", perm=(1, 0))), guard=("x", "y"),
          x=2, y=2))
    # ---- convolution ---------------------------------------------------------------------------------
    add(P("conv_linear_input", conv(E("ewadd", "x", "y"), "z"), E("ewadd", conv("x", "z"), conv("y", "z")),
          x=4, y=4, z=4))
    add(P("conv_linear_kernel", conv("x", E("ewadd", "y", "z")), E("ewadd", conv("x", "y"), conv("x", "z")),
          x=4, y=4, z=4))
    add(P("conv_add_concat", E("ewadd", conv("x", "y", groups=1), conv("z", "w", groups=1)),
          conv(E("concat", "x", "z", axis=1), E("concat", "y", "w", axis=1), groups=1), x=4, y=4, z=4, w=4))
    add(P("concat_conv_batch", E("concat", conv("x", "z", act="$c"), conv("y", "z", act="$c"), axis=0),
          conv(E("concat", "x", "y", axis=0), "z", act="$c"), x=4, y=4, z=4))
    add(P("concat_conv_out", E("concat", conv("x", "y", act="$c", groups=1), conv("x", "z", act="$c", groups=1), axis=1),
          conv("x", E("concat", "y", "z", axis=0), act="$c", groups=1), x=4, y=4, z=4))
    add(P("conv_enlarge", conv("x", "y", act="$c", pad="SAME"), conv("x", E("enlarge", "y", "z"), act="$c", pad="SAME"),
          x=4, y=4, z=4))
    add(P("conv_cpool", conv("x", E("Cpool", "z", kernel="$k"), groups=1), E("pool2d_avg", "x", kernel="$k",
                                                                                stride="$s", pad="$p"), x=4, z=4))
    add(P("conv_iconv", conv("x", E("Iconv", "w"), stride=(1, 1), pad="SAME", groups=1), "x", x=4, w=4))
    add(P("conv_iconv_relu", conv("x", E("Iconv", "w"), act="relu", stride=(1, 1), pad="SAME", groups=1),
          E("relu", "x"), x=4, w=4, origin="ours"))
    add(P("smul_pool_avg", E("pool2d_avg", E("smul", "x", "w"), kernel="$k", stride="$s", pad="$p"),
          E("smul", E("pool2d_avg", "x", kernel="$k", stride="$s", pad="$p"), "w"), x=4, w=0, origin="ours"))
    for pool in ("pool2d_max", "pool2d_avg"):
        add(P(f"{pool}_concat", E(pool, E("concat", "x", "y", axis="$a"), kernel="$k", stride="$s", pad="$p"),
              E("concat", E(pool, "x", kernel="$k", stride="$s", pad="$p"),
                E(pool, "y", kernel="$k", stride="$s", pad="$p"), axis="$a"),
              x=4, y=4, cond=Cond(lambda v: v["$a"] <= 1, lambda v, rank: v["$a"] <= 1)))
    # ---- matmul --------------------------------------------------------------------------------------
    add(P("matmul_assoc", E("matmul", E("matmul", "x", "y"), "z"), E("matmul", "x", E("matmul", "y", "z")),
          x=2, y=2, z=2))
    add(P("matmul_distrib_right", E("matmul", "x", E("ewadd", "y", "z")),
          E("ewadd", E("matmul", "x", "y"), E("matmul", "x", "z")), x=2, y=2, z=2))
    add(P("matmul_distrib_left", E("matmul", E("ewadd", "x", "y"), "z"),
          E("ewadd", E("matmul", "x", "z"), E("matmul", "y", "z")), x=2, y=2, z=2))
    add(P("matmul_imatmul", E("matmul", "x", E("Imatmul", "w")), "x", x=2, w=2))
    add(P("imatmul_matmul", E("matmul", E("Imatmul", "w"), "x"), "x", guard=("x",), x=2, w=2, origin="ours"))
    add(P("ewmul_iewmul", E("ewmul", "x", E("Iewmul", "w")), "x", x=2, w=2))
    for r in (2, 3):
        org = "taso" if r == 2 else "ours"
        add(P(f"matmul_add_concat_r{r}", E("ewadd", E("matmul", "x", "y"), E("matmul", "z", "w")),
              E("matmul", E("concat", "x", "z", axis=r - 1), E("concat", "y", "w", axis=0)),
              guard=("x",), x=r, y=2, z=r, w=2, origin=org))
        add(P(f"matmul_concat_out_r{r}", E("matmul", "x", E("concat", "y", "z", axis=1)),
              E("concat", E("matmul", "x", "y"), E("matmul", "x", "z"), axis=r - 1),
              guard=("x",), x=r, y=2, z=2, origin=org))
        add(P(f"matmul_concat_rows_r{r}", E("concat", E("matmul", "x", "y"), E("matmul", "z", "y"), axis="$a"),
              E("matmul", E("concat", "x", "z", axis="$a"), "y"), guard=("x",), x=r, y=2, z=r,
              cond=Cond(lambda v, r=r: v["$a"] <= r - 2, lambda v, rank, r=r: v["$a"] <= r - 2), origin="ours"))
    # ---- batched matmul (attention) ------------------------------------------------------------------
    add(P("bmatmul_assoc", E("bmatmul", E("bmatmul", "x", "y"), "z"), E("bmatmul", "x", E("bmatmul", "y", "z")),
          x=3, y=3, z=3, origin="ours"))
    add(P("bmatmul_distrib_right", E("bmatmul", "x", E("ewadd", "y", "z")),
          E("ewadd", E("bmatmul", "x", "y"), E("bmatmul", "x", "z")), x=3, y=3, z=3, origin="ours"))
    add(P("bmatmul_distrib_left", E("bmatmul", E("ewadd", "x", "y"), "z"),
          E("ewadd", E("bmatmul", "x", "z"), E("bmatmul", "y", "z")), x=3, y=3, z=3, origin="ours"))
    add(P("smul_bmatmul", E("smul", E("bmatmul", "x", "y"), "w"), E("bmatmul", "x", E("smul", "y", "w")),
          x=3, y=3, w=0, origin="ours"))
    add(P("smul_bmatmul_left", E("bmatmul", E("smul", "x", "w"), "y"), E("smul", E("bmatmul", "x", "y"), "w"),
          x=3, y=3, w=0, origin="ours"))
    add(P("transpose_bmatmul", E("transpose", E("bmatmul", "x", "y"), perm=(0, 2, 1)),
          E("bmatmul", E("transpose", "y", perm=(0, 2, 1)), E("transpose", "x", perm=(0, 2, 1))), x=3, y=3,
          guard=("x", "y"), origin="ours"))
    add(P("bmatmul_concat_out", E("bmatmul", "x", E("concat", "y", "z", axis=2)),
          E("concat", E("bmatmul", "x", "y"), E("bmatmul", "x", "z"), axis=2), x=3, y=3, z=3, origin="ours"))
    add(P("bmatmul_concat_rows", E("concat", E("bmatmul", "x", "y"), E("bmatmul", "z", "y"), axis=1),
          E("bmatmul", E("concat", "x", "z", axis=1), "y"), x=3, y=3, z=3, origin="ours"))
    add(P("bmatmul_concat_batch", E("concat", E("bmatmul", "x", "y"), E("bmatmul", "z", "w"), axis=0),
          E("bmatmul", E("concat", "x", "z", axis=0), E("concat", "y", "w", axis=0)), x=3, y=3, z=3, w=3,
          origin="ours"))
    add(P("bmatmul_add_concat", E("ewadd", E("bmatmul", "x", "y"), E("bmatmul", "z", "w")),
          E("bmatmul", E("concat", "x", "z", axis=2), E("concat", "y", "w", axis=1)), x=3, y=3, z=3, w=3,
          origin="ours"))
    # ---- concat / split ----------------------------------------------------------------------------
    add(P("concat_ewadd", E("concat", E("ewadd", "x", "y"), E("ewadd", "z", "w"), axis="$a"),
          E("ewadd", E("concat", "x", "z", axis="$a"), E("concat", "y", "w", axis="$a")), x=2, y=2, z=2, w=2))
    add(P("concat_ewmul", E("concat", E("ewmul", "x", "y"), E("ewmul", "z", "w"), axis="$a"),
          E("ewmul", E("concat", "x", "z", axis="$a"), E("concat", "y", "w", axis="$a")), x=2, y=2, z=2, w=2))
    add(P("concat_interchange", E("concat", E("concat", "x", "y", axis="$b"), E("concat", "z", "w", axis="$b"),
                                  axis="$a"),
          E("concat", E("concat", "x", "z", axis="$a"), E("concat", "y", "w", axis="$a"), axis="$b"),
          x=3, y=3, z=3, w=3, cond=Cond(lambda v: v["$a"] != v["$b"], lambda v, rank: v["$a"] != v["$b"])))
    add(P("split0_concat", E("split", E("concat", "x", "y", axis="$a"), axis="$a", out=0), "x", x=2, y=2))
    add(P("split1_concat", E("split", E("concat", "x", "y", axis="$a"), axis="$a", out=1), "y", x=2, y=2))
    add(P("concat_split", E("concat", E("split", "x", axis="$a", out=0), E("split", "x", axis="$a", out=1),
                            axis="$a"), "x", x=2, tree_vars=("x",), origin="ours",
          triggers=((E("split", "x", axis="$a", out=0), E("split", "x", axis="$a", out=1)),)))
    # ---- bias add (broadcast) ------------------------------------------------------------------------
    add(P("bias_concat", E("concat", E("bias_add", "x", "b"), E("bias_add", "y", "d"), axis="$a"),
          E("bias_add", E("concat", "x", "y", axis="$a"), E("concat", "b", "d", axis="$b")),
          x=3, y=3, b=1, d=1,
          cond=Cond(lambda v: v["$a"] - v["$b"] == 2, lambda v, rank: v["$a"] - v["$b"] == rank("x") - rank("b")),
          origin="ours"))
    add(P("bias_concat_shared", E("concat", E("bias_add", "x", "b"), E("bias_add", "y", "b"), axis="$a"),
          E("bias_add", E("concat", "x", "y", axis="$a"), "b"), x=3, y=3, b=1,
          cond=Cond(lambda v: v["$a"] < 2, lambda v, rank: v["$a"] < rank("x") - rank("b")), origin="ours"))
    add(P("bias_ewadd", E("bias_add", E("ewadd", "x", "y"), "b"), E("ewadd", E("bias_add", "x", "b"), "y"),
          x=3, y=3, b=1, origin="ours"))
    add(P("bias_comm", E("bias_add", E("bias_add", "x", "b"), "d"), E("bias_add", E("bias_add", "x", "d"), "b"),
          x=3, b=1, d=1, origin="ours"))
    add(P("bias_smul", E("smul", E("bias_add", "x", "b"), "w"), E("bias_add", E("smul", "x", "w"), E("smul", "b", "w")),
          x=3, b=1, w=0, origin="ours"))
    return props


PROPERTIES: list[Property] = _build()


_SAME_RANK_OPS = ("ewadd", "ewmul", "concat", "bmatmul", "enlarge")


def rank_of(t: Any, same: dict[str, str] | None = None) -> Any:
    """Rank of a term as the verifier's rank axioms compute it (rank of the first data input; fixed for
    Cpool and Imatmul): a variable name, canonicalised through ``same``, or an int."""
    if isinstance(t, str):
        return _find(same or {}, t)
    if t.op == "Cpool":
        return 4
    if t.op == "Imatmul":
        return 2
    return rank_of(t.args[0], same)


def _find(parent: dict[str, str], v: str) -> str:
    while parent.get(v, v) != v:
        v = parent[v]
    return v


def _equal_rank_vars(t: Any, parent: dict[str, str]) -> None:
    """Union variables that the shape rules force to one rank (operands of ewadd, concat, ...)."""
    if isinstance(t, str):
        return
    for a in t.args:
        _equal_rank_vars(a, parent)
    if t.op in _SAME_RANK_OPS:
        ra = [rank_of(a, parent) for a in t.args]
        for r in ra[1:]:
            if isinstance(r, str) and isinstance(ra[0], str) and r != ra[0]:
                parent[r] = ra[0]


def rank_consistent(prop: Property) -> bool:
    """Both sides must have the same rank under the rank axioms (else the axiom would equate tensors of
    different ranks and make everything provable).  Ranks equal when they come from the same variable, from
    variables the shape rules force to one rank, or from variables rank-guarded to the same value."""
    parent: dict[str, str] = {}
    _equal_rank_vars(prop.lhs, parent)
    _equal_rank_vars(prop.rhs, parent)
    a, b = rank_of(prop.lhs, parent), rank_of(prop.rhs, parent)
    if a == b:
        return True
    ranks = dict(prop.ranks)
    guarded = {_find(parent, v): ranks[v] for v in prop.guard}
    fix = lambda r: r if isinstance(r, int) else guarded.get(r)  # noqa: E731
    return fix(a) is not None and fix(a) == fix(b)


# ---- Z3 axioms -------------------------------------------------------------------------------------------

def tensor_vars(t: Any, acc: list[str] | None = None) -> list[str]:
    acc = [] if acc is None else acc
    if isinstance(t, str):
        if t not in acc:
            acc.append(t)
    else:
        for a in t.args:
            tensor_vars(a, acc)
    return acc


def param_vars(t: Any, acc: list[str] | None = None) -> list[str]:
    acc = [] if acc is None else acc
    if isinstance(t, Term):
        for _, v in t.params:
            if isinstance(v, str) and v.startswith("$") and v not in acc:
                acc.append(v)
        for a in t.args:
            param_vars(a, acc)
    return acc


def z3_term(t: Any, env: Any, tvars: dict, ivars: dict):
    """Z3 term of a property side; ``env`` is a :class:`graphopt.verifier.Z3Env`."""
    if isinstance(t, str):
        return tvars[t]
    params = dict(t.params)
    ints = []
    for key in ops.REGISTRY[t.op].z3_params:
        v = params.get(key, 1 if key == "groups" else "none" if key == "act" else None)
        ints.append(ivars[v] if isinstance(v, str) and v.startswith("$") else ops.encode_param(key, v))
    return env.apply(t.op, t.out, ints, [z3_term(a, env, tvars, ivars) for a in t.args])


def z3_axiom(prop: Property, env: Any):
    import z3
    if not rank_consistent(prop):
        raise ValueError(f"property {prop.name}: sides have different ranks unless guarded; add a rank guard")
    names = tensor_vars(prop.lhs) + [v for v in tensor_vars(prop.rhs) if v not in tensor_vars(prop.lhs)]
    tvars = {n: z3.Const(f"{prop.name}_{n}", env.T) for n in names}
    pv = param_vars(prop.lhs) + [v for v in param_vars(prop.rhs) if v not in param_vars(prop.lhs)]
    ivars = {p: z3.Int(f"{prop.name}_p{p[1:]}") for p in pv}
    lhs, rhs = z3_term(prop.lhs, env, tvars, ivars), z3_term(prop.rhs, env, tvars, ivars)
    conds = [env.rank(tvars[v]) == dict(prop.ranks)[v] for v in prop.guard]
    # operands the shape rules force to one rank (ewadd(x, y): rank x == rank y) get an explicit guard:
    # unguarded, ewadd(x, y) == ewadd(y, x) would equate ranks of *all* tensors, and with Imatmul (rank 2)
    # and Cpool (rank 4) the axioms would be inconsistent - every rule "provable"
    parent: dict[str, str] = {}
    _equal_rank_vars(prop.lhs, parent)
    _equal_rank_vars(prop.rhs, parent)
    conds += [env.rank(tvars[v]) == env.rank(tvars[_find(parent, v)]) for v in parent if _find(parent, v) != v]
    if prop.cond is not None:
        conds.append(prop.cond.z3(ivars, lambda v: env.rank(tvars[v])))
    body = lhs == rhs if not conds else z3.Implies(z3.And(*conds), lhs == rhs)
    patterns = [s for s, side in ((lhs, prop.lhs), (rhs, prop.rhs))
                if isinstance(side, Term) and set(tensor_vars(side)) == set(names)
                and set(param_vars(side)) == set(pv)]
    patterns += [z3.MultiPattern(*(z3_term(t, env, tvars, ivars) for t in group)) for group in prop.triggers]
    bound = list(tvars.values()) + list(ivars.values())
    return z3.ForAll(bound, body, patterns=patterns) if patterns else z3.ForAll(bound, body)


# ---- validation on small concrete shapes ------------------------------------------------------------------

class _Val:
    """A value during symbolic execution: array plus split tree (axis -> sizes), like generator tensors."""

    def __init__(self, arr: np.ndarray, tree: dict | None = None):
        if not isinstance(arr, np.ndarray):  # 0-d object arithmetic returns a bare Z3 term
            box = np.empty((), dtype=object)
            box[()] = arr
            arr = box
        self.value = arr
        self.shape = arr.shape
        self.tree = tree or {}


def _exec(t: Any, env: dict[str, _Val], pvals: dict, arith) -> _Val:
    if isinstance(t, str):
        return env[t]
    ins = [_exec(a, env, pvals, arith) for a in t.args]
    params = {k: (pvals[v] if isinstance(v, str) and v.startswith("$") else v) for k, v in t.params}
    spec = ops.REGISTRY[t.op]
    if t.op == "split":
        tree = ins[0].tree.get(params["axis"])
        if tree is None:
            raise ValueError("split of a tensor without a concat boundary on that axis")
        params["sizes"] = tuple(int(s) for s in tree)
    shapes = spec.shape(params, [i.shape for i in ins])
    outs = spec.ref(params, [i.value for i in ins], arith)
    tree = propagate_tree(t.op, params, ins, len(shapes[t.out]), t.out)
    return _Val(outs[t.out], tree)


def _instances(prop: Property, per_params: int, rng: random.Random) -> Iterator[tuple[dict, dict]]:
    """(param values, var -> shape) pairs where both sides are shape-valid with equal output shapes."""
    pv = param_vars(prop.lhs) + [v for v in param_vars(prop.rhs) if v not in param_vars(prop.lhs)]
    ranks = dict(prop.ranks)
    for combo in itertools.product(*(PARAM_VALUES[p] for p in pv)):
        pvals = dict(zip(pv, combo))
        if prop.cond is not None and not prop.cond.python(pvals):
            continue
        found: list[dict] = []
        for _ in range(1500):
            # dims drawn from a random subset of 1..4, so that the equalities a property needs (shared
            # channels, equal shapes) come up often
            pool = rng.sample((1, 2, 3, 4), rng.choice((1, 2, 2, 3, 4)))
            shapes = {v: tuple(rng.choice(pool) for _ in range(r)) for v, r in ranks.items()}
            for v in prop.tree_vars:
                shapes[v + "@l"] = shapes[v]
                shapes[v + "@r"] = tuple(rng.choice(pool) for _ in range(ranks[v]))
            if shapes in found:
                continue
            try:
                env = _env(prop, shapes, pvals, None)
                a = _exec(prop.lhs, env, pvals, ops.INT)
                b = _exec(prop.rhs, env, pvals, ops.INT)
            except (ValueError, KeyError):
                continue
            if a.shape == b.shape:
                found.append(shapes)
                yield pvals, shapes
                if len(found) >= per_params:
                    break


def _env(prop: Property, shapes: dict, pvals: dict, arith) -> dict[str, _Val]:
    """Symbolic (or, with arith None, integer) input tensors; tree vars are concats of two halves."""
    env: dict[str, _Val] = {}
    for v, shape in shapes.items():
        if "@" in v:
            continue
        if v in prop.tree_vars:
            halves = [_leaf(f"{v}{h}", shapes[v + h], arith) for h in ("@l", "@r")]
            env[v] = _exec(E("concat", "l", "r", axis=pvals.get("$a", 0)), {"l": halves[0], "r": halves[1]},
                           pvals, ops.INT if arith is None else arith)
        else:
            env[v] = _leaf(v, shape, arith)
    return env


def _leaf(name: str, shape: tuple, arith) -> _Val:
    if arith is None:
        return _Val(np.random.default_rng(abs(hash(name)) % 2**32).integers(-5, 6, size=shape).astype(np.int64))
    import z3
    arr = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        arr[idx] = z3.Real(f"{name}_{'_'.join(map(str, idx))}")
    return _Val(arr)


@dataclass
class PropertyCheck:
    name: str
    ok: bool
    instances: int
    counterexample: str = ""
    redundant: bool = False
    extra: dict = field(default_factory=dict)


def check_property(prop: Property, per_params: int = 2, seed: int = 0, timeout_ms: int = 20000) -> PropertyCheck:
    """Prove ``prop`` on small concrete shapes by symbolic execution (see module docstring)."""
    import z3
    arith = ops.symbolic_arith()
    rng = random.Random(seed)
    n = 0
    for pvals, shapes in _instances(prop, per_params, rng):
        env = _env(prop, shapes, pvals, arith)
        a = _exec(prop.lhs, env, pvals, arith).value
        b = _exec(prop.rhs, env, pvals, arith).value
        s = z3.Solver()
        s.set("timeout", timeout_ms)
        s.add(z3.Or([z3.simplify(_real(u) - _real(v)) != 0 for u, v in zip(a.ravel(), b.ravel())]))
        n += 1
        if s.check() != z3.unsat:
            shown = {k: v for k, v in shapes.items() if "@" not in k}
            return PropertyCheck(prop.name, False, n, f"params {pvals} shapes {shown}")
    return PropertyCheck(prop.name, n > 0, n, "" if n else "no valid shape instance found")


def _real(v: Any):
    import z3
    return v if isinstance(v, z3.ExprRef) else z3.RealVal(int(v) if isinstance(v, (np.integer, int)) else v)
