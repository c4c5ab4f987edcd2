"""ONNX <-> graph IR.

Import keeps every node (unknown operators stay as they are, with their attributes and domain), folds
``Constant`` nodes into weights and removes ``Identity`` nodes where that changes no graph interface, and
runs ONNX shape inference so every tensor has a type.  Export writes the graph back with the original
input/output names, order and dtypes, opsets and local functions, and checks it with ``onnx.checker``.

Real exporters differ in what they emit (TorchScript: opset 17, Constant nodes, dynamic axes; dynamo:
opset 18, local functions, metadata; HF: Shape/Gather chains on dynamic axes), so import is defensive:
it never assumes names are unique or present, and reports unknown dimensions with the input to fix.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from graphopt.errors import UserError
from graphopt.fileio import staging_dir, write_bytes_atomic
from graphopt.ir import Graph, Node, TensorInfo

SUPPORTED_DTYPES = {
    "float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "bool",
}

InputShapes = dict[str, tuple[int, ...]]


# Largest dimension --input-shape takes: ONNX stores dims as int64; anything near that is refused here, and
# sizes the machine cannot hold are refused by the memory estimate (graphopt.limits.check_memory).
MAX_DIM = 2**62


# The IR version from which an initializer need not be a graph input (ONNX 1.4); before it, onnx.checker demands
# every initializer among the inputs (https://onnx.ai/onnx/repo-docs/IR.html#graphs).
IR_WEIGHTS_APART = 4
# The names of ONNX's default operator domain (the empty string and its long form).
DEFAULT_DOMAINS = ("", "ai.onnx")


def parse_input_shapes(specs: list[str] | None) -> InputShapes:
    """Parse ``--input-shape name=1,128`` options (repeatable): positive dimensions, one shape per name."""
    shapes: InputShapes = {}
    for spec in specs or []:
        name, sep, dims = spec.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            parsed = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise UserError(f"bad --input-shape {spec!r}: write NAME=D1,D2,... e.g. input_ids=1,128") from None
        bad = next((d for d in parsed if d < 1 or d > MAX_DIM), None)
        if bad is not None:
            raise UserError(f"--input-shape {spec!r}: dimension {bad} is {'not positive' if bad < 1 else 'too large'}; "
                            "give the sizes to compile for, e.g. input_ids=1,128")
        if name in shapes and shapes[name] != parsed:
            raise UserError(f"--input-shape gives {name!r} two shapes ({','.join(map(str, shapes[name]))} and "
                            f"{','.join(map(str, parsed))}): give it once")
        shapes[name] = parsed
    return shapes


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX file, turning every way it can be wrong into a one-line :class:`UserError`."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"model file {str(p)!r} does not exist: check the path")
    if p.is_dir():
        raise UserError(f"{str(p)!r} is a directory: pass the path of an .onnx file")
    if not p.is_file():  # a device (/dev/zero reads forever) or a pipe (blocks until written)
        raise UserError(f"{str(p)!r} is not a regular file: pass the path of an .onnx file")
    try:
        model = onnx.load(str(p))
    except Exception as exc:  # protobuf raises DecodeError, RuntimeError or ValueError depending on damage
        outside = _external_data_outside(p)
        if outside:
            raise UserError(f"{str(p)!r} names weights at {outside!r}, outside the model's folder; they are not read "
                            "(a model file must not reach elsewhere): put the weights file next to the model") from None
        missing = _missing_external_data(p)
        if missing:
            raise UserError(f"{str(p)!r} keeps its weights in {missing!r}, which is not next to it: copy that file "
                            "into the model's folder (torch.onnx.export writes it beside the .onnx)") from None
        raise UserError(f"{str(p)!r} is not a readable ONNX model ({type(exc).__name__}); "
                        "re-export it or check the file is complete") from None
    if not model.graph.node and not model.graph.output:
        raise UserError(f"{str(p)!r} is not an ONNX model (no graph found); re-export it with torch.onnx.export "
                        "or check the file is complete")
    weights = {t.name for t in model.graph.initializer}
    listed = weights <= {i.name for i in model.graph.input}
    if 0 < model.ir_version < IR_WEIGHTS_APART and not listed:  # 0: no IR version, which onnx.checker names
        weights_apart(model)
    return model


def ir_version_for(model: onnx.ModelProto) -> int:
    """``model``'s IR version raised, where needed, to what its opsets require and to :data:`IR_WEIGHTS_APART`."""
    return max(model.ir_version, IR_WEIGHTS_APART,
               helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))


def weights_apart(model: onnx.ModelProto) -> None:
    """An IR<4 model (older exporters) in today's form, in place: its initializers out of the graph inputs and its
    IR version raised (:func:`ir_version_for`).

    Why: such a model lists every initializer as an input, and import folds its Constant nodes into weights that
    are not, so exporting it at its own IR version fails onnx.checker.  Raising the IR version alone would make
    onnxruntime take the listed weights for inputs a caller may override (IR >= 4), skipping its constant
    folding and warning once per weight; out of the inputs they are weights to every reader, as they are to
    this project (no runtime input of the build).  Applied to files that do not list them all (which the
    checker refuses at IR<4); a file that lists them keeps its form (``graphopt optimize --weights-as-inputs``
    keeps them as inputs; elsewhere :meth:`graphopt.ir.Graph.freeze_weights` makes them weights) and is
    exported at IR >= 4, where a folded Constant's weight needs no input."""
    weights = {t.name for t in model.graph.initializer}
    kept = [i for i in model.graph.input if i.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.ir_version = ir_version_for(model)


def _external_locations(p: Path) -> list[str]:
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception:  # noqa: BLE001 - the graph itself is unreadable: not an external-data problem
        return []
    return [next((e.value for e in t.external_data if e.key == "location"), "") for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL]


def _external_data_outside(p: Path) -> str | None:
    """The first external-data location that resolves outside the model's folder (onnx refuses to read it)."""
    folder = p.parent.resolve()
    for location in _external_locations(p):
        if location and folder not in (folder / location).resolve().parents:
            return location
    return None


def _missing_external_data(p: Path) -> str | None:
    """The first external-data file (large exports keep weights beside the .onnx) that does not exist."""
    return next((loc for loc in _external_locations(p) if loc and not (p.parent / loc).exists()), None)


def _dtype_name(elem_type: int) -> str:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:  # noqa: BLE001 - e.g. STRING or an undefined type
        return onnx.TensorProto.DataType.Name(elem_type).lower()


def _tensor_info(vi: onnx.ValueInfoProto) -> TensorInfo:
    tt = vi.type.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim)
    return TensorInfo(vi.name, _dtype_name(tt.elem_type), shape)


def apply_input_shapes(model: onnx.ModelProto, shapes: InputShapes) -> None:
    """Set the dimensions of the named runtime inputs of ``model`` (in place).

    Only dimensions the model leaves open (symbolic or unknown) may be set: a model exported with a fixed
    size has shape-dependent constants (Reshape targets, slice ends) that a different size would break."""
    inits = {t.name for t in model.graph.initializer}
    names = {i.name for i in model.graph.input if i.name not in inits}
    for name in shapes:
        if name in inits:
            raise UserError(f"--input-shape names {name!r}, which is a weight (an initializer), not a runtime input")
        if name not in names:
            raise UserError(f"--input-shape names {name!r}, which is not a model input "
                            f"(inputs: {', '.join(sorted(names)) or 'none'})")
    for inp in model.graph.input:
        if inp.name in shapes:
            dims = shapes[inp.name]
            shp = inp.type.tensor_type.shape
            if len(shp.dim) and len(shp.dim) != len(dims):
                raise UserError(f"--input-shape {inp.name}: model input has rank {len(shp.dim)}, got {len(dims)} dims")
            for axis, (old, new) in enumerate(zip(shp.dim, dims)):
                if old.HasField("dim_value") and old.dim_value != new:
                    raise UserError(f"--input-shape {inp.name}: axis {axis} is fixed at {old.dim_value} in the model, "
                                    f"got {new}; only dynamic dimensions can be set (re-export with that axis dynamic)")
            del shp.dim[:]
            for d in dims:
                shp.dim.add().dim_value = d


def require_static_inputs(model: onnx.ModelProto, dims: dict[str, int] | None = None) -> None:
    """Every runtime input must have a fully known shape (the kernels and the tuning records are per shape),
    once ``dims`` (``--dim``: sizes of named dimensions) are applied.

    One error for all of them, with every flag that fixes them: a user fixing one input per try took three
    tries for a BERT's one ``sequence`` dimension (issue 41)."""
    open_inputs = unresolved_inputs(model, dims or {})
    if open_inputs:
        raise UserError(unresolved_message(open_inputs))


def runtime_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds (an initializer listed as an input is a weight)."""
    weights = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in weights]


def unresolved_inputs(model: onnx.ModelProto, dims: dict[str, int]) -> dict[str, list[int | str | None]]:
    """{input name: its dims} for each runtime input some dimension of which is still open after ``dims``: a
    known size is an int, a named (symbolic) dimension its name, an unnamed one None."""
    found = {}
    for inp in runtime_inputs(model):
        tt = inp.type.tensor_type
        if not tt.HasField("shape"):
            found[inp.name] = [None]  # unknown rank
            continue
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, d.dim_param or None)
                 for d in tt.shape.dim]
        if not all(isinstance(d, int) for d in shape):
            found[inp.name] = shape
    return found


def unresolved_message(open_inputs: dict[str, list[int | str | None]]) -> str:
    """The one line naming every open input with its dims and the flags that fix them all: ``--dim NAME=N``
    for a named dimension (it fixes that dimension in every input), ``--input-shape`` for an input with an
    unnamed one (nothing else can name it)."""
    names: list[str] = []
    unnamed: list[str] = []
    for name, shape in open_inputs.items():
        if None in shape:
            unnamed.append(f"--input-shape {name}=" + ",".join(
                str(d) if isinstance(d, int) else f"D{axis + 1}" for axis, d in enumerate(shape)))
        else:
            names += [d for d in shape if isinstance(d, str) and d not in names]
    listed = ", ".join(f"{name} [{', '.join('?' if d is None else str(d) for d in shape)}]"
                       for name, shape in open_inputs.items())
    kind = "unknown" if unnamed else "symbolic"
    subject = "inputs have" if len(open_inputs) > 1 else "input has"
    fixes = " ".join([f"--dim {n}=N" for n in names] + unnamed)
    return f"{subject} {kind} dimensions: {listed}: fix them with {fixes}"


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    """Value of a Constant node, whichever of its value_* attributes it uses."""
    attr = node.attribute[0]
    kind = attr.name
    if kind == "value":
        return numpy_helper.to_array(attr.t)
    if kind == "value_float":
        return np.array(attr.f, dtype=np.float32)
    if kind == "value_floats":
        return np.array(list(attr.floats), dtype=np.float32)
    if kind == "value_int":
        return np.array(attr.i, dtype=np.int64)
    if kind == "value_ints":
        return np.array(list(attr.ints), dtype=np.int64)
    if kind == "sparse_value":
        dense = numpy_helper.to_array(attr.sparse_tensor.values)
        out = np.zeros(list(attr.sparse_tensor.dims), dtype=dense.dtype)
        idx = numpy_helper.to_array(attr.sparse_tensor.indices)
        out.reshape(-1)[idx.reshape(-1) if idx.ndim == 1 else np.ravel_multi_index(idx.T, out.shape)] = dense
        return out
    raise UserError(f"Constant node {node.name!r} uses unsupported attribute {kind!r}; re-export with a tensor value")


# Float initializers with more elements than this are shape-inferred from their dims alone (below).
LIGHT_ELEMENTS = 4096
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)


def without_weight_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose large float initializers keep their name, type and dims but not their
    data: what shape inference reads of a weight, and all the memory check reads of one.  (Inference
    serializes the model it is given and parses its result: two copies of every weight, 6.5 s for VGG-19's
    550 MB, and the graph stage imports a model for every operator it prices.)  Integer initializers (shapes, axes, indices: values
    that data propagation reads) and small ones keep their data."""
    g = model.graph
    inits = []
    for t in g.initializer:
        if t.data_type in _FLOATS and int(np.prod(t.dims, dtype=np.int64)) > LIGHT_ELEMENTS:
            t = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=list(t.dims))
        inits.append(t)
    graph = onnx.helper.make_graph(list(g.node), g.name, list(g.input), list(g.output), inits,
                                   value_info=list(g.value_info), sparse_initializer=list(g.sparse_initializer))
    light = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                                   functions=list(model.functions))
    light.producer_name = model.producer_name
    return light


def _is_constant_value(n: onnx.NodeProto) -> bool:
    return n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS and len(n.attribute) == 1


def node_names(g: onnx.GraphProto) -> list[str | None]:
    """Each node's name in the graph IR (None: a Constant, which becomes an initializer): its own, or
    ``OpType_k`` (k its index) for an unnamed one, made unique.  One home, because the compiled model names
    the ONNX nodes its kernels compute the same way (:mod:`pipeline.passes.provenance`)."""
    out: list[str | None] = []
    used: set[str] = set()
    for k, n in enumerate(g.node):
        if _is_constant_value(n):
            out.append(None)
            continue
        name = n.name or f"{n.op_type}_{k}"
        while name in used:
            name = f"{name}_{k}"
        used.add(name)
        out.append(name)
    return out


def import_onnx(model_or_path: onnx.ModelProto | str | os.PathLike,
                input_shapes: InputShapes | None = None, require_static: bool = True) -> Graph:
    """Import an ONNX model into the graph IR.

    ``input_shapes`` fixes dynamic input dimensions; with ``require_static`` every graph input must end up
    with a fully known shape, else a :class:`UserError` names every open input and the ``--dim`` /
    ``--input-shape`` flags to pass (:func:`require_static_inputs`).
    """
    model = model_or_path if isinstance(model_or_path, onnx.ModelProto) else load_model(model_or_path)
    light = without_weight_data(model)  # a copy: the caller's proto is never changed
    if input_shapes:
        apply_input_shapes(light, input_shapes)
    if require_static:
        require_static_inputs(light)
    try:
        inferred = shape_inference.infer_shapes(light, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - malformed models make inference fail in many ways
        raise UserError(f"ONNX shape inference failed ({str(exc).splitlines()[0][:200]}); "
                        "check the model with onnx.checker or re-export it") from None
    g = inferred.graph
    _capture_outer_reads(g)

    initializers: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        arr = numpy_helper.to_array(t)
        _check_dtype(t.name, arr.dtype.name)
        initializers[t.name] = arr
    value_info: dict[str, TensorInfo] = {}
    for vi in list(g.value_info) + list(g.output) + list(g.input):
        if vi.type.HasField("tensor_type"):
            value_info[vi.name] = _tensor_info(vi)
    inputs = [_tensor_info(i) for i in g.input]
    for i in inputs:
        _check_dtype(i.name, i.dtype)
    outputs = [_tensor_info(o) for o in g.output]

    nodes: list[Node] = []
    for n, name in zip(g.node, node_names(g)):
        if name is None:
            initializers[n.output[0]] = _constant_value(n)
            continue
        attrs: dict[str, Any] = {}
        types: dict[str, int] = {}
        for a in n.attribute:
            v = helper.get_attribute_value(a)
            if a.type == onnx.AttributeProto.TENSOR:
                v = numpy_helper.to_array(v)
            elif isinstance(v, bytes):
                v = v.decode("utf-8", errors="surrogateescape")
            elif isinstance(v, list) and v and isinstance(v[0], bytes):
                v = [x.decode("utf-8", errors="surrogateescape") for x in v]
            attrs[a.name] = v
            types[a.name] = a.type
        nodes.append(Node(n.op_type, list(n.input), list(n.output), attrs, name, n.domain, types))

    graph = Graph(
        nodes=nodes, inputs=inputs, outputs=outputs, initializers=initializers, value_info=value_info,
        name=g.name or "graph",
        opset_imports={o.domain: o.version for o in model.opset_import},
        ir_version=model.ir_version, functions=list(model.functions),
        producer_name=model.producer_name or "optimize-model",
        winograd=winograd_marks(model),
    )
    _remove_identities(graph)
    return graph


# The model metadata key under which Graph.winograd travels: {weight initializer: tile size m}
WINOGRAD_METADATA = "optimize-model.winograd"


def winograd_marks(model: onnx.ModelProto) -> dict[str, int]:
    """The convolutions a model marks for the Winograd kernel (:attr:`Graph.winograd`), by weight name; a
    malformed entry marks nothing (the marks only choose a kernel, never the function)."""
    for prop in model.metadata_props:
        if prop.key == WINOGRAD_METADATA:
            try:
                marks = json.loads(prop.value)
                return {str(w): int(m) for w, m in marks.items() if int(m) in (2, 4, 6)}
            except (ValueError, TypeError, AttributeError):
                return {}
    return {}


def _check_dtype(name: str, dtype: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise UserError(f"tensor {name!r} has dtype {dtype}, which is not supported; supported: "
                        f"{', '.join(sorted(SUPPORTED_DTYPES))} (cast it in the exporting framework)")


def _remove_identities(graph: Graph) -> None:
    """Bypass Identity nodes whose output is not a graph output (those keep their name, so they stay)."""
    outputs = set(graph.output_names)
    rename: dict[str, str] = {}
    kept: list[Node] = []
    for n in graph.nodes:
        n.inputs = [rename.get(t, t) for t in n.inputs]
        if n.op_type == "Identity" and n.domain in DEFAULT_DOMAINS and n.outputs[0] == n.inputs[0]:
            continue  # x -> x: the dynamo exporter writes this for an output that is an input (ORT rejects it)
        if n.op_type == "Identity" and n.domain in DEFAULT_DOMAINS and n.outputs[0] not in outputs:
            rename[n.outputs[0]] = n.inputs[0]
            continue
        kept.append(n)
    graph.nodes = kept
    if rename:
        _rename_in_subgraphs(graph, rename)


def account_nodes(source: onnx.ModelProto, graph: Graph) -> dict[str, Any]:
    """Where every top-level node of ``source`` went in the imported ``graph``: the proof of "0 dropped".

    A source node is *kept* when an IR node of the same op type writes the same outputs, *folded* when it
    is a Constant whose output became a weight, *bypassed* when it is an Identity whose output name no
    longer occurs in the graph (its readers were rewired to its input).  Anything else is *dropped* and
    listed by name, which import must never do.
    """
    kept_outputs = {(n.op_type, tuple(n.outputs)) for n in graph.nodes}
    referenced = {t for n in graph.nodes for t in (*n.inputs, *n.outputs)} | set(graph.output_names)
    counts = {"kept": 0, "folded_constants": 0, "bypassed_identities": 0}
    dropped: list[str] = []
    for n in source.graph.node:
        default_domain = n.domain in DEFAULT_DOMAINS
        if (n.op_type, tuple(n.output)) in kept_outputs:
            counts["kept"] += 1
        elif default_domain and n.op_type == "Constant" and n.output[0] in graph.initializers:
            counts["folded_constants"] += 1
        elif default_domain and n.op_type == "Identity" and (n.output[0] == n.input[0]
                                                              or n.output[0] not in referenced):
            counts["bypassed_identities"] += 1
        else:
            dropped.append(n.name or f"{n.op_type}->{','.join(n.output)}")
    return {**counts, "dropped_nodes": len(dropped), "dropped": dropped}


def _rename_in_subgraphs(graph: Graph, rename: dict[str, str]) -> None:
    """Control-flow bodies may capture outer tensors by name, at any depth; keep those references valid."""
    for n in graph.nodes:
        for v in n.attrs.values():
            if isinstance(v, onnx.GraphProto):
                rename_reads(v, rename)


# ---- control-flow bodies: names resolved per scope ----------------------------------------------------------
# A body reads the tensors of every enclosing graph by name, and may define a name of its own that an enclosing
# graph defines too after the node (onnx.checker's full check and onnxruntime accept it; a sibling body may
# reuse it as well): that name is the body's own tensor there, https://onnx.ai/onnx/repo-docs/IR.html#graphs.

def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The bodies of a control-flow node (If's branches, Loop's and Scan's body)."""
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def local_names(g: onnx.GraphProto) -> set[str]:
    """The tensors ``g`` itself defines (its inputs, weights and node outputs; not those of its bodies)."""
    return {i.name for i in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output if o}


def rename_reads(g: onnx.GraphProto, rename: dict[str, str]) -> None:
    """Rename the outer tensors that ``g``'s nodes and bodies read, in place; a name a scope defines itself
    shadows the outer one there, so its reads in that scope stay."""
    rename = {k: v for k, v in rename.items() if k not in local_names(g)}
    if not rename:
        return
    for n in g.node:
        n.input[:] = [rename.get(t, t) for t in n.input]
        for body in subgraphs(n):
            rename_reads(body, rename)


def all_names(g: onnx.GraphProto) -> set[str]:
    """Every tensor name of ``g`` and its bodies: defined or read."""
    out = {i.name for i in (*g.input, *g.output, *g.value_info)} | {t.name for t in g.initializer}
    for n in g.node:
        out.update(n.input)
        out.update(n.output)
        for body in subgraphs(n):
            out |= all_names(body)
    return out


def _capture_nested_reads(body: onnx.GraphProto, taken: set[str]) -> set[str]:
    """Make ``body`` read, by an Identity node of its own, each outer tensor that only its nested bodies read
    (their reads renamed to the Identity's output; ``taken``: every name in use, updated); returns the outer
    tensors ``body`` reads.  Why: what keeps a tensor alive, or renames it, sees the bodies of a node one level
    deep (:func:`graphopt.ir.subgraph_inputs`), so a weight or a node output that only an If nested in a branch
    reads was dropped as unused."""
    local = local_names(body)
    nested: set[str] = set()
    for n in body.node:
        for sub in subgraphs(n):
            nested |= _capture_nested_reads(sub, taken) - local
    direct = {t for n in body.node for t in n.input if t and t not in local}
    fresh: dict[str, str] = {}
    for name in sorted(nested - direct):
        k = 1
        while f"{name}_outer{k}" in taken:
            k += 1
        fresh[name] = f"{name}_outer{k}"
        taken.add(fresh[name])
    for n in body.node:
        for sub in subgraphs(n):
            rename_reads(sub, fresh)
    if fresh:
        nodes = [helper.make_node("Identity", [name], [copy]) for name, copy in fresh.items()] + list(body.node)
        del body.node[:]
        body.node.extend(nodes)
    return direct | nested


def _capture_outer_reads(g: onnx.GraphProto) -> None:
    """:func:`_capture_nested_reads` for every body of ``g``'s nodes, in place."""
    bodies = [sub for n in g.node for sub in subgraphs(n)]
    taken = all_names(g) if bodies else set()
    for sub in bodies:
        _capture_nested_reads(sub, taken)


def _value_info_proto(info: TensorInfo) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
    shape = None if info.shape is None else [d if isinstance(d, int) else (None if d == "?" else d) for d in info.shape]
    return helper.make_tensor_value_info(info.name, elem, shape)


def _attribute(key: str, value: Any, attr_type: int | None) -> onnx.AttributeProto:
    if isinstance(value, np.ndarray):
        value = numpy_helper.from_array(value)
    return helper.make_attribute(key, value, attr_type=attr_type)


def export_onnx(graph: Graph, check: bool = True) -> onnx.ModelProto:
    """Write the graph as an ONNX model with the original interface; ``onnx.checker`` must accept it."""
    nodes = []
    for n in graph.nodes:
        attrs = [_attribute(k, v, n.attr_types.get(k)) for k, v in n.attrs.items()]
        node = helper.make_node(n.op_type, n.inputs, n.outputs, name=n.name, domain=n.domain or None)
        node.attribute.extend(attrs)
        nodes.append(node)
    interface = set(graph.input_names) | set(graph.output_names)
    produced = {o for n in graph.nodes for o in n.outputs}
    value_info = [_value_info_proto(v) for k, v in graph.value_info.items()
                  if k not in interface and k in produced and v.dtype in SUPPORTED_DTYPES
                  and v.shape is not None]
    g = helper.make_graph(
        nodes, graph.name,
        [_value_info_proto(i) for i in graph.inputs],
        [_value_info_proto(o) for o in graph.outputs],
        initializer=[numpy_helper.from_array(np.asarray(a), k) for k, a in graph.initializers.items()],
        value_info=value_info,
    )
    model = helper.make_model(
        g, opset_imports=[helper.make_opsetid(d, v) for d, v in graph.opset_imports.items()],
        producer_name=graph.producer_name,
    )
    # readable by the pinned onnxruntime; at least IR_WEIGHTS_APART, since folded Constants are weights no input lists
    model.ir_version = min(max(graph.ir_version, IR_WEIGHTS_APART), ort_max_ir_version())
    model.functions.extend(graph.functions)
    marked = {w: m for w, m in sorted(graph.winograd.items()) if w in graph.initializers}
    if marked:
        helper.set_model_props(model, {WINOGRAD_METADATA: json.dumps(marked)})
    if check:
        try:
            onnx.checker.check_model(model, full_check=False)
        except onnx.checker.ValidationError as exc:
            # The checker insists on a shape field for outputs; models whose exporter left an output's rank
            # unknown (and onnx shape inference could not find it) still run, so that alone is no failure.
            unknown_rank = any(o.shape is None for o in graph.outputs)
            if not (unknown_rank and "Field 'shape' of 'type' is required" in str(exc)):
                raise RuntimeError(f"exported model fails onnx.checker: {str(exc).splitlines()[0]}") from exc
    return model


@functools.lru_cache(maxsize=1)
def ort_max_ir_version() -> int:
    """The newest ONNX IR version the installed onnxruntime loads.  onnxruntime exposes no constant for it and
    the pinned onnx writes a newer one by default (onnx.IR_VERSION 14, onnxruntime 1.31 reads 13), so it is
    probed once with a one-node model, newest version first."""
    import onnxruntime as ort

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    for version in range(onnx.IR_VERSION, 7, -1):
        model.ir_version = version
        try:
            ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            return version
        except Exception:  # noqa: BLE001 - "Unsupported model IR version": try the next older one
            continue
    return 7


# protobuf cannot serialize a message of 2 GiB or more (https://protobuf.dev/programming-guides/proto-limits/):
# a model larger than this is saved with its weights in a data file beside it, the layout torch.onnx.export
# and onnx.save use for large models (https://onnx.ai/onnx/repo-docs/ExternalData.html).
EXTERNAL_DATA_ABOVE = 2**31 - 1
EXTERNAL_DATA_MIN_TENSOR = 1024  # bytes: smaller tensors (shapes, scalars) stay inside the model file


def external_data_name(path: str | os.PathLike) -> str:
    """The weights file written beside ``path`` for a model too large for one file: ``NAME.onnx.data``."""
    return Path(path).name + ".data"


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> list[Path]:
    """Write ``model`` to ``path`` atomically; returns the files written.

    Above :data:`EXTERNAL_DATA_ABOVE` serialized bytes the weights go to ``NAME.onnx.data`` beside it
    (:func:`onnx.load` and onnxruntime read it from there).  Both files are written in a staging folder
    next to them and renamed into place, the weights first, so a killed run leaves the old pair or a
    complete new weights file, never a truncated one; a stale weights file of an earlier, larger model is
    removed.  The caller's proto is not changed (onnx's external-data writer rewrites the tensors it moves).
    """
    p = Path(path)
    data = p.with_name(external_data_name(p))
    if model.ByteSize() <= EXTERNAL_DATA_ABOVE:
        write_bytes_atomic(p, model.SerializeToString())
        with contextlib.suppress(FileNotFoundError):
            data.unlink()
        return [p]
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    with staging_dir(p.parent) as tmp:
        onnx.save_model(copy, str(tmp / p.name), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=EXTERNAL_DATA_MIN_TENSOR)
        os.replace(tmp / data.name, data)
        os.replace(tmp / p.name, p)
    return [p, data]
