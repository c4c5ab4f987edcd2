"""Z3 verifier: a rule enters the library only if Z3 proves ``src != dst`` unsatisfiable from the axioms.

Tensors are an uninterpreted sort ``T``; every operator output is an uninterpreted function
``<op>[_<k>](ints..., tensors...) -> T`` whose integer arguments encode the op's parameters
(:func:`graphopt.ops.z3_args`; split sizes are not arguments: a split undoes the latest concat, TASO's
split-tree semantics).  A function ``rank: T -> Int`` (one axiom per op: the output rank is the first data
input's rank) lets rank-dependent properties ("concat on the last axis") carry a guard, and each rule is
proved for the input ranks of the domain it was generated in.  Each property of
:mod:`graphopt.properties` is a quantified axiom with its sides as E-matching triggers.

Verdicts: ``verified`` (unsat), ``rejected`` (sat: the axioms admit a model where the sides differ) or
``unverified`` (unknown / timeout).  Only verified rules are shipped.  Z3 contexts are per process, so
:func:`verify_rules` runs a process pool where every worker builds its own axioms once.
"""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from graphopt import ops
from graphopt.properties import PROPERTIES, Property, param_vars, tensor_vars, z3_axiom, z3_term
from graphopt.rules import Rule

DEFAULT_TIMEOUT_MS = 1500


class Z3Env:
    """Sort, operator functions, rank function and axioms for one Z3 context."""

    def __init__(self, properties: Sequence[Property] = PROPERTIES):
        import z3
        self.z3 = z3
        self.T = z3.DeclareSort("T")
        self.rank = z3.Function("rank", self.T, z3.IntSort())
        self.funcs: dict[tuple[str, int], z3.FuncDeclRef] = {}
        self.rank_axioms = [self._rank_axiom(op) for op in ops.REGISTRY]
        self.props = [(p, z3_axiom(p, self), _ops_of(p.lhs) | _ops_of(p.rhs)) for p in properties]
        self.axioms = self.rank_axioms + [a for _, a, _ in self.props]

    def relevant(self, opset: set[str]) -> list:
        """Axioms of the properties that only mention operators in ``opset`` (plus the rank axioms)."""
        return self.rank_axioms + [a for _, a, o in self.props if o <= opset]

    def func(self, op: str, out: int):
        key = (op, out)
        if key not in self.funcs:
            spec = ops.REGISTRY[op]
            name = op if spec.n_outputs == 1 else f"{op}_{out}"
            sig = [self.z3.IntSort()] * len(spec.z3_params) + [self.T] * spec.n_inputs + [self.T]
            self.funcs[key] = self.z3.Function(name, *sig)
        return self.funcs[key]

    def apply(self, op: str, out: int, ints: Sequence, tensors: Sequence):
        z3 = self.z3
        args = [z3.IntVal(i) if isinstance(i, int) else i for i in ints] + list(tensors)
        return self.func(op, out)(*args)

    def _rank_axiom(self, op: str):
        z3 = self.z3
        spec = ops.REGISTRY[op]
        ints = [z3.Int(f"r_{op}_i{k}") for k in range(len(spec.z3_params))]
        ts = [z3.Const(f"r_{op}_t{k}", self.T) for k in range(spec.n_inputs)]
        outs = [self.apply(op, k, ints, ts) for k in range(spec.n_outputs)]
        if op == "Cpool":
            same = [self.rank(o) == 4 for o in outs]
        elif op == "Imatmul":
            same = [self.rank(o) == 2 for o in outs]
        else:
            same = [self.rank(o) == self.rank(ts[0]) for o in outs]
        return z3.And([z3.ForAll(ints + ts, s, patterns=[o]) for s, o in zip(same, outs)])

    def pattern_terms(self, rule_side, inputs: list) -> list:
        """Z3 terms of a pattern's outputs over the given input constants."""
        vals: dict[str, object] = {f"x{i}": x for i, x in enumerate(inputs)}
        for k, n in enumerate(rule_side.nodes):
            args = ops.z3_args(n.op, n.param_dict)
            ins = [vals[i] for i in n.inputs]
            for j in range(n.n_outputs):
                vals[f"n{k}:{j}"] = self.apply(n.op, j, args, ins)
        return [vals[o] for o in rule_side.outputs]


@dataclass(frozen=True)
class Verdict:
    status: str  # "verified" | "rejected" | "unverified"
    seconds: float


def verify_rule(rule: Rule, env: Z3Env, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> Verdict:
    """Prove ``src == dst`` from the axioms.

    First with only the properties whose operators all occur in the rule (E-matching then explores far
    fewer terms, which is what makes most proofs take milliseconds), then, if that did not prove it, with
    all properties.  Dropping axioms can only lose proofs, never create wrong ones, and only the full set
    can reject a rule (a model of all axioms where the sides differ).
    """
    import time
    t0 = time.perf_counter()
    opset = {n.op for n in rule.src.nodes + rule.dst.nodes}
    subset = env.relevant(opset)
    res = None
    if len(subset) < len(env.axioms):
        res = _check(rule, env, subset, max(1, timeout_ms // 3))
    if res != "verified":
        left = timeout_ms - int(1000 * (time.perf_counter() - t0))
        res = _check(rule, env, env.axioms, max(1, left))
    return Verdict(res, time.perf_counter() - t0)


def _check(rule: Rule, env: Z3Env, axioms: list, timeout_ms: int) -> str:
    z3 = env.z3
    n_in = 1 + max([int(x[1:]) for x in rule.src.input_names() + rule.dst.input_names()] + [-1])
    xs = [z3.Const(f"x{i}", env.T) for i in range(n_in)]
    s = z3.Solver()
    s.set("timeout", timeout_ms)
    s.set("smt.mbqi", False)
    s.add(axioms)
    for x, r in zip(xs, rule.input_ranks):
        s.add(env.rank(x) == r)
    src = env.pattern_terms(rule.src, xs)
    dst = env.pattern_terms(rule.dst, xs)
    s.add(z3.Or([a != b for a, b in zip(src, dst)]))
    res = s.check()
    return "verified" if res == z3.unsat else "rejected" if res == z3.sat else "unverified"


def _ops_of(t) -> set[str]:
    if isinstance(t, str):
        return set()
    out = {t.op}
    for a in t.args:
        out |= _ops_of(a)
    return out


_ENV: Z3Env | None = None
_TIMEOUT = DEFAULT_TIMEOUT_MS


def _init(timeout_ms: int) -> None:
    global _ENV, _TIMEOUT
    _ENV, _TIMEOUT = Z3Env(), timeout_ms


def _work(item: tuple[int, Rule]) -> tuple[int, Verdict]:
    i, rule = item
    return i, verify_rule(rule, _ENV, _TIMEOUT)


def verify_rules(rules: Sequence[Rule], jobs: int = 2, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 ) -> Iterator[tuple[int, Verdict]]:
    """Verify in a process pool (Z3 contexts are per process); yields (index, verdict) as they finish."""
    items: Iterable[tuple[int, Rule]] = list(enumerate(rules))
    if jobs <= 1:
        _init(timeout_ms)
        for item in items:
            yield _work(item)
        return
    ctx = mp.get_context("fork")
    with ctx.Pool(jobs, initializer=_init, initargs=(timeout_ms,)) as pool:
        yield from pool.imap_unordered(_work, items, chunksize=4)


def redundant_properties(properties: Sequence[Property] = PROPERTIES, timeout_ms: int = 2000) -> list[str]:
    """Names of properties that Z3 proves from all the others (within ``timeout_ms`` each)."""
    env = Z3Env(properties)
    z3 = env.z3
    out = []
    for i, p in enumerate(properties):
        others = env.rank_axioms + [a for j, (_, a, _) in enumerate(env.props) if j != i]
        names = tensor_vars(p.lhs) + [v for v in tensor_vars(p.rhs) if v not in tensor_vars(p.lhs)]
        tvars = {n: z3.Const(f"c_{n}", env.T) for n in names}
        ivars = {v: z3.Int(f"c_p{v[1:]}") for v in param_vars(p.lhs) + param_vars(p.rhs)}
        s = z3.Solver()
        s.set("timeout", timeout_ms)
        s.set("smt.mbqi", False)
        s.add(others)
        s.add([env.rank(tvars[v]) == dict(p.ranks)[v] for v in p.guard])
        s.add([env.rank(tvars[v]) == r for v, r in p.ranks])  # a concrete instance of the property's ranks
        if p.cond is not None:
            s.add(p.cond.z3(ivars, lambda v: env.rank(tvars[v])))
        s.add(z3_term(p.lhs, env, tvars, ivars) != z3_term(p.rhs, env, tvars, ivars))
        if s.check() == z3.unsat:
            out.append(p.name)
    return out
