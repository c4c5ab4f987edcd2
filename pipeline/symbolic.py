"""One build that serves a range of lengths: ``--dim NAME=LO:HI`` keeps the dimension NAME symbolic through the
compile (issue 41), so one model.so runs every size in the range.

The stages that measure or check (the graph stage, the kernels' default tiles, tuning, the sanity floor, the
check against onnxruntime) work on *one* size: the range's representative size
(:func:`graphopt.dims.representative`, or the size ``--input-shape``/``--inputs`` give), as every other build
does; the layout stage (blocked convs, per size) is not run.  What ships is different in two places:

* **The Relax module is imported with NAME symbolic** (TVM's ONNX importer reads ``dim_param`` as a TIR
  variable): from optimized.onnx with the input's symbolic dimensions restored and checked
  (:func:`graphopt.dynamic.dynamic_model`), else the input model.  Its main function asserts LO <= NAME <= HI
  itself (:func:`bound`: whatever loads model.so, a size outside the range is one message, not a read past a
  buffer) and carries Relax's ``tir_var_upper_bound``, so the VM's memory plan is made once for HI, not
  allocated per call (Relax's StaticPlanBlockMemory).
* **Each kernel with a symbolic extent** is given the template and config of its instance at the
  representative size (:func:`specialize`; the task that tuning measures is that instance), applied to the
  symbolic kernel: the loop that follows the length counts whole tiles and the operand is padded by at most
  one tile (:func:`kerneltune.templates.cpu._symbolic_tiles`), never to HI.  Kernels no template covers get
  the CPU rules, which schedule symbolic extents too.

The compiled model is checked against onnxruntime at the representative size and at the range's ends and an
odd size inside it (:meth:`Served.check_sizes`); report.json's ``served`` says which.

Relax's symbolic shapes: https://tvm.apache.org/docs/deep_dive/relax/learning.html (shape annotations and
symbolic variables); ``tir_var_upper_bound``: ``relax.transform.StaticPlanBlockMemory``'s documentation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx
import tvm
from tvm import relax, tirx

from graphopt.dims import ranged_axes, representative
from graphopt.ir import Graph
from graphopt.onnx_io import InputShapes, import_onnx, runtime_inputs


@dataclass(frozen=True)
class Served:
    """The symbolic dimensions of a build: the range each serves and the size the one-size stages use."""

    ranges: dict[str, tuple[int, int]]  # dimension name -> (lowest, highest) size served
    at: dict[str, int]  # dimension name -> the representative size (graphopt.dims.representative, or the size
    #                     --input-shape / --inputs gave it)

    @classmethod
    def of(cls, model: onnx.ModelProto, shapes: InputShapes, ranges: Mapping[str, tuple[int, int]]) -> Served | None:
        """What a build of ``model`` at ``shapes`` (the checked input shapes: each range at its one size) serves;
        None without ranges."""
        if not ranges:
            return None
        at = {name: representative(lo, hi) for name, (lo, hi) in ranges.items()}
        for name, axis, dim in ranged_axes(model, ranges):
            if len(shapes.get(name, ())) > axis:
                at[dim] = int(shapes[name][axis])
        return cls(dict(ranges), at)

    def check_sizes(self) -> list[dict[str, int]]:
        """The sizes the build is checked at besides the representative one: each range's ends and an odd size
        between them (a length no tile divides), every dimension moved together."""
        picks: list[dict[str, int]] = []
        for pick in (lambda lo, hi: lo, lambda lo, hi: hi, lambda lo, hi: (lo + hi) // 2 | 1):
            sizes = {name: min(max(pick(lo, hi), lo), hi) for name, (lo, hi) in self.ranges.items()}
            if sizes != self.at and sizes not in picks:
                picks.append(sizes)
        return picks

    def shapes_at(self, model: onnx.ModelProto, shapes: InputShapes, sizes: Mapping[str, int]) -> InputShapes:
        """``shapes`` (every input at the representative sizes) with the served dimensions at ``sizes``."""
        out = {name: list(shape) for name, shape in shapes.items()}
        for name, axis, dim in ranged_axes(model, self.ranges):
            if name in out and dim in sizes and len(out[name]) > axis:
                out[name][axis] = sizes[dim]
        return {name: tuple(shape) for name, shape in out.items()}

    def graph_at(self, model: onnx.ModelProto, shapes: InputShapes, sizes: Mapping[str, int]) -> Graph:
        """``model`` in the graph IR with the served dimensions at ``sizes`` (the others as ``shapes``): what
        the checks and the end-to-end timings at a size other than the representative one feed."""
        return import_onnx(model, self.shapes_at(model, shapes, sizes), require_static=True)

    def to_json(self) -> dict:
        return {"ranges": {k: list(v) for k, v in self.ranges.items()}, "representative": dict(self.at)}


def symbolic_model(model: onnx.ModelProto, shapes: InputShapes, served: Served) -> onnx.ModelProto:
    """A copy of ``model`` whose runtime inputs have the sizes of ``shapes`` (the build's, at the representative
    size) on every axis but those named by a served dimension, which stay symbolic under that name."""
    out = onnx.ModelProto.FromString(model.SerializeToString())
    kept = set(ranged_axes(out, served.ranges))
    for inp in runtime_inputs(out):
        fixed = shapes.get(inp.name)
        dims = inp.type.tensor_type.shape.dim
        if fixed is None or len(fixed) != len(dims):
            continue
        for axis, (d, size) in enumerate(zip(dims, fixed)):
            if (inp.name, axis, d.dim_param) not in kept:
                d.Clear()
                d.dim_value = int(size)
    _sized_ranges(out.graph)
    return out


def _sized_ranges(graph: onnx.GraphProto) -> None:
    """Rewrite, in place, each ``Range(0, n, 1)`` whose ``n`` is one dimension of a tensor (``Squeeze(Shape(x,
    start=k, end=k+1))``: the positions GPT-2 and other decoders export) as ``CumSum(ConstantOfShape(Shape(x,
    k, k+1), 1)) - 1``, the same integers.  TVM's importer gives a Range of a symbolic limit a fresh size of its
    own (it counts the elements with tensor arithmetic), so what adds the positions to the tokens has a shape
    it cannot relate to ``sequence``, and a Reshape further on refuses to import; a ConstantOfShape of a shape
    keeps the size symbolic as the dimension itself."""
    from onnx import helper, numpy_helper

    producer = {o: n for n in graph.node for o in n.output}
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    def scalar(name: str):
        value = consts.get(name)
        return None if value is None or value.size != 1 else value.item()

    def one_dim(name: str) -> str | None:  # the 1-element Shape slice ``name`` squeezes, if it is one
        squeeze = producer.get(name)
        if squeeze is None or squeeze.op_type != "Squeeze" or len(squeeze.input) != 1:
            return None
        shape = producer.get(squeeze.input[0])
        if shape is None or shape.op_type != "Shape":
            return None
        attrs = {a.name: a.i for a in shape.attribute}
        return shape.output[0] if attrs.get("end", 0) - attrs.get("start", 0) == 1 and attrs.get("start", 0) >= 0 \
            else None

    rewritten = []
    for n in graph.node:
        dim = one_dim(n.input[1]) if n.op_type == "Range" and len(n.input) == 3 else None
        if dim is None or scalar(n.input[0]) != 0 or scalar(n.input[2]) != 1:
            rewritten.append(n)
            continue
        dtype = consts[n.input[0]].dtype
        base = f"{n.name or n.output[0]}_sized"
        one = helper.make_tensor(f"{base}_one", helper.np_dtype_to_tensor_dtype(dtype), [1], [1])
        rewritten += [
            helper.make_node("ConstantOfShape", [dim], [f"{base}_ones"], value=one, name=f"{base}_ones"),
            helper.make_node("Constant", [], [f"{base}_axis"], value=numpy_helper.from_array(
                np.array(0, np.int64)), name=f"{base}_axis"),
            helper.make_node("CumSum", [f"{base}_ones", f"{base}_axis"], [f"{base}_count"], name=f"{base}_count"),
            helper.make_node("Constant", [], [f"{base}_step"], value=numpy_helper.from_array(
                np.array(1, dtype)), name=f"{base}_step"),
            helper.make_node("Sub", [f"{base}_count", f"{base}_step"], list(n.output), name=n.name)]
    if len(rewritten) != len(graph.node):
        del graph.node[:]
        graph.node.extend(rewritten)


def input_ranges(model: onnx.ModelProto, served: Served) -> dict[str, dict[int, tuple[str, int, int]]]:
    """Each runtime input's served axes (axis -> (dimension name, lowest, highest)): the deploy signature's
    ``ranges``."""
    out: dict[str, dict[int, tuple[str, int, int]]] = {}
    for name, axis, dim in ranged_axes(model, served.ranges):
        out.setdefault(name, {})[axis] = (dim, *served.ranges[dim])
    return out


# What model.so says for a size outside its range (the VM raises it as an AssertionError, naming nothing else).
MESSAGE = ("{name} is {{}}, outside the sizes {low}..{high} this model.so serves: rebuild with --dim {name}=LO:HI "
           "covering it")


def bound(mod: tvm.IRModule, served: Served) -> tvm.IRModule:
    """``mod`` whose main asserts each served dimension is within its range before any kernel runs, and
    declares the ranges' upper ends for the memory plan (``tir_var_upper_bound``)."""
    main = mod["main"]
    sizes = {v.name: v for p in main.params for v in _shape_vars_of(p.ty)}
    bindings = []
    for name, (low, high) in served.ranges.items():
        var = sizes.get(name)
        if var is None:  # the importer dropped every input with it: nothing depends on its size
            continue
        inside = relax.prim_value(tirx.all(var >= low, var <= high))
        check = relax.op.assert_op(inside, [relax.prim_value(var)], MESSAGE.format(name=name, low=low, high=high))
        bindings.append(relax.VarBinding(relax.Var(f"{name}_in_range", check.ty), check))
    body = main.body
    attrs = dict(main.attrs) if main.attrs is not None else {}
    upper = {name: high for name, (_, high) in served.ranges.items() if name in sizes}
    attrs["tir_var_upper_bound"] = upper
    attrs["tir_non_negative_var"] = list(upper)
    out = mod.clone()
    out["main"] = relax.Function(main.params, relax.SeqExpr([relax.BindingBlock(bindings), *body.blocks], body.body),
                                 main.ret_ty, is_pure=False, attrs=tvm.ir.make_node("ir.DictAttrs", **attrs),
                                 span=main.span)  # impure: the assert must not be removed as dead code
    return relax.transform.Normalize()(out)


def _shape_vars_of(info) -> list[tirx.Var]:
    shape = getattr(info, "shape", None)
    values = getattr(shape, "values", None) or []
    return [d for d in values if isinstance(d, tirx.Var)]


def at_sizes(extents, values: Mapping[str, int]) -> list:
    """``extents`` (TIR expressions) with the symbolic sizes named in ``values`` bound to them, simplified."""
    analyzer = tvm.sym.Analyzer()
    for d in extents:
        for v in tirx.analysis.undefined_vars(d):
            if v.name in values:
                analyzer.bind(v, tvm.tirx.IntImm(str(v.ty.dtype), int(values[v.name])))
    return [analyzer.simplify(d) for d in extents]


def specialize(func: tirx.PrimFunc, values: Mapping[str, int]) -> tirx.PrimFunc:
    """``func`` with the symbolic sizes named in ``values`` bound to them: the kernel's instance at the
    representative size, which the templates, the default tiles and tuning work on.

    TIR's ``Specialize`` binds a size through a scalar parameter or a buffer dimension that is the size alone,
    and substitutes it everywhere else.  A dimension computed from sizes (attention heads folded into the
    batch, ``batch * 12``) cannot be matched: it is left as it is in the buffer given, and follows the sizes
    once they are bound."""
    params = {}
    for p in func.params:
        shape = _buffer_shape(p)
        if shape is None:  # a scalar size the caller passes (Relax does where no buffer holds it bare)
            if p.name in values:
                params[p] = tvm.tirx.IntImm(str(p.ty.dtype), int(values[p.name]))
            continue
        new = [tvm.tirx.IntImm(str(d.ty.dtype), int(values[d.name])) if isinstance(d, tirx.Var) and d.name in values
               else d for d in shape]
        if any(not n.same_as(d) for n, d in zip(new, shape)):
            params[p] = tvm.tirx.decl_buffer(new, str(p.dtype), p.name)
    return func.specialize(params) if params else func


def _buffer_shape(param) -> list | None:
    """A buffer parameter's shape; None for a scalar parameter."""
    try:
        return list(param.shape)
    except AttributeError:  # "shape is only available on a Var with BufferType"
        return None
