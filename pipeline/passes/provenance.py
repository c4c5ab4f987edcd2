"""Which ONNX nodes each kernel call of the compiled model computes: what lets a profile name its kernels in
the user's terms (``fused_matmul3_add5_divide1_fast_erf_add6`` is ``/encoder/layer.0/intermediate/dense/MatMul``
and its bias and GELU), and line them up with onnxruntime's own profile of the same model.

TVM's ONNX importer records no provenance, and LegalizeOps drops the spans of the calls it replaces.  So the
node name travels in two carriers, each where it survives:

1. **Spans, from the importer to the fusion.**  :func:`tagged_import` wraps the importer's per-node converter
   (and the BlockBuilder's ``emit`` and ``normalize`` while it runs, for what a converter binds itself) and
   gives every call it builds a span whose source name is the ONNX node's name.  Our Relax rewrites carry a
   call's span into what replaces it (:func:`tag_normalized`); TVM's ConvertLayout drops them, and
   :func:`carry_spans` restores them.  A binding without a span (FastMathTransform's) is credited to the node
   its variable had before, else to that of the call that consumes it (:func:`binding_nodes`).
2. **Binding variables, through LegalizeOps and FuseOps.**  LegalizeOps keeps the variables it binds.  A
   fused call is matched to the bindings it fused by replaying its function on its arguments
   (:func:`fused_nodes`); main's calls after FuseTIR keep their variables (:func:`call_sites`).

A call whose nodes could not be traced lists none; a profile shows it under its kernel name alone.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

import onnx
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from graphopt.onnx_io import node_names

_CALL_TIR = "relax.call_tir"
_IMPORTING = threading.Lock()  # tagged_import patches the importer process-wide: one import at a time


@dataclass(frozen=True)
class CallSite:
    """One kernel call in ``main``, in execution order: the kernel's global name and the ONNX nodes it
    computes (first node first)."""

    kernel: str
    nodes: tuple[str, ...]

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "nodes": list(self.nodes)}

    @classmethod
    def from_json(cls, d: dict) -> "CallSite":
        return cls(str(d["kernel"]), tuple(str(n) for n in d.get("nodes") or ()))


def tag_normalized(bb: relax.BlockBuilder, expr: relax.Expr, span: tvm.ir.Span | None,
                   normalize=None, memo: dict | None = None) -> relax.Expr:
    """``expr`` normalized by ``bb`` (``normalize``: how; default the builder's own) with every call it builds
    carrying ``span``.  Bottom up: normalizing a call binds its nested calls, and a call whose arguments that
    changes is rebuilt without its span; so the arguments are normalized first, and a call that still lost
    its span gets it back in a second normalization, which keeps a call whose arguments are bound.  A call
    reached twice is done once (``memo``, by object): the builder binds an expression used twice once."""
    if span is None:
        return expr
    normalize = normalize or relax.BlockBuilder.normalize
    memo = {} if memo is None else memo
    key = expr.__chandle__()
    if key in memo:
        return memo[key]
    out = expr
    if isinstance(expr, relax.Call) and expr.span is None:
        args = [tag_normalized(bb, a, span, normalize, memo) for a in expr.args]
        out = normalize(bb, relax.Call(expr.op, args, expr.attrs, expr.ty_args, span))
        if isinstance(out, relax.Call) and out.span is None:
            out = normalize(bb, relax.Call(out.op, out.args, out.attrs, out.ty_args, span))
    elif isinstance(expr, relax.Tuple):
        fields = [tag_normalized(bb, f, span, normalize, memo) for f in expr.fields]
        out = normalize(bb, relax.Tuple(fields) if any(not f.same_as(g) for f, g in zip(fields, expr.fields))
                        else expr)
    memo[key] = out
    return out


@contextlib.contextmanager
def tagged_import(model: onnx.ModelProto) -> Iterator[None]:
    """Inside: TVM's ONNX importer tags the calls each node of ``model`` converts to with the node's name (a
    span).  Unnamed nodes are named as the graph IR names them (:func:`graphopt.onnx_io.node_names`) for the
    while, so optimized.onnx, which the graph IR writes, names them alike.

    Why a patch: the importer takes no hook, and its per-node converter is the one place that knows both the
    node and the expression built for it (the node's name arrives in ``attr["tvm_custom"]``); what a
    converter binds itself goes through ``BlockBuilder.emit`` and ``normalize``, also patched.  The patches are
    process-wide, so imports take turns (two threads of a server calling :func:`pipeline.optimize`), and the
    original methods are restored on the way out."""
    with _IMPORTING:  # first: the methods saved below must be the originals, not another import's patches
        yield from _tagging(model)


def _tagging(model: onnx.ModelProto) -> Iterator[None]:
    from tvm.relax.frontend.onnx import onnx_frontend

    cls = onnx_frontend.ONNXGraphImporter
    builder = relax.BlockBuilder
    convert, emit, normalize = cls._convert_operator, builder.emit, builder.normalize
    current: list[tvm.ir.Span] = []  # the node being converted
    importer = threading.get_ident()  # the patches are process-wide: other threads' builders are left alone

    def tagged(self, op_name, inputs, attr, opset):
        name = (attr.get("tvm_custom") or {}).get("name")
        if not name:
            return convert(self, op_name, inputs, attr, opset)
        current.append(_span(str(name)))
        try:
            out = convert(self, op_name, inputs, attr, opset)
        finally:
            current.pop()
        if not isinstance(out, relax.Expr) or isinstance(out, relax.Var):
            return out
        return tag_normalized(self.bb, out, _span(str(name)), normalize)

    # What a converter binds itself (a Conv's conv2d before its bias add) goes through these two
    def normalize_tagged(bb, expr):
        if not current or not isinstance(expr, relax.Expr) or threading.get_ident() != importer:
            return normalize(bb, expr)
        return tag_normalized(bb, expr, current[-1], normalize)

    def emit_tagged(bb, expr, name_hint=""):
        return emit(bb, normalize_tagged(bb, expr), name_hint)

    unnamed = [(n, name) for n, name in zip(model.graph.node, node_names(model.graph)) if name and not n.name]
    for n, name in unnamed:
        n.name = name
    cls._convert_operator, builder.emit, builder.normalize = tagged, emit_tagged, normalize_tagged
    try:
        yield
    finally:
        cls._convert_operator, builder.emit, builder.normalize = convert, emit, normalize
        for n, _ in unnamed:
            n.name = ""


def _span(node: str) -> tvm.ir.Span:
    return tvm.ir.Span(tvm.ir.SourceName(node), 0, 0, 0, 0)


def _op_name(value) -> str | None:
    op = getattr(value, "op", None) if isinstance(value, relax.Call) else None
    return op.name if isinstance(op, tvm.ir.Op) else None


def carry_spans(before: tvm.IRModule, after: tvm.IRModule, inserted: str = "relax.layout_transform") -> tvm.IRModule:
    """``after`` (``before`` through a pass that rebuilds calls without their spans but keeps their order
    and operators, adding only ``inserted`` calls: Relax's ConvertLayout) with each call's span restored
    from the call of ``before`` it replaced: the two binding lists walked side by side, matched by operator."""
    old = [b for b in _bindings(before["main"]) if _op_name(b.value)]
    nodes: dict[relax.Var, str] = {}
    k = 0
    for b in _bindings(after["main"]):
        op = _op_name(b.value)
        if op is None or op == inserted:
            continue
        while k < len(old) and _op_name(old[k].value) != op:
            k += 1
        if k == len(old):
            break
        node = _node_of(old[k].value)
        if node is not None and _node_of(b.value) is None:
            nodes[b.var] = node
        k += 1
    if not nodes:
        return after
    retagger = _Retag(after)
    retagger.nodes = nodes
    for gv, func in after.functions_items():
        if isinstance(func, relax.Function):
            retagger.builder_.update_func(gv, retagger.visit_expr(func))
    return retagger.builder_.get()


@mutator
class _Retag(PyExprMutator):
    """Gives the calls bound to the variables of ``nodes`` their node's span."""

    nodes: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # noqa: N802 - TVM's visitor name
        value = self.visit_expr(binding.value)
        node = self.nodes.get(binding.var)
        if node is not None and isinstance(value, relax.Call):
            value = tag_normalized(self.builder_, value, _span(node))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))


def _node_of(expr) -> str | None:
    span = getattr(expr, "span", None)
    return None if span is None else str(span.source_name.name)


def _bindings(func: relax.Function) -> list:
    body = func.body
    return [b for block in getattr(body, "blocks", ()) for b in block.bindings]


def binding_nodes(func: relax.Function, known: dict[relax.Var, str] | None = None) -> dict[relax.Var, str]:
    """The ONNX node each binding of ``func`` belongs to: its call's span, else what ``known`` (the same
    function before a pass rebuilt the call without its span) says, else the node of the first later binding
    that reads it and has one of those two itself."""
    from tvm.relax.analysis import free_vars

    known = known or {}
    out: dict[relax.Var, str] = {}
    consumer: dict[relax.Var, str] = {}
    for binding in reversed(_bindings(func)):
        own = _node_of(binding.value) or known.get(binding.var)
        node = own or consumer.get(binding.var)
        if node is None:
            continue
        out[binding.var] = node
        if own is None:
            continue  # credited by its reader only: it passes nothing on (a run of untraced bindings is not
            # all pinned on the one traced binding after it)
        for var in free_vars(binding.value):
            consumer[var] = node  # walking backwards, the last to set it is its earliest reader
    return out


def _callee(value) -> str | None:
    """The PrimFunc a call_tir binding calls."""
    if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get(_CALL_TIR)):
        return value.args[0].name_hint
    return None


def _var_args(value, env: dict | None = None) -> tuple:
    """A call_tir's variable arguments, each through ``env`` (a fused function's parameters -> the call's
    arguments); constants left out, as FuseOps may pass them in or copy them into the fused function."""
    args = (a if env is None else env.get(a, a) for a in value.args[1].fields)
    return tuple(a for a in args if isinstance(a, relax.Var))


class _Replay:
    """Matches each binding of a fused function, called with known arguments, to the binding of ``main``
    before FuseOps that it came from: the same PrimFunc on the same variables, the earliest not yet taken."""

    def __init__(self, legal: relax.Function):
        self.unused: dict[tuple, list[relax.Var]] = {}
        for b in _bindings(legal):
            callee = _callee(b.value)
            if callee is not None:
                self.unused.setdefault((callee, _var_args(b.value)), []).append(b.var)

    def take(self, callee: str, args: tuple) -> relax.Var | None:
        found = self.unused.get((callee, args))
        return found.pop(0) if found else None

    def group(self, func: relax.Function, args: list) -> list[relax.Var]:
        """The variables (before fusion) of the bindings ``func`` fuses, called with ``args``."""
        env = {p: a for p, a in zip(func.params, args)}
        taken = []
        for b in _bindings(func):
            callee = _callee(b.value)
            if callee is None:
                continue
            var = self.take(callee, _var_args(b.value, env))
            if var is None:
                return taken
            env[b.var] = var
            taken.append(var)
        return taken


def fused_nodes(mod: tvm.IRModule, nodes: dict[relax.Var, str],
                legal: relax.Function) -> dict[relax.Var, tuple[str, ...]]:
    """After FuseOps: each binding of ``main`` (a call of a fused function or a lone call_tir) -> the ONNX
    nodes it computes; ``nodes``: :func:`binding_nodes` of ``main`` just before LegalizeOps, ``legal``: ``main``
    just before FuseOps.

    A fused call gets a new variable, and FuseOps makes one function for equal groups (the Q, K and V
    projections), so neither names the group.  It is found by replaying the fused function on the call's
    arguments against ``legal``'s bindings (:class:`_Replay`); the call's result then stands for its group's
    last variable, so later calls reading it replay too."""
    replay = _Replay(legal)
    same: dict[relax.Var, relax.Var] = {}  # a fused call's variable -> its group's last variable before fusion
    out: dict[relax.Var, tuple[str, ...]] = {}
    for binding in _bindings(mod["main"]):
        call = binding.value
        if not isinstance(call, relax.Call):
            continue
        if isinstance(call.op, relax.GlobalVar) and isinstance(mod[call.op], relax.Function):
            group = replay.group(mod[call.op], [same.get(a, a) for a in call.args])
        elif _callee(call) is not None:
            match = replay.take(_callee(call), _var_args(call))
            group = [binding.var if match is None else match]
        else:
            continue  # not a kernel call (a shape computation)
        if group:
            same[binding.var] = group[-1]
        out[binding.var] = tuple(dict.fromkeys(nodes[v] for v in group if v in nodes))
    return out


def call_sites(mod: tvm.IRModule, nodes: dict[relax.Var, tuple[str, ...]]) -> list[CallSite]:
    """Every call_tir of the fused module's ``main`` in order, with the nodes :func:`fused_nodes` traced.

    FuseTIR turns each fused call into one call_tir in place, so the calls line up with ``nodes`` (in
    insertion order) one for one; should a pass have removed one, each is looked up by its variable instead
    (CanonicalizeBindings may have replaced the variable of main's last call)."""
    call_tir = tvm.ir.Op.get(_CALL_TIR)
    calls = [b for b in _bindings(mod["main"])
             if isinstance(b.value, relax.Call) and b.value.op.same_as(call_tir)]
    traced = list(nodes.values()) if len(nodes) == len(calls) else [nodes.get(b.var, ()) for b in calls]
    return [CallSite(b.value.args[0].name_hint, n) for b, n in zip(calls, traced)]
