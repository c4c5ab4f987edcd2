"""A build specialized on the value of a control input, when the compiled code cannot leave that value open.

Some models take a value that decides their structure, not just their numbers.  Silero VAD's int64 sample
rate ``sr`` selects its 16 kHz or 8 kHz graph with an ``If`` and sets the pads of the audio, so tensor shapes
depend on it: TVM's ONNX importer refuses a ``Pad`` whose pads are not constant ("Dynamic pads are not
supported yet"), an LSTM inside an ``If`` branch cannot be unrolled (graphopt's lowerings rewrite top-level
nodes), and the LSTM behind such a pad has no static input shape.  The compiled library has static shapes, so
it can serve one value of such an input only:

1. :func:`needed_values` finds the runtime inputs holding a single integer or boolean (a sample rate, a
   flag) whose *value* reaches, through any computation, an operand that sets a tensor's shape
   (:data:`SHAPE_OPERANDS`, from the ONNX operator specs, https://onnx.ai/onnx/operators/) - at the top level
   or inside a control-flow body - or the condition of an ``If`` that cannot be compiled with both branches
   (a branch holds an operator the caller names, or the ``If``'s outputs have no static shape);
2. :func:`specialize` replaces every read of such an input by a weight holding the value the user gave
   (``--inputs``), folds what is computed from it (:func:`graphopt.cleanup.fold_shapes`: the pads become
   constants, shapes are inferred again) and replaces every ``If`` whose condition became constant by the
   nodes of the branch it takes (:func:`fold_constant_ifs`), until nothing changes.  The input stays in the
   model's interface, so a caller passes it as before.  A value giving a Pad pads onnxruntime refuses (a
   negative pad crops, past the axis's size) is refused in one line naming it (:func:`_check_pads`);
3. the value is recorded in the built folder's signature, and the loader refuses any other (a build
   specialized silently would compute the 16 kHz answer for 8 kHz audio).  ``optimized.onnx``, the graph
   the library is compiled from, is the specialized one where it is shipped (it takes the input and
   ignores it); report.json's ``specialized`` says so.

An input the build needs but ``--inputs`` does not give is refused before any work, in one line naming it.
An ``If`` whose branches compile as they are is kept: that build serves every value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, shape_inference

from graphopt.cleanup import fold_shapes
from graphopt.errors import UserError
from graphopt.ir import Graph
from graphopt.onnx_io import (DEFAULT_DOMAINS, InputShapes, all_names, apply_input_shapes, export_onnx, import_onnx,
                               local_names, rename_reads, subgraphs, without_weight_data)
from graphopt.validate import ModelInput

# Operands whose values set the shape (or rank) of an operator's output, by input index (ONNX operator specs).
SHAPE_OPERANDS: dict[str, dict[int, str]] = {
    "Pad": {1: "pads", 3: "axes"}, "Reshape": {1: "shape"}, "Expand": {1: "shape"}, "Tile": {1: "repeats"},
    "ConstantOfShape": {0: "shape"}, "Range": {0: "start", 1: "limit", 2: "delta"},
    "Slice": {1: "starts", 2: "ends", 3: "axes", 4: "steps"}, "Resize": {2: "scales", 3: "sizes"},
    "Upsample": {1: "scales"}, "TopK": {1: "K"}, "Split": {1: "split"}, "Squeeze": {1: "axes"},
    "Unsqueeze": {1: "axes"}, "OneHot": {1: "depth"}, "CenterCropPad": {1: "shape", 2: "axes"},
    **{op: {1: "axes"} for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                                  "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")},
}
# Operators whose outputs depend on their input's shape only, never on its values.
SHAPE_ONLY = frozenset({"Shape", "Size"})


@dataclass
class Specialization:
    """report.json's ``specialized``: the values a build is specialized on, why each was needed, and how many
    ``If`` nodes were replaced by their taken branch."""

    values: dict[str, np.ndarray]
    reasons: dict[str, str]  # input -> the use that needs its value
    folded_ifs: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"values": {k: np.asarray(v).tolist() for k, v in self.values.items()}, "why": self.reasons,
                "folded_ifs": self.folded_ifs}


@dataclass
class _Use:
    """One read of an input's value that decides structure: ``what`` of node ``node``."""

    what: str
    node: onnx.NodeProto

    @property
    def condition(self) -> bool:
        return self.what == "condition"

    def describe(self) -> str:
        op, name = self.node.op_type, self.node.name
        label = f"{op} node {name!r}" if name else f"an unnamed {op} node"
        return f"the branch of {label}" if self.condition else f"the {self.what} of {label}"


# ---- 1. which inputs the build needs the value of ----------------------------------------------------------

def _value_uses(g: onnx.GraphProto, tainted: set[str]) -> list[_Use]:
    """Every use deciding structure of a tensor in ``tainted`` or computed from one, in ``g`` and its bodies;
    ``tainted`` grows with what ``g`` computes from it.  Names resolve per scope: a body's own tensor named like
    a tainted one (a sibling body's, or one the outer graph defines after the node: onnx.checker accepts both)
    is another tensor, untainted unless the body computes it from a tainted one."""
    uses: list[_Use] = []
    for n in g.node:
        default = n.domain in DEFAULT_DOMAINS
        if default and n.op_type == "If" and n.input and n.input[0] in tainted:
            uses.append(_Use("condition", n))
        for k, operand in (SHAPE_OPERANDS.get(n.op_type, {}) if default else {}).items():
            if k < len(n.input) and n.input[k] in tainted:
                uses.append(_Use(operand, n))
        reads = any(t in tainted for t in n.input)
        for body in subgraphs(n):
            inner = tainted - local_names(body)
            uses += _value_uses(body, inner)
            reads = reads or any(o.name in inner for o in body.output)
        if reads and not (default and n.op_type in SHAPE_ONLY):
            tainted.update(o for o in n.output if o)
    return uses


def _control_candidates(model: onnx.ModelProto, shapes: InputShapes) -> list[str]:
    """Runtime inputs holding one integer or boolean value (``shapes`` applied): what a build can specialize
    on.  A float input (audio) or a larger one (token ids) reaching a shape is a dynamic model, not a setting."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for i in model.graph.input:
        tt = i.type.tensor_type
        dims = shapes.get(i.name) or [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if i.name in inits or not tt.HasField("shape") or None in dims:
            continue
        kind = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).kind
        if kind in "iub" and int(np.prod(dims, dtype=np.int64)) == 1:
            out.append(i.name)
    return out


def _static_types(model: onnx.ModelProto, shapes: InputShapes) -> set[str]:
    """Names of the tensors (top level and in every body) whose shape ONNX shape inference finds static
    once ``shapes`` are applied."""
    shaped = without_weight_data(model)  # a copy, without the weights' data inference does not read
    apply_input_shapes(shaped, shapes)
    inferred = shape_inference.infer_shapes(shaped, data_prop=True)
    names: set[str] = set()

    def walk(g: onnx.GraphProto) -> None:
        for vi in (*g.value_info, *g.output, *g.input):
            tt = vi.type.tensor_type
            if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
                names.add(vi.name)
        for n in g.node:
            for body in subgraphs(n):
                walk(body)

    walk(inferred.graph)
    return names


def _op_types(g: onnx.GraphProto) -> set[str]:
    """Op types of every node of ``g`` and of its bodies."""
    return {n.op_type for n in g.node} | {op for n in g.node for b in subgraphs(n) for op in _op_types(b)}


def needed_values(model: onnx.ModelProto, shapes: InputShapes | None, blockers: frozenset[str]) -> dict[str, str]:
    """{input: why} for every control input (one integer or boolean) whose value the build needs (module
    docstring, step 1).  ``blockers`` are op types that cannot stay inside an ``If`` branch (what the backend
    lacks and graphopt rewrites at the top level only): an ``If`` holding one must be folded."""
    shapes = shapes or {}
    static: set[str] | None = None  # inferred when an If first needs it (a copy of the model: large ones cost)
    needed: dict[str, str] = {}
    for name in _control_candidates(model, shapes):
        for use in _value_uses(model.graph, {name}):
            if use.condition:
                if static is None:
                    static = _static_types(model, shapes)
                branch_ops = {op for body in subgraphs(use.node) for op in _op_types(body)}
                keeps = not (branch_ops & blockers) and all(o in static for o in use.node.output if o)
                if keeps:
                    continue  # both branches compile: the build serves every value
            needed[name] = use.describe()
            break
    return needed


# ---- 2. the specialized graph ------------------------------------------------------------------------------

def _substitute(graph: Graph, values: dict[str, np.ndarray]) -> None:
    """Every read of each input of ``values`` (bodies included) reads a weight holding its value instead."""
    rename: dict[str, str] = {}
    for name, value in values.items():
        info = next(t for t in graph.inputs if t.name == name)  # static: checked with the --inputs shapes
        const = graph.fresh_name(f"{name}_specialized")
        graph.initializers[const] = np.asarray(value, dtype=info.dtype).reshape(info.shape)
        rename[name] = const
    for n in graph.nodes:
        n.inputs = [rename.get(t, t) for t in n.inputs]
        for key, v in n.attrs.items():
            if isinstance(v, onnx.GraphProto):
                body = onnx.GraphProto()
                body.CopyFrom(v)  # bodies are shared with the caller's graph (Graph.copy)
                rename_reads(body, rename)
                n.attrs[key] = body


def _defined(g: onnx.GraphProto) -> set[str]:
    """Tensor names a body defines (its inputs, weights, node outputs), its own bodies included."""
    out = {i.name for i in g.input} | {t.name for t in g.initializer}
    for n in g.node:
        out.update(o for o in n.output if o)
        for body in subgraphs(n):
            out |= _defined(body)
    return out


def _rename_all(g: onnx.GraphProto, rename: dict[str, str]) -> None:
    """Rename tensors everywhere in ``g`` and its bodies (definitions, reads, types), in place."""
    for vi in (*g.input, *g.output, *g.value_info):
        vi.name = rename.get(vi.name, vi.name)
    for t in g.initializer:
        t.name = rename.get(t.name, t.name)
    for n in g.node:
        n.input[:] = [rename.get(t, t) for t in n.input]
        n.output[:] = [rename.get(t, t) for t in n.output]
        for body in subgraphs(n):
            _rename_all(body, rename)


def _inline(outer: onnx.GraphProto, index: int, taken: bool, introduced: set[str]) -> list[onnx.NodeProto]:
    """The nodes replacing ``If`` node ``outer.node[index]``: its taken branch's nodes, its weights as
    Constants, an Identity per output.  Branch names that the rest of the model (or ``introduced``: what the
    Ifs inlined before it brought, updated here) also uses get fresh ones: two sibling bodies may use the same
    name, and once one is inlined the other would shadow it."""
    node = outer.node[index]
    branch = onnx.GraphProto()
    branch.CopyFrom(next(a.g for a in node.attribute if a.name == ("then_branch" if taken else "else_branch")))
    elsewhere = {i.name for i in (*outer.input, *outer.output, *outer.value_info)} | {t.name for t in outer.initializer}
    elsewhere |= introduced
    for k, n in enumerate(outer.node):
        elsewhere.update(n.input)
        elsewhere.update(n.output)
        if k != index:
            for body in subgraphs(n):
                elsewhere |= all_names(body)
    defined = _defined(branch)
    avoid = elsewhere | defined
    rename: dict[str, str] = {}
    for name in sorted(defined & elsewhere):
        k = 1
        while f"{name}_{k}" in avoid:
            k += 1
        rename[name] = f"{name}_{k}"
        avoid.add(rename[name])
    _rename_all(branch, rename)
    introduced |= _defined(branch)
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in branch.initializer]
    nodes += list(branch.node)
    nodes += [helper.make_node("Identity", [b.name], [o], name=f"{node.name}/{o}")
              for b, o in zip(branch.output, node.output) if o]
    return nodes


def fold_constant_ifs(graph: Graph) -> int:
    """Replace every ``If`` whose condition is a weight by the nodes of the branch it takes (in place, shapes
    inferred again); returns the number replaced.  The condition is a one-element boolean tensor (ONNX If)."""
    taken = {n.name: bool(np.asarray(graph.initializers[n.inputs[0]]).reshape(-1)[0]) for n in graph.nodes
             if n.op_type == "If" and n.domain in DEFAULT_DOMAINS and n.inputs and graph.is_constant(n.inputs[0])}
    if not taken:
        return 0
    graph.value_info = {k: v for k, v in graph.value_info.items() if v.is_static}  # stale symbolic types go
    model = export_onnx(graph, check=False)
    g = model.graph
    nodes: list[onnx.NodeProto] = []
    introduced: set[str] = set()
    for k, n in enumerate(g.node):
        nodes += _inline(g, k, taken[n.name], introduced) if n.op_type == "If" and n.name in taken else [n]
    del g.node[:]
    g.node.extend(nodes)
    again = import_onnx(model, require_static=False)
    graph.nodes, graph.initializers, graph.value_info = again.nodes, again.initializers, again.value_info
    graph.inputs, graph.outputs = again.inputs, again.outputs
    return len(taken)


def specialize(graph: Graph, values: dict[str, np.ndarray], max_rounds: int = 16) -> int:
    """Specialize ``graph`` (in place) on the input values ``values`` (module docstring, step 2); returns the
    number of ``If`` nodes replaced by their taken branch (a branch may hold further ones: rounds)."""
    _substitute(graph, values)
    folded = 0
    for _ in range(max_rounds):
        fold_shapes(graph)
        count = fold_constant_ifs(graph)
        if not count:
            break
        folded += count
    return folded


def _pad_problem(size: int, begin: int, end: int, mode: str) -> str | None:
    """What is wrong with padding an axis of ``size`` elements by ``begin`` and ``end`` (a negative pad crops,
    https://onnx.ai/onnx/operators/onnx__Pad.html) in ``mode``, by onnxruntime's rules; None if nothing."""
    kept = size + min(begin, 0) + min(end, 0)
    if kept < 0:
        return f"crop {size - kept} of its {size} elements"
    if mode in ("reflect", "edge") and kept == 0:
        return f"leave no element for {mode} padding to repeat"
    if mode == "reflect" and max(begin, end) >= kept:
        return f"reflect {max(begin, end)} elements of the {kept} it keeps (reflect padding takes fewer)"
    return None


def _check_pads(graph: Graph, values: dict[str, np.ndarray]) -> None:
    """UserError naming the values a build is specialized on when they give a Pad pads onnxruntime refuses (a
    crop past the axis's size; reflect or edge padding of nothing), before any work: the build's check against
    onnxruntime could only fail, minutes later and naming neither the input nor its value."""
    given = ", ".join(f"input {k!r} = {np.asarray(v).tolist()}" for k, v in values.items())
    for n in graph.nodes:
        if n.op_type != "Pad" or n.domain not in DEFAULT_DOMAINS or len(n.inputs) < 2 \
                or not graph.is_constant(n.inputs[1]):
            continue
        shape = graph.shape(n.inputs[0])
        if shape is None or not all(isinstance(d, int) for d in shape):
            continue
        pads = [int(p) for p in np.asarray(graph.initializers[n.inputs[1]]).reshape(-1)]
        axes_in = n.inputs[3] if len(n.inputs) > 3 and n.inputs[3] else None
        if axes_in is not None and not graph.is_constant(axes_in):
            continue
        axes = (range(len(shape)) if axes_in is None
                else [int(a) % len(shape) for a in np.asarray(graph.initializers[axes_in]).reshape(-1)])
        if len(pads) != 2 * len(axes):
            continue  # not a Pad onnxruntime runs: its session or its check says so
        for i, axis in enumerate(axes):
            problem = _pad_problem(shape[axis], pads[i], pads[i + len(axes)], n.attr("mode", "constant"))
            if problem:
                raise UserError(f"{given} gives Pad node {n.name!r} the pads {pads}, which on axis {axis} {problem}; "
                                "onnxruntime refuses these pads too: give --inputs a value the model accepts")


def specialize_model(model: ModelInput, blockers: frozenset[str]) -> tuple[onnx.ModelProto, Specialization | None]:
    """The model a build compiles: ``model.proto`` itself, or specialized on the ``--inputs`` values of the
    control inputs it needs (and the record of it); a UserError naming an input it needs that ``--inputs``
    does not give, before any work."""
    needed = needed_values(model.proto, model.input_shapes, blockers)
    if not needed:
        return model.proto, None
    samples = model.samples or {}
    missing = next((k for k in needed if k not in samples), None)
    if missing is not None:
        raise UserError(f"input {missing!r} decides {needed[missing]}, so model.so can only be built for one value of "
                        f"it: give that value in --inputs FILE.npz (numpy.savez(FILE, {missing}=...)); the build is "
                        "specialized on it, and runs refuse any other value")
    values = {k: np.asarray(samples[k]) for k in needed}
    graph = import_onnx(model.proto, model.input_shapes, require_static=True)
    folded = specialize(graph, values)
    _check_pads(graph, values)
    return export_onnx(graph), Specialization(values, needed, folded)
