"""Substitution rules: the data the generator produces, the verifier proves and the search applies.

A rule is a pair of small patterns over the operator set of :mod:`graphopt.ops` that compute the same
function of shared pattern inputs ``x0, x1, ...``.  A pattern is a tuple of nodes in topological order;
a node's inputs are either pattern inputs (``"x3"``) or an output of an earlier node (``"n2:0"`` = output
0 of node 2).  ``outputs`` lists the pattern's results; source and target outputs correspond by position
(multi-output rules have several).  Operator parameters (axis, stride, padding, activation, perm...) are
concrete values, as in TASO: a rule matches a graph node only with equal parameters, and tensor shapes are
re-checked by shape inference when the rule is applied.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from graphopt.errors import UserError
from graphopt.fileio import write_text_atomic


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


@dataclass(frozen=True)
class PNode:
    """One operator in a pattern: op name from the registry, parameters, input references."""

    op: str
    inputs: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()
    n_outputs: int = 1

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    @staticmethod
    def make(op: str, inputs: Iterable[str], n_outputs: int = 1, **params: Any) -> "PNode":
        return PNode(op, tuple(inputs), tuple(sorted((k, _freeze(v)) for k, v in params.items())), n_outputs)


@dataclass(frozen=True)
class Pattern:
    nodes: tuple[PNode, ...]
    outputs: tuple[str, ...]

    def input_names(self) -> list[str]:
        """Pattern inputs used, ordered by index (x0, x1, ...)."""
        used = {i for n in self.nodes for i in n.inputs if i.startswith("x")} | {
            o for o in self.outputs if o.startswith("x")}
        return sorted(used, key=lambda s: int(s[1:]))

    def render(self) -> str:
        """Readable nested form, e.g. ``matmul(x0,concat[axis=1](x1,x2))``; shared nodes print as ``%k``."""
        uses: dict[int, int] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i.startswith("n"):
                    k = int(i[1:].split(":")[0])
                    uses[k] = uses.get(k, 0) + 1
        for o in self.outputs:
            if o.startswith("n"):
                k = int(o[1:].split(":")[0])
                uses[k] = uses.get(k, 0) + 1

        def ref(r: str, top: bool = False) -> str:
            if r.startswith("x"):
                return r
            k, _, port = r[1:].partition(":")
            node = self.nodes[int(k)]
            suffix = f".{port}" if node.n_outputs > 1 else ""
            if uses.get(int(k), 0) > 1 and not top:
                return f"%{k}{suffix}"
            params = ",".join(f"{a}={_fmt(b)}" for a, b in node.params)
            head = node.op + (f"[{params}]" if params else "")
            return f"{head}({','.join(ref(i) for i in node.inputs)}){suffix}"

        shared = [k for k, c in sorted(uses.items()) if c > 1]
        lets = [f"%{k}={ref(f'n{k}:0', top=True).rsplit('.', 1)[0] if self.nodes[k].n_outputs > 1 else ref(f'n{k}:0', top=True)}"
                for k in shared]
        body = ", ".join(ref(o) for o in self.outputs)
        return (" where ".join([body, "; ".join(lets)]) if lets else body)

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [{"op": n.op, "inputs": list(n.inputs), "params": {k: _thaw(v) for k, v in n.params},
                           **({"n_outputs": n.n_outputs} if n.n_outputs != 1 else {})} for n in self.nodes],
                "outputs": list(self.outputs)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Pattern":
        return Pattern(tuple(PNode.make(n["op"], n["inputs"], n.get("n_outputs", 1), **n.get("params", {}))
                             for n in d["nodes"]), tuple(d["outputs"]))


def _thaw(v: Any) -> Any:
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


def _fmt(v: Any) -> str:
    return "x".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


@dataclass(frozen=True)
class Rule:
    """``src`` may be replaced by ``dst``; ``verified`` is True only with a Z3 proof."""

    name: str
    src: Pattern
    dst: Pattern
    verified: bool = False
    # ranks of x0, x1, ... in the generator's domain: the rule is proved for inputs of these ranks (axes in
    # concat/split/transpose params are absolute); empty when unknown
    input_ranks: tuple[int, ...] = ()

    def render(self) -> str:
        return f"{self.src.render()} => {self.dst.render()}"

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "src": self.src.to_json(), "dst": self.dst.to_json(), "verified": self.verified}
        if self.input_ranks:
            d["input_ranks"] = list(self.input_ranks)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Rule":
        return Rule(d["name"], Pattern.from_json(d["src"]), Pattern.from_json(d["dst"]), bool(d.get("verified")),
                    tuple(d.get("input_ranks", ())))


LIBRARY_PATH = Path(__file__).parent / "data" / "rules.json"


def save_rules(rules: list[Rule], path: str | Path, meta: dict[str, Any] | None = None) -> None:
    doc = {"meta": meta or {}, "rules": [r.to_json() for r in rules]}
    write_text_atomic(path, json.dumps(doc, indent=None, separators=(",", ":")) + "\n")


def load_rules(path: str | Path = LIBRARY_PATH, verified_only: bool = True) -> list[Rule]:
    """Load a rule library; unverified rules are never handed to the optimizer."""
    doc = json.loads(Path(path).read_text())
    rules = [Rule.from_json(r) for r in doc["rules"]]
    return [r for r in rules if r.verified] if verified_only else rules


def load_meta(path: str | Path = LIBRARY_PATH) -> dict[str, Any]:
    return json.loads(Path(path).read_text()).get("meta", {})


def verified_library() -> list[Rule]:
    """The shipped verified library, or a one-line error saying how to build it."""
    if not LIBRARY_PATH.exists():
        raise UserError(f"rule library {LIBRARY_PATH} is missing: run `graphopt rules generate` to build it")
    rules = load_rules()
    if not rules:
        raise UserError(f"rule library {LIBRARY_PATH} holds no verified rule: rebuild it with `graphopt rules generate`")
    return rules


def merge_rules(rules: list[Rule]) -> list[Rule]:
    """The merge substitutions among ``rules``: ops side by side in the source (or on the outputs of one
    split), one op on concatenated weights followed by a split in the target (matmul+matmul,
    conv2d+conv2d(+relu), and split+bias_add+bias_add, which moves merged biases before the split)."""
    out = []
    for r in rules:
        ops = r.name.split(":", 1)[-1]  # generated rules are named "r0742:matmul+matmul->concat+matmul+split"
        if "->" not in ops:
            continue
        src, dst = ops.split("->", 1)
        if "concat" not in src and "concat" in dst and "split" in dst:
            out.append(r)
    return out
