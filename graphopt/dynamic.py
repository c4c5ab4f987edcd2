"""Symbolic input sizes through the graph stage: the shipped ONNX model runs at every size the input model runs at.

The graph stage works on fixed shapes (kernels and their prices are per shape), and to import a model into
TVM the pipeline folds its shape arithmetic into constants (:func:`graphopt.cleanup.fold_shapes`: ``Shape`` ->
``Gather`` -> ``Concat`` -> ``Reshape`` targets, attention masks built with ``Range`` and ``Expand``).  Those
constants hold the batch and sequence length the stage was given: the stage's graph with its inputs merely
made symbolic again fails or computes garbage at any other size (a TorchScript CNN's ``view(x.size(0), -1)``
becomes ``Reshape(x, [1, -1])``).  :func:`dynamic_model` gives the model the input's symbolic sizes back:

1. every constant of the optimized graph that the input graph computes from a runtime input is computed again
   by the input graph's own nodes (:func:`restore_input_computations`).  The substitutions keep the name of
   every tensor whose value they do not change and give new tensors fresh names, so a name both graphs hold
   is the same value, and the restored nodes read what the optimized graph still computes.  The sizes of
   the Splits the substitutions made follow the axis they split (:func:`scale_splits`: merges split a batch
   concatenation back in sizes the batch fixed);
2. inputs and outputs get the input model's types, symbolic dimension names included; intermediate types are
   dropped (they hold the fixed sizes; onnxruntime infers them);
3. the result is *checked*, not assumed: against onnxruntime on the input model at the sizes the stage used
   and at a second size with every symbolic dimension changed (:func:`probe_shapes`).

When the check fails (a substitution turned a size into a constant of a new name, which nothing can trace
back) or cannot be made (the input model itself fails at the second size), the input model is shipped as it
came instead, and the report says why: a file that runs wherever the user's model runs beats a faster one
that is wrong at the next batch size.  The compiled library stays built for the fixed sizes either way.

ONNX's symbolic dimensions: https://onnx.ai/onnx/repo-docs/IR.html#static-tensor-shapes
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from graphopt.compare import Comparison, compare_runs
from graphopt.errors import UserError
from graphopt.feeds import feed_sets, ort_session
from graphopt.ir import Graph, Node, subgraph_inputs
from graphopt.onnx_io import InputShapes, export_onnx, import_onnx

Dim = int | str | None  # a fixed size, a symbolic dimension's name, or None: unknown and unnamed

# What optimized.onnx is (DynamicShapes.form).
OPTIMIZED, INPUT_MODEL, STATIC = "optimized graph, symbolic sizes kept", "input model", "optimized graph, static"


@dataclass
class DynamicShapes:
    """report.json's ``dynamic_shapes``: which input dimensions are symbolic, what optimized.onnx is, and the
    check that says it runs at other sizes."""

    symbolic: dict[str, list[Dim]]  # runtime inputs with an open dimension, as the input model writes them
    built_for: dict[str, list[int]]  # the sizes the graph stage used (and the compiled library is built for)
    form: str  # OPTIMIZED, INPUT_MODEL (the fallback, ``reason`` says why) or STATIC (nothing was symbolic)
    restored_nodes: int = 0  # input-graph nodes put back to compute folded sizes
    scaled_splits: int = 0  # Splits whose fixed sizes now follow the axis (scale_splits)
    checked_at: dict[str, list[int]] = field(default_factory=dict)  # the second sizes (probe_shapes)
    check: dict[str, Any] = field(default_factory=dict)  # Comparison.to_dict() over both sizes
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"symbolic": self.symbolic, "built_for": self.built_for, "optimized_onnx": self.form,
                "restored_nodes": self.restored_nodes, "scaled_splits": self.scaled_splits,
                "checked_at": self.checked_at, "check": self.check,
                "reason": self.reason}


def _dims(vi: onnx.ValueInfoProto) -> list[Dim] | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None)
            for d in tt.shape.dim]


def symbolic_inputs(model: onnx.ModelProto) -> dict[str, list[Dim]]:
    """Runtime inputs of ``model`` with at least one dimension not fixed (named or unknown), in input order."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, list[Dim]] = {}
    for vi in model.graph.input:
        dims = _dims(vi)
        if vi.name not in inits and dims is not None and any(not isinstance(d, int) for d in dims):
            out[vi.name] = dims
    return out


def probe_shapes(symbolic: dict[str, list[Dim]], built: InputShapes) -> InputShapes:
    """The second sizes: each open dimension ``n`` becomes ``3`` if ``n < 3`` (a batch of 1 broadcasts, so it
    hides a constant batch; 3 does not), else ``n - 1`` (staying below a maximum sequence length, and odd
    where the built size is even).  A function of the size alone, so equal sizes stay equal, as a batch
    shared by several inputs must."""
    def other(n: int) -> int:
        return 3 if n < 3 else n - 1

    return {name: tuple(other(b) if not isinstance(d, int) else b for d, b in zip(dims, built[name]))
            for name, dims in symbolic.items() if name in built}


def input_dependent(graph: Graph) -> set[str]:
    """Tensors of ``graph`` whose value depends on a runtime input (directly, or through its shape)."""
    dependent = {t.name for t in graph.inputs if t.name not in graph.initializers}
    for n in graph.nodes:
        if any(t in dependent for t in (*n.inputs, *subgraph_inputs(n))):
            dependent.update(o for o in n.outputs if o)
    return dependent


def restore_input_computations(optimized: Graph, source: Graph) -> tuple[Graph, int]:
    """A copy of ``optimized`` where every weight that ``source`` (the graph before shape folding) computes
    from a runtime input is computed again by ``source``'s nodes; with the number of nodes put back.

    Walks back from each such weight through ``source``'s producers until it reaches tensors the optimized
    graph has (runtime inputs, node outputs, input-independent weights).  Raises ValueError when a tensor
    can be found in neither graph."""
    out = optimized.copy()
    dependent = input_dependent(source)
    made_by = source.producers()
    runtime = {t.name for t in out.inputs if t.name not in out.initializers}
    produced = {o for n in out.nodes for o in n.outputs if o}
    node_names = {n.name for n in out.nodes}
    wanted = sorted(t for t in out.initializers if t in dependent and t in made_by and t not in runtime)
    restored: list[Node] = []
    seen: set[int] = set()
    while wanted:
        t = wanted.pop()
        if t in produced:
            continue
        n = made_by[t][0]
        if id(n) in seen:
            continue
        seen.add(id(n))
        name = n.name if n.name not in node_names else out.fresh_name(n.name)
        outputs = [o if o not in produced else out.fresh_name(f"{o}_unused") for o in n.outputs]
        restored.append(Node(n.op_type, list(n.inputs), outputs, dict(n.attrs), name, n.domain, dict(n.attr_types)))
        node_names.add(name)
        for o in outputs:
            if o:
                produced.add(o)
                out.initializers.pop(o, None)
        for u in (*n.inputs, *subgraph_inputs(n)):
            if not u or u in produced or u in runtime:
                continue
            if u in out.initializers and u not in dependent:
                continue  # a weight, the same at every size
            if u in made_by:
                wanted.append(u)
            elif u in source.initializers:
                out.initializers[u] = source.initializers[u]
            else:
                raise ValueError(f"tensor {u!r} is in neither graph")
    out.nodes = out.nodes + restored
    out.topo_sort()
    out.value_info = {}  # the fixed sizes; onnxruntime infers the symbolic ones
    return out, len(restored)


def scale_splits(graph: Graph, source: Graph) -> int:
    """Make the fixed sizes of every ``Split`` the substitutions created (in place) follow the size of the
    axis they split; returns the number of splits changed.  The merge substitutions concatenate tensors
    along the batch axis and split the result back in sizes the batch fixed (``[1, 1, 1]``, or ``[1, 2]``
    when merges nest): an equal split loses its sizes (an equal split of any size); other sizes become
    ``size(axis) * s_i / sum(s)``, which is ``s_i`` at the built size.  Splits ``source`` has are the input
    model's own and left as they are."""
    opset = graph.onnx_opset
    own = {tuple(n.outputs) for n in source.nodes if n.op_type == "Split"}
    changed = 0
    nodes: list[Node] = []
    for n in graph.nodes:
        if n.op_type != "Split" or n.domain not in ("", "ai.onnx") or len(n.outputs) < 2 or tuple(n.outputs) in own:
            nodes.append(n)
            continue
        if len(n.inputs) > 1 and n.inputs[1] and graph.is_constant(n.inputs[1]):
            sizes = [int(v) for v in np.asarray(graph.initializers[n.inputs[1]]).reshape(-1)]
        elif n.attr("split") is not None:
            sizes = [int(v) for v in n.attr("split")]
        else:
            sizes = []
        if len(sizes) != len(n.outputs) or min(sizes, default=0) < 1 or (len(set(sizes)) > 1 and opset < 13):
            nodes.append(n)
            continue
        if len(set(sizes)) == 1:
            n.inputs = n.inputs[:1]
            n.attrs.pop("split", None)
            if opset >= 18:  # Split-18 needs the number of parts when no sizes are given
                n.attrs["num_outputs"] = len(n.outputs)
                n.attr_types = {**n.attr_types, "num_outputs": onnx.AttributeProto.INT}  # not the input's dict
        else:
            nodes.extend(_sizes_of_axis(graph, n, sizes))
        nodes.append(n)
        changed += 1
    graph.nodes = nodes
    if changed:
        graph.remove_unused()
    return changed


def _sizes_of_axis(graph: Graph, split: Node, sizes: list[int]) -> list[Node]:
    """Nodes computing ``size(axis) * sizes / sum(sizes)`` for ``split``, which then reads it."""
    def const(base: str, value: list[int]) -> str:
        name = graph.fresh_name(f"{split.name}/{base}")
        graph.initializers[name] = np.array(value, dtype=np.int64)
        return name

    shape, dim, scaled, sized = (graph.fresh_name(f"{split.name}/{t}") for t in ("shape", "dim", "scaled", "sizes"))
    axis = int(split.attr("axis", 0))
    made = [Node("Shape", [split.inputs[0]], [shape], name=shape),
            Node("Gather", [shape, const("axis", [axis])], [dim], {"axis": 0}, name=dim),
            Node("Mul", [dim, const("parts", sizes)], [scaled], name=scaled),
            Node("Div", [scaled, const("total", [sum(sizes)])], [sized], name=sized)]
    split.inputs = [split.inputs[0], sized]
    split.attrs.pop("split", None)
    return made


def with_interface(model: onnx.ModelProto, reference: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs and outputs have ``reference``'s types (same names), and no
    intermediate types."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    types = {vi.name: vi.type for vi in (*reference.graph.input, *reference.graph.output)}
    for vi in (*out.graph.input, *out.graph.output):
        if vi.name in types:
            vi.type.CopyFrom(types[vi.name])
    del out.graph.value_info[:]
    return out


def dynamic_model(original: onnx.ModelProto, optimized: Graph, source: Graph, seed: int = 0,
                  samples: dict[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, DynamicShapes]:
    """The ONNX model to ship for ``optimized`` (the graph stage's static result) and what it is (module
    docstring).  ``source`` is the stage's input before shape folding, at the same fixed sizes;
    ``original`` the user's model, the reference of every check; ``samples`` the user's ``--inputs``."""
    symbolic = symbolic_inputs(original)
    built = {t.name: [int(d) for d in t.shape] for t in source.inputs  # type: ignore[union-attr]
             if t.name in symbolic and t.is_static}
    if not symbolic:
        return export_onnx(optimized), DynamicShapes({}, {}, STATIC)
    info = DynamicShapes(symbolic, built, OPTIMIZED)
    probe = probe_shapes(symbolic, {k: tuple(v) for k, v in built.items()})
    info.checked_at = {k: list(v) for k, v in probe.items()}
    try:
        restored, info.restored_nodes = restore_input_computations(optimized, source)
        info.scaled_splits = scale_splits(restored, source)
        candidate = with_interface(export_onnx(restored, check=False), original)
    except (ValueError, RuntimeError) as exc:
        return _fallback(original, info, f"the optimized graph's sizes could not be made symbolic ({exc})")
    try:
        at_probe = import_onnx(original, probe, require_static=True)
    except UserError as exc:
        return _fallback(original, info, f"the input model cannot be shaped to {_sizes(probe)} ({exc})")
    fixed = {k: v for k, v in (samples or {}).items() if k not in probe}  # e.g. a sample rate
    runs = [("the built sizes", s) for s in feed_sets(source, seed, samples)]
    runs += [(_sizes(probe), s | {k: v for k, v in fixed.items() if k in s}) for s in feed_sets(at_probe, seed)]
    reference, error = _run(original, runs)
    if error:
        return _fallback(original, info, f"the input model does not run in onnxruntime at {error}, so the symbolic "
                                         "sizes cannot be checked")
    got, error = _run(candidate, runs)
    if error:
        return _fallback(original, info, f"the optimized graph fails in onnxruntime at {error}")
    check: Comparison = compare_runs(list(zip(reference, got)))
    info.check = check.to_dict()
    if not check.ok:
        return _fallback(original, info, f"the optimized graph differs from the input model at {_sizes(probe)}: "
                                         f"{check.reason()}")
    return candidate, info


def _run(model: onnx.ModelProto, runs: list[tuple[str, dict[str, np.ndarray]]]) -> tuple[list, str]:
    """onnxruntime's outputs for each (label, feeds), or ([], "LABEL (its error's first line)")."""
    try:
        session = ort_session(model)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's loading errors have several types
        return [], f"every size ({_first_line(exc)})"
    names = {i.name for i in session.get_inputs()}
    out = []
    for label, feeds in runs:
        try:
            out.append(session.run(None, {k: v for k, v in feeds.items() if k in names}))
        except Exception as exc:  # noqa: BLE001 - Fail / InvalidArgument / RuntimeException
            return [], f"{label} ({_first_line(exc)})"
    return out, ""


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]


def _fallback(original: onnx.ModelProto, info: DynamicShapes, reason: str) -> tuple[onnx.ModelProto, DynamicShapes]:
    info.form, info.reason = INPUT_MODEL, reason + "; optimized.onnx is the input model"
    return original, info


def _sizes(shapes: InputShapes) -> str:
    return ", ".join(f"{k}={','.join(map(str, v))}" for k, v in shapes.items())
