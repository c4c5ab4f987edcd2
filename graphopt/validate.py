"""Everything about a command's model input that can be wrong, checked before any long work.

Every console script runs :func:`check_model` first, so a bad model costs seconds and one line
(a :class:`~graphopt.errors.UserError` naming the problem and the fix), never a tuning run followed by an
internal error, a ``RecursionError`` or a wrong success.  In order, cheapest first:

1. the file (:func:`graphopt.onnx_io.load_model`: missing, a folder, not ONNX, external data missing);
2. the graph's structure, with our own messages (no outputs, two writers of one tensor, a tensor nobody
   writes - a missing initializer or a dangling input -, a cycle, nodes out of topological order), because
   ``onnx.checker`` reports several of these all as "not topologically sorted";
3. dtypes we support, opset and IR versions the pinned onnx / onnxruntime read; the scales, zero points and
   quantized types of quantized operators (:mod:`graphopt.quant_check`, before the dtypes, so that an int4 zero
   point is named with its node);
4. ``--input-shape`` / ``--dim`` / ``--inputs`` against the model's inputs (each array's .npy header: the arrays
   are read last, after the memory check; ``--dim`` names a dimension the inputs have and agrees with the other
   two, :mod:`graphopt.dims`), and every runtime input static after them (one error naming all that are not);
5. ``onnx.checker`` full check (types and shapes included), see
   https://onnx.ai/onnx/api/checker.html;
6. the memory the model needs, estimated from its inferred shapes, against this machine's memory (a
   1e6 x 1e6 MatMul or a 130 GB Expand is refused here instead of being attempted);
7. an onnxruntime session on the model (it is the reference every check compares with: a model it rejects
   cannot be checked), unknown custom-domain operators named; a model of an opset whose operator versions
   onnxruntime no longer implements (BatchNormalization-6, AveragePool-1: opsets 1-6) is upgraded with onnx's
   version converter (:func:`upgrade_opset`), and every stage then works on the upgraded model.

What the machine allows (a thread count, the memory estimate against this machine's memory) is checked by
:mod:`graphopt.limits`, which needs no ONNX: kerneltune's single-operator mode uses it too.

No TVM here: a bad file must fail in well under a second.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection

import numpy as np
import onnx
from onnx import helper, shape_inference, version_converter

from graphopt.dims import check_agreement, check_dim_names, dims_of, ranges_of, resolve_dims, within_ranges
from graphopt.errors import UserError
from graphopt.limits import TensorSize, check_memory, format_bytes, memory_limit_bytes
from graphopt.onnx_io import (DEFAULT_DOMAINS, SUPPORTED_DTYPES, InputShapes, apply_input_shapes, ir_version_for,
                              load_model, require_static_inputs, without_weight_data)
from graphopt.quant_check import check_quantization

# The newest IR version onnxruntime 1.31 reads; the pinned onnx writes 14 by default (onnx.IR_VERSION), so a
# model saved with a plain onnx.helper.make_model is one onnxruntime rejects.
_ORT_IR_RE = re.compile(r"max supported IR version: (\d+)")
_ORT_OPSET_RE = re.compile(r"official support for domain (\S+) is till opset (\d+)")
_ORT_UNKNOWN_OP_RE = re.compile(r"([\w.]*):(\w+)\(-?\d+\) is not a registered function/op")
_ORT_NO_KERNEL_RE = re.compile(r"Could not find an implementation for (\w+)\((\d+)\)")
# onnxruntime "only *guarantees* support for models stamped with opset version 7 or above" (its own warning); an
# older model may use an operator version it has no kernel for (BatchNormalization-6, AveragePool-1).
ORT_OLDEST_OPSET = 7
# The opset a model is upgraded to when onnxruntime lacks one of its operator versions.  onnxruntime runs
# opset 7 and up, but TVM's ONNX importer is written against opset 13: 35 of its converters have no
# implementation as old as their operator's version at opset 7, 37 at opset 11 and 12, 5 at opset 13 (Slice-1
# of an opset-6 model upgraded to 7 or 9 is rejected by it; upgraded to 13, the model compiles and matches).
UPGRADE_OPSET = 13
log = logging.getLogger(__name__)


@dataclass
class ModelInput:
    """A model that passed every check, with the shapes and sample inputs it runs with."""

    path: str
    proto: onnx.ModelProto  # as loaded (input shapes not applied: each stage applies ``input_shapes``)
    input_shapes: InputShapes = field(default_factory=dict)  # --input-shape, --dim and the --inputs shapes merged
    samples: dict[str, np.ndarray] | None = None  # from --inputs FILE.npz
    memory_bytes: int = 0  # the estimate :func:`check_memory` accepted
    upgrade: OpsetUpgrade | None = None  # set when ``proto`` is the model upgraded to an opset onnxruntime runs
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # --dim NAME=LO:HI: the sizes a build serves


@dataclass(frozen=True)
class OpsetUpgrade:
    """report.json's ``opset_upgrade``: the model was compiled, checked and shipped at ``to_opset``, upgraded from
    ``from_opset`` by onnx's version converter because onnxruntime implements no ``lacking`` (e.g.
    BatchNormalization-6)."""

    from_opset: int
    to_opset: int
    lacking: str

    def to_json(self) -> dict[str, object]:
        return {"from": self.from_opset, "to": self.to_opset, "by": "onnx.version_converter",
                "why": f"onnxruntime implements no {self.lacking}"}


def check_model(path: str | os.PathLike, input_shapes: InputShapes | None = None,
                inputs_file: str | os.PathLike | None = None, memory_limit: int | None = None) -> ModelInput:
    """Run every check (module docstring) on the model at ``path``; a UserError for the first that fails.
    ``input_shapes`` is ``--input-shape``'s shapes, a :class:`graphopt.dims.ShapeRequest` when ``--dim`` sizes
    come with them (the returned ``input_shapes`` hold every input they fix)."""
    with contextlib.suppress(OSError):  # a missing file is load_model's to report
        if Path(path).stat().st_size > (memory_limit or memory_limit_bytes()):
            limit = memory_limit or memory_limit_bytes()
            raise UserError(f"{str(path)!r} is {format_bytes(Path(path).stat().st_size)}, more than this machine's "
                            f"{format_bytes(limit)} of memory: it cannot be loaded here")
    proto = load_model(path)
    name = Path(path).name
    check_structure(proto.graph)
    check_versions(proto)
    check_quantization(proto)
    check_dtypes(proto.graph)
    headers = read_input_headers(inputs_file, model_inputs(proto)) if inputs_file else {}
    dims, ranges = dims_of(input_shapes), ranges_of(input_shapes)  # --dim, carried by a ShapeRequest
    shapes = dict(input_shapes or {})
    if dims or ranges:
        check_dim_names(proto, dims | {k: f"{lo}:{hi}" for k, (lo, hi) in ranges.items()})
        check_agreement(proto, dims, shapes, "--input-shape")
        check_agreement(proto, dims, {k: shape for k, (shape, _) in headers.items()}, "--inputs")
        # a range's size in the one-size stages: the size --input-shape or --inputs gives it, else representative()
        dims = dims | within_ranges(proto, ranges, shapes, "--input-shape") \
            | within_ranges(proto, ranges, {k: shape for k, (shape, _) in headers.items()}, "--inputs")
    for k, (shape, _) in headers.items():
        if k in shapes and tuple(shapes[k]) != shape:
            raise UserError(f"--input-shape {k}={','.join(map(str, shapes[k]))} contradicts --inputs, where "
                            f"{k!r} has shape {list(shape)}: drop one of them")
        shapes[k] = shape
    shapes = resolve_dims(proto, dims, shapes)
    shaped = onnx.ModelProto.FromString(proto.SerializeToString()) if shapes else proto
    if shapes:
        apply_input_shapes(shaped, shapes)
    require_static_inputs(shaped, dims)
    check_nonempty_inputs(shaped)
    if shapes:
        check_onnx(proto, name)  # the model itself first, so that a failure below is the sizes' fault
    check_onnx(shaped, name, shapes)
    inferred = _infer(without_weight_data(shaped))  # types and dims: all the memory check reads
    memory = check_memory(tensor_sizes(inferred), memory_limit)
    proto, upgrade = check_onnxruntime(proto, path)
    samples = load_inputs(inputs_file, headers) if inputs_file else None  # last: the memory check passed them
    return ModelInput(str(path), proto, shapes, samples, memory, upgrade, ranges)


def check_nonempty_inputs(model: onnx.ModelProto) -> None:
    """No runtime input with a zero-size dimension: --input-shape and --inputs refuse empty tensors, so a model
    declaring one would build and then be refused the only shape it was built for."""
    weights = {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        dims = [d.dim_value for d in inp.type.tensor_type.shape.dim] if inp.type.HasField("tensor_type") else []
        if inp.name not in weights and 0 in dims and all(d.HasField("dim_value") for d in
                                                         inp.type.tensor_type.shape.dim):
            raise UserError(f"input {inp.name!r} has a zero-size dimension (shape {dims}): a build for it computes "
                            "nothing; re-export the model with at least one element per axis")


# ---- 2. structure ------------------------------------------------------------------------------------------

def check_structure(g: onnx.GraphProto) -> None:
    """Our own one-line messages for the structural faults users hit (top-level graph)."""
    if not g.output:
        raise UserError("the model has no graph outputs, so there is nothing to compute or check: mark the "
                        "tensors you want as outputs in the exporting framework")
    inputs = [i.name for i in g.input]
    inits = {t.name for t in g.initializer}
    given = set(inputs) | inits
    writer: dict[str, str] = {}
    for k, n in enumerate(g.node):
        label = _node_label(n, k)
        for o in n.output:
            if not o:
                continue
            if o in writer:
                raise UserError(f"tensor {o!r} is written by two nodes ({writer[o]} and {label}); ONNX graphs "
                                "assign each tensor once: rename one of the outputs and re-export")
            if o in given:
                raise UserError(f"node {label} writes {o!r}, which is already a graph input or initializer: "
                                "rename the node's output and re-export")
            writer[o] = label
    for k, n in enumerate(g.node):
        for t in n.input:
            if t and t not in writer and t not in given:
                raise UserError(f"node {_node_label(n, k)} reads tensor {t!r}, which no node, graph input or "
                                "initializer provides (a missing initializer or a dangling input): re-export "
                                "the model, or add the tensor")
    seen: set[str] = set()
    for o in g.output:
        if o.name in seen:
            raise UserError(f"graph output {o.name!r} is listed twice in the model's outputs: list each tensor once "
                            "(give a second name with an Identity node if both are wanted) and re-export")
        seen.add(o.name)
        if o.name not in writer and o.name not in given:
            raise UserError(f"graph output {o.name!r} is written by no node and is no input or initializer: "
                            "remove it from the outputs or re-export the model")
    _check_order(g, writer, given)


def _node_label(n: onnx.NodeProto, k: int) -> str:
    return f"{n.name!r} ({n.op_type})" if n.name else f"#{k} ({n.op_type})"


def _check_order(g: onnx.GraphProto, writer: dict[str, str], given: set[str]) -> None:
    """A cycle, then nodes out of topological order (onnx.checker and every stage need sorted nodes)."""
    index = {o: k for k, n in enumerate(g.node) for o in n.output if o}
    deps = [{index[t] for t in n.input if t in index} for n in g.node]
    indegree = [len(d) for d in deps]
    users: dict[int, list[int]] = {}
    for k, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(k)
    ready = [k for k, d in enumerate(indegree) if d == 0]
    done = 0
    while ready:
        k = ready.pop()
        done += 1
        for u in users.get(k, []):
            indegree[u] -= 1
            if indegree[u] == 0:
                ready.append(u)
    if done < len(g.node):
        k = next(k for k, d in enumerate(indegree) if d > 0)
        raise UserError(f"the graph has a cycle through node {_node_label(g.node[k], k)}: ONNX graphs must be "
                        "acyclic (loops belong in a Loop or Scan node); re-export the model")
    for k, n in enumerate(g.node):
        later = next((t for t in n.input if t in index and index[t] > k), None)
        if later is not None:
            raise UserError(f"nodes are not in topological order: node {_node_label(n, k)} reads {later!r} "
                            f"before node {writer[later]} writes it; sort the nodes (ONNX requires it), e.g. "
                            "re-export, or reorder graph.node")


# ---- 3. versions and dtypes --------------------------------------------------------------------------------

def check_versions(model: onnx.ModelProto) -> None:
    """Opsets the pinned onnx knows and IR versions it defines (onnxruntime's own limits: check_onnxruntime)."""
    newest = onnx.defs.onnx_opset_version()
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS and o.version > newest:
            raise UserError(f"the model imports opset {o.version} of the default ONNX domain, newer than the "
                            f"installed onnx knows ({newest}): re-export with an older opset, e.g. "
                            "torch.onnx.export(..., opset_version=17)")
        if o.domain in DEFAULT_DOMAINS and o.version < 1:
            raise UserError(f"the model imports opset {o.version} of the default ONNX domain: re-export it "
                            "with a valid opset (e.g. 17)")
    if model.ir_version > onnx.IR_VERSION:
        raise UserError(f"the model has IR version {model.ir_version}, newer than the installed onnx knows "
                        f"({onnx.IR_VERSION}): re-save it with an older IR version (model.ir_version = 10)")


def _dtype_name(elem_type: int) -> str:
    if elem_type == onnx.TensorProto.STRING:
        return "string"  # numpy would call it "object"
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:  # noqa: BLE001 - STRING, UNDEFINED, or a type numpy cannot name
        try:
            return onnx.TensorProto.DataType.Name(elem_type).lower()
        except ValueError:
            return f"type {elem_type}"


def check_dtypes(g: onnx.GraphProto) -> None:
    """Inputs, outputs and weights of dtypes the whole stack handles (the kernels, numpy and onnxruntime)."""
    tensors = [(vi.name, vi.type.tensor_type.elem_type) for vi in list(g.input) + list(g.output)
               if vi.type.HasField("tensor_type")]
    tensors += [(t.name, t.data_type) for t in g.initializer]
    for vi in list(g.input) + list(g.output):
        if not vi.type.HasField("tensor_type"):
            raise UserError(f"{vi.name!r} is a {vi.type.WhichOneof('value') or 'untyped'} value, not a tensor: "
                            "only tensor inputs and outputs are supported (export the model with tensors only)")
    for name, elem in tensors:
        dtype = _dtype_name(elem)
        if dtype not in SUPPORTED_DTYPES:
            raise UserError(f"tensor {name!r} has dtype {dtype}, which is not supported; supported: "
                            f"{', '.join(sorted(SUPPORTED_DTYPES))} (cast it in the exporting framework)")


# ---- 4. sample inputs --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InputSpec:
    """What ``--inputs`` may give for one runtime input: its dtype and dims (None: any size; ``dims`` None: any
    rank).  Taken from the ONNX model (optimize-model and the other model commands) or from a built folder's
    signature (run-model), so that every command reads the file by the same rules."""

    dtype: str
    dims: tuple[int | None, ...] | None


Headers = dict[str, tuple[tuple[int, ...], np.dtype]]  # {array name: (shape, dtype)} of an --inputs file


def model_inputs(model: onnx.ModelProto) -> dict[str, InputSpec]:
    """The model's runtime inputs (graph inputs that are no initializer), in order."""
    inits = {t.name for t in model.graph.initializer}
    specs = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        tt = i.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim) \
            if tt.HasField("shape") else None
        specs[i.name] = InputSpec(_dtype_name(tt.elem_type), dims)
    return specs


def read_inputs(path: str | os.PathLike, expected: dict[str, InputSpec],
                fixed: Collection[str] = ()) -> dict[str, np.ndarray]:
    """``--inputs FILE.npz`` checked (:func:`read_input_headers`), then read: for a caller whose ``expected``
    dims are all static (run-model's compiled shapes), so that the headers bound every array's size.
    ``fixed``: inputs that take a known value when the file leaves them out (a specialized build's)."""
    return load_inputs(path, read_input_headers(path, expected, fixed))


def read_input_headers(path: str | os.PathLike, expected: dict[str, InputSpec],
                       fixed: Collection[str] = ()) -> Headers:
    """``--inputs FILE.npz``: each array's name, dtype, rank and static dims checked against ``expected`` from its
    .npy header alone.  A small file can hold a compressed array of gigabytes: it is
    refused here (or by the memory check its shape feeds) before a byte of it is decompressed.

    One rule for every command: inputs the file does not name are drawn at random (the ``--seed`` draw), and a
    warning names them."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--inputs {str(p)!r} {'is a folder' if p.is_dir() else 'does not exist'}: pass an .npz "
                        "file written by numpy.savez(FILE, input_name=array, ...)")
    headers = _npy_headers(p)
    for k, (shape, dtype) in headers.items():
        _check_sample(k, shape, dtype, expected)
    missing = [k for k in expected if k not in headers and k not in fixed]  # a fixed one takes its value
    if missing:
        log.warning("warning: --inputs %s gives no %s: random values (the --seed draw) are used for %s", p,
                    ", ".join(missing), "it" if len(missing) == 1 else "them")
    return headers


def load_inputs(path: str | os.PathLike, headers: Headers) -> dict[str, np.ndarray]:
    """The arrays whose headers :func:`read_input_headers` accepted (and whose sizes the memory check did)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in headers}
    except _NPZ_ERRORS as exc:
        raise _unreadable(path, exc) from None


_NPZ_ERRORS = (ValueError, OSError, zipfile.BadZipFile, EOFError, zlib.error)


def _unreadable(path: str | os.PathLike, exc: BaseException) -> UserError:
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
    return UserError(f"--inputs {str(path)!r} is not a readable .npz file ({detail}): write it with "
                     "numpy.savez(FILE, input_name=array, ...)")


def _npy_headers(p: Path) -> Headers:
    """{array name: (shape, dtype)} of every member of the .npz archive, from the headers only."""
    try:
        with zipfile.ZipFile(p) as z:
            return dict(_npy_header(z, info) for info in z.infolist())
    except _NPZ_ERRORS as exc:
        raise _unreadable(p, exc) from None


def _npy_header(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[str, tuple[tuple[int, ...], np.dtype]]:
    """One member's name and its .npy header's shape and dtype (numpy.lib.format reads the first bytes only)."""
    if not info.filename.endswith(".npy"):
        raise ValueError(f"member {info.filename!r} is no .npy array")
    name = info.filename[:-4]
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in readers:
            raise ValueError(f"array {name!r} is in .npy format {version[0]}.{version[1]}")
        shape, _, dtype = readers[version](f)
    if dtype.hasobject:
        raise ValueError(f"array {name!r} holds Python objects, which only pickle can read")
    return name, (tuple(int(d) for d in shape), dtype)


def _check_sample(k: str, shape: tuple[int, ...], dtype: np.dtype, expected: dict[str, InputSpec]) -> None:
    """One array of --inputs against the input it names."""
    if k not in expected:
        raise UserError(f"--inputs names {k!r}, which is not a runtime input of the model (inputs: "
                        f"{', '.join(sorted(expected)) or 'none'}): rename the array")
    want = expected[k]
    if dtype.name != want.dtype:
        raise UserError(f"--inputs {k!r} is {dtype.name} but the model input is {want.dtype}: save it as "
                        f"{want.dtype} (array.astype('{want.dtype}'))")
    if want.dims is not None:
        if len(want.dims) != len(shape):
            raise UserError(f"--inputs {k!r} has rank {len(shape)} but the model input has rank {len(want.dims)}")
        for axis, (d, n) in enumerate(zip(want.dims, shape)):
            if d is not None and d != n:
                raise UserError(f"--inputs {k!r} has {n} at axis {axis} where the model fixes {d}: "
                                "give an array of the model's static size")
    if math.prod(shape) == 0:
        raise UserError(f"--inputs {k!r} is empty (shape {list(shape)}): give at least one element per axis")


# ---- 5. onnx.checker ---------------------------------------------------------------------------------------

def check_onnx(model: onnx.ModelProto, name: str, shapes: InputShapes | None = None) -> None:
    """onnx.checker's full check (strict shape inference included) as one line; ``shapes`` are the input
    sizes applied to ``model``, blamed when given (the caller checked the model without them first)."""
    try:
        if model.ByteSize() < 2**31 - 1:
            onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        if shapes:
            given = " ".join(f"{k}={','.join(map(str, v))}" for k, v in sorted(shapes.items()))
            raise UserError(f"{name} does not accept the input sizes {given} (onnx.checker: {first[:200]}): give "
                            "sizes the model was made for (--input-shape / --inputs)") from None
        raise UserError(f"{name} is not a valid ONNX model (onnx.checker: {first[:240]}): fix or re-export "
                        "the model") from None


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - malformed models make inference fail in many ways
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise UserError(f"ONNX shape inference failed ({first[:200]}); check the model with onnx.checker or "
                        "re-export it") from None


# ---- 6. memory (the estimate; graphopt.limits.check_memory checks it) ------------------------------------------

def tensor_sizes(model: onnx.ModelProto) -> list[TensorSize]:
    """Every tensor of a shape-inferred model whose shape is fully known (Python ints: no overflow)."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    out: list[TensorSize] = [TensorSize(t.name, tuple(int(d) for d in t.dims), _dtype_name(t.data_type), "weight")
                             for t in g.initializer if _dtype_name(t.data_type) in SUPPORTED_DTYPES]
    seen = set(inits)
    for vi, kind in [(i, "input") for i in g.input] + [(v, "value") for v in list(g.value_info) + list(g.output)]:
        if vi.name in seen or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        dtype = _dtype_name(tt.elem_type)
        if dtype not in SUPPORTED_DTYPES or not tt.HasField("shape"):
            continue
        if all(d.HasField("dim_value") for d in tt.shape.dim):
            seen.add(vi.name)
            out.append(TensorSize(vi.name, tuple(int(d.dim_value) for d in tt.shape.dim), dtype, kind))
    for n in g.node:  # Constant nodes hold weights too
        if n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR and n.output[0] not in seen:
                    seen.add(n.output[0])
                    out.append(TensorSize(n.output[0], tuple(int(d) for d in a.t.dims), _dtype_name(a.t.data_type),
                                          "weight"))
    return out


# ---- 7. onnxruntime ----------------------------------------------------------------------------------------

def check_onnxruntime(model: onnx.ModelProto, path: str | os.PathLike) -> tuple[onnx.ModelProto, OpsetUpgrade | None]:
    """The model onnxruntime, the reference of every check, loads: ``model``, or ``model`` upgraded to
    :data:`UPGRADE_OPSET` (:func:`upgrade_opset`) when onnxruntime lacks one of its operator versions and its
    opset is older than :data:`ORT_OLDEST_OPSET` (a newer one lacking a kernel has a dtype onnxruntime does not
    implement the operator for: today's refusal); a UserError when it loads neither."""
    refusal = _ort_refusal(model, path)
    if refusal is None:
        return model, None
    lacking = _ORT_NO_KERNEL_RE.search(refusal)
    opset = _default_opset(model)
    if lacking is None or opset is None or opset >= ORT_OLDEST_OPSET:
        raise UserError(_ort_message(model, refusal))
    upgrade = OpsetUpgrade(opset, UPGRADE_OPSET, f"{lacking.group(1)}-{lacking.group(2)}")
    upgraded = upgrade_opset(model, path, upgrade)
    log.warning("note: %s uses opset %d, and onnxruntime implements no %s: the model is upgraded to opset %d by "
                "onnx's version converter, and checked and built at that opset", Path(path).name, opset,
                upgrade.lacking, UPGRADE_OPSET)
    return upgraded, upgrade


def _default_opset(model: onnx.ModelProto) -> int | None:
    """The version of the default ONNX domain the model imports (None: it imports none)."""
    return next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), None)


def upgrade_opset(model: onnx.ModelProto, path: str | os.PathLike, upgrade: OpsetUpgrade) -> onnx.ModelProto:
    """``model`` converted to ``upgrade.to_opset`` by :func:`onnx.version_converter.convert_version`, checked by
    onnx.checker and loaded by onnxruntime.  Why: onnxruntime no longer implements the operator versions of
    opsets 1-6 (older exporters' models), so without the upgrade nothing could check the build; the converter
    rewrites each operator to its version at the new opset, computing the same values (a BatchNormalization-6's
    ``is_test`` dropped, an ``Add`` with ``broadcast=1`` as numpy broadcasting, a Slice's attributes as inputs).
    A UserError naming the opset and the re-export when the converter fails, onnxruntime's refusal when the
    upgraded model fails too."""
    fix = (f"re-export the model at opset {upgrade.to_opset} or newer (e.g. torch.onnx.export(..., "
           "opset_version=17))")
    try:
        upgraded = version_converter.convert_version(model, upgrade.to_opset)
        upgraded.ir_version = ir_version_for(upgraded)  # the converter keeps the old one
        onnx.checker.check_model(upgraded, full_check=True)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError, ValidationError, InferenceError
        raise UserError(f"the model uses opset {upgrade.from_opset}, and onnxruntime implements no {upgrade.lacking}; "
                        f"onnx's version converter cannot upgrade it to opset {upgrade.to_opset} "
                        f"({_conversion_failure(model, upgrade.to_opset, exc)[:200]}): {fix}") from None
    refusal = _ort_refusal(upgraded, path)
    if refusal is not None:  # not the opset's fault alone, e.g. a dtype onnxruntime has no kernel for
        raise UserError(f"onnxruntime cannot load the model at its opset {upgrade.from_opset} ({upgrade.lacking} is "
                        f"not implemented) nor upgraded to opset {upgrade.to_opset} by onnx's version converter "
                        f"({_ort_detail(refusal)[:200]}); fix or re-export the model")
    return upgraded


def _conversion_failure(model: onnx.ModelProto, opset: int, exc: Exception) -> str:
    """Why the converter failed, in words: the operators that no longer exist at ``opset`` (opset 1's experimental
    ImageScaler or Crop: the converter's own message is an unformatted C++ assertion), else its message."""
    gone = sorted({n.op_type for n in model.graph.node
                   if n.domain in DEFAULT_DOMAINS and not _has_schema(n.op_type, opset)})
    if gone:
        return f"{', '.join(gone)} {'does' if len(gone) == 1 else 'do'} not exist at opset {opset}"
    return re.sub(r"^\S+:\d+: \w+: ", "", _first_line(str(exc)))  # the converter's source location


def _has_schema(op_type: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, opset)
    except onnx.defs.SchemaError:
        return False
    return True


def _ort_refusal(model: onnx.ModelProto, path: str | os.PathLike) -> str | None:
    """onnxruntime's error on a session of the model (optimizations off: only loading and type checking matter),
    None when it loads."""
    import onnxruntime as ort  # imported here: the structural checks above fail faster without it

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # errors come back as exceptions; the log would be a second copy
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model.SerializeToString() if model.ByteSize() < 2**31 - 1 else str(path)
    try:
        ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own Fail / InvalidGraph / NotImplemented
        return str(exc)
    return None


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "no detail")


def _ort_message(model: onnx.ModelProto, text: str) -> str:
    m = _ORT_IR_RE.search(text)
    if m:
        return (f"the model has IR version {model.ir_version}, newer than onnxruntime reads ({m.group(1)}): re-save "
                f"it with model.ir_version = {m.group(1)} (onnx.helper.make_model writes {onnx.IR_VERSION} by default)")
    m = _ORT_OPSET_RE.search(text)
    if m:
        used = next((o.version for o in model.opset_import if o.domain in (m.group(1), "") ), "?")
        return (f"the model uses opset {used} of {m.group(1)}, newer than onnxruntime supports ({m.group(2)}): "
                f"re-export with opset_version <= {m.group(2)}")
    m = _ORT_UNKNOWN_OP_RE.search(text)
    if m:
        return (f"operator {m.group(2)} of domain {m.group(1)!r} is unknown to onnxruntime and TVM, so no reference "
                "can run it: replace it in the exporting framework (or register it with onnxruntime and run it there)")
    return f"onnxruntime cannot load the model ({_ort_detail(text)[:240]}); fix or re-export the model"


def _ort_detail(text: str) -> str:
    """The first line of onnxruntime's error without its code prefix and source location."""
    detail = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", _first_line(text))
    return re.sub(r"/onnxruntime_src/\S+ \S+ [^)]*\) ", "", detail)

