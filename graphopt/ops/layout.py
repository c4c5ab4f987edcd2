"""Data-movement operators: ``concat[axis]`` (2 inputs in rules, any number when imported), ``split[axis,
sizes]`` (TASO's split undoes the latest concat; in rules ``sizes`` are symbolic references to pattern-input
dims such as ``"x1.0"`` that :func:`graphopt.ops.bind_params` resolves, in graphs they are ints),
``transpose[perm]`` and ``reshape[shape]`` (constant target shape; understood so transformer graphs are not
opaque, not used by generated rules)."""
from __future__ import annotations

import numpy as np

from graphopt.ops.base import OpSpec, check
from graphopt.ops.onnx_util import const, node, static_shape


def _concat_shape(params, shapes):
    a = params["axis"]
    check(len(shapes) >= 2, "concat needs >= 2 inputs")
    r = len(shapes[0])
    check(0 <= a < r, f"concat axis {a} out of range for rank {r}")
    for s in shapes[1:]:
        check(len(s) == r and all(s[i] == shapes[0][i] for i in range(r) if i != a),
              f"concat inputs differ off-axis: {shapes}")
    out = list(shapes[0])
    out[a] = sum(s[a] for s in shapes)
    return [tuple(out)]


def _concat_parse(n, graph):
    shapes = [static_shape(graph, i) for i in n.inputs]
    if len(shapes) < 2 or any(s is None for s in shapes) or len(n.outputs) != 1:
        return None
    axis = int(n.attr("axis"))
    axis = axis + len(shapes[0]) if axis < 0 else axis
    try:
        _concat_shape({"axis": axis}, shapes)
    except ValueError:
        return None
    return {"axis": axis}


def _split_shape(params, shapes):
    (x,) = shapes
    a, sizes = params["axis"], params["sizes"]
    check(0 <= a < len(x), "split axis out of range")
    check(all(isinstance(s, int) and s >= 1 for s in sizes), f"split sizes unresolved or invalid: {sizes}")
    check(sum(sizes) == x[a], f"split sizes {sizes} do not add up to {x[a]}")
    outs = []
    for s in sizes:
        o = list(x)
        o[a] = s
        outs.append(tuple(o))
    return outs


def _split_ref(params, ins, ar):
    cuts = np.cumsum(params["sizes"])[:-1]
    return [p.copy() for p in np.split(ins[0], cuts, axis=params["axis"])]


def _split_emit(params, inputs, outputs, graph):
    sizes = np.array(params["sizes"], dtype=np.int64)
    if graph.opset_imports.get("", 17) >= 13:
        return [node(graph, "Split", [inputs[0], const(graph, outputs[0] + "_sizes", sizes)], outputs,
                     axis=params["axis"])]
    return [node(graph, "Split", inputs, outputs, axis=params["axis"], split=[int(s) for s in sizes])]


def _split_parse(n, graph):
    xs = static_shape(graph, n.inputs[0])
    outs = n.outputs
    if xs is None or len(outs) < 2 or not all(outs):
        return None
    axis = int(n.attr("axis", 0))
    axis = axis + len(xs) if axis < 0 else axis
    if len(n.inputs) > 1 and n.inputs[1]:
        if not graph.is_constant(n.inputs[1]):
            return None
        sizes = tuple(int(s) for s in graph.initializers[n.inputs[1]])
    elif n.attr("split") is not None:
        sizes = tuple(int(s) for s in n.attr("split"))
    else:
        if xs[axis] % len(outs):
            return None
        sizes = (xs[axis] // len(outs),) * len(outs)
    params = {"axis": axis, "sizes": sizes}
    try:
        _split_shape(params, [xs])
    except ValueError:
        return None
    return params if len(sizes) == len(outs) else None


def _transpose_shape(params, shapes):
    (x,) = shapes
    perm = tuple(params["perm"])
    check(sorted(perm) == list(range(len(x))), f"perm {perm} does not fit rank {len(x)}")
    return [tuple(x[p] for p in perm)]


def _transpose_parse(n, graph):
    xs = static_shape(graph, n.inputs[0])
    if xs is None:
        return None
    perm = n.attr("perm")
    perm = tuple(int(p) for p in perm) if perm is not None else tuple(reversed(range(len(xs))))
    return {"perm": perm} if sorted(perm) == list(range(len(xs))) else None


def _reshape_shape(params, shapes):
    (x,) = shapes
    out = tuple(params["shape"])
    check(all(isinstance(d, int) and d >= 1 for d in out) and int(np.prod(out)) == int(np.prod(x)),
          f"cannot reshape {x} to {out}")
    return [out]


def _reshape_emit(params, inputs, outputs, graph):
    shape = const(graph, outputs[0] + "_shape", np.array(params["shape"], dtype=np.int64))
    return [node(graph, "Reshape", [inputs[0], shape], outputs)]


def _reshape_parse(n, graph):
    xs, ys = static_shape(graph, n.inputs[0]), static_shape(graph, n.outputs[0])
    if xs is None or ys is None or len(n.inputs) != 2 or not graph.is_constant(n.inputs[1]):
        return None
    try:
        _reshape_shape({"shape": ys}, [xs])
    except ValueError:
        return None
    return {"shape": ys}


CONCAT = OpSpec(name="concat", n_inputs=2, n_outputs=1, shape=_concat_shape,
                ref=lambda p, i, ar: [np.concatenate(i, axis=p["axis"])], z3_params=("axis",),
                emit=lambda p, i, o, g: [node(g, "Concat", i, o, axis=p["axis"])], onnx_types=("Concat",),
                parse=_concat_parse, variadic=True)
SPLIT = OpSpec(name="split", n_inputs=1, n_outputs=2, shape=_split_shape, ref=_split_ref, z3_params=("axis",),
               emit=_split_emit, onnx_types=("Split",), parse=_split_parse, variadic=True)
TRANSPOSE = OpSpec(name="transpose", n_inputs=1, n_outputs=1, shape=_transpose_shape,
                   ref=lambda p, i, ar: [np.transpose(i[0], p["perm"]).copy()], z3_params=("perm",),
                   emit=lambda p, i, o, g: [node(g, "Transpose", i, o, perm=list(p["perm"]))],
                   onnx_types=("Transpose",), parse=_transpose_parse)
RESHAPE = OpSpec(name="reshape", n_inputs=1, n_outputs=1, shape=_reshape_shape,
                 ref=lambda p, i, ar: [i[0].reshape(p["shape"])], z3_params=("shape",), emit=_reshape_emit,
                 onnx_types=("Reshape",), parse=_reshape_parse)
SPECS = [CONCAT, SPLIT, TRANSPOSE, RESHAPE]
