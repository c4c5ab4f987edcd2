"""2-D pooling: ``pool2d_max`` and ``pool2d_avg`` with params ``kernel``, ``stride``, ``pad`` (SAME/VALID as
for conv2d).  Average pooling counts padding (ONNX ``count_include_pad=1``), which is what makes it equal
to a convolution with ``Cpool``; the integer reference sums instead of averaging."""
from __future__ import annotations

import numpy as np

from graphopt.ops.base import OpSpec, check
from graphopt.ops.conv import pad_hw, same_pads, window_out, windows
from graphopt.ops.onnx_util import node, static_shape


def _pool_shape(params, shapes):
    (x,) = shapes
    check(len(x) == 4, "pool2d needs a 4-D input")
    kh, kw = params["kernel"]
    sh, sw = params["stride"]
    ph, pw = same_pads(params["pad"], kh, kw)
    return [(x[0], x[1], window_out(x[2], kh, ph, sh), window_out(x[3], kw, pw, sw))]


def _avg_ref(params, ins, ar):
    (x,) = ins
    kh, kw = params["kernel"]
    ph, pw = same_pads(params["pad"], kh, kw)
    cols, _, _ = windows(pad_hw(x, ph, pw, ar.full((), 0)[()]), kh, kw, *params["stride"])
    return [ar.scale(cols.sum(axis=2), 1, kh * kw)]


def _max_ref(params, ins, ar):
    (x,) = ins
    kh, kw = params["kernel"]
    ph, pw = same_pads(params["pad"], kh, kw)
    if ar.kind != "sym":
        low = np.iinfo(np.int64).min if ar.kind == "int" else -np.inf
        cols, _, _ = windows(pad_hw(x, ph, pw, low), kh, kw, *params["stride"])
        return [cols.max(axis=2)]
    # symbolic: padding never wins a max, so take the max over the in-bounds window elements only
    shape = _pool_shape(params, [x.shape])[0]
    sh, sw = params["stride"]
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        n, c, i, j = idx
        vals = [x[n, c, i * sh + a - ph, j * sw + b - pw] for a in range(kh) for b in range(kw)
                if 0 <= i * sh + a - ph < x.shape[2] and 0 <= j * sw + b - pw < x.shape[3]]
        m = vals[0]
        for v in vals[1:]:
            m = ar.maximum(np.array(m, dtype=object), np.array(v, dtype=object))[()]
        out[idx] = m
    return [out]


def _emit(op_type):
    def emit(params, inputs, outputs, graph):
        kh, kw = params["kernel"]
        ph, pw = same_pads(params["pad"], kh, kw)
        attrs = dict(kernel_shape=[kh, kw], strides=list(params["stride"]), pads=[ph, pw, ph, pw])
        if op_type == "AveragePool":
            attrs["count_include_pad"] = 1
        return [node(graph, op_type, inputs, outputs, **attrs)]
    return emit


def _parse(n, graph):
    if len(n.inputs) != 1 or len([o for o in n.outputs if o]) != 1:
        return None
    xs = static_shape(graph, n.inputs[0])
    if xs is None or len(xs) != 4 or n.attr("ceil_mode", 0) or any(d != 1 for d in n.attr("dilations", [1, 1])):
        return None
    if n.attr("storage_order", 0):
        return None
    kh, kw = (int(k) for k in n.attr("kernel_shape"))
    stride = tuple(int(s) for s in n.attr("strides", [1, 1]))
    auto = n.attr("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    pads = list(n.attr("pads", [0, 0, 0, 0]))
    if auto == "VALID" or (auto == "NOTSET" and not any(pads)):
        pad = "VALID"
    elif auto == "NOTSET" and kh % 2 and kw % 2 and pads == [kh // 2, kw // 2, kh // 2, kw // 2]:
        pad = "SAME"
    else:
        return None
    if n.op_type == "AveragePool" and pad == "SAME" and not n.attr("count_include_pad", 0):
        return None
    params = {"kernel": (kh, kw), "stride": stride, "pad": pad}
    try:
        _pool_shape(params, [xs])
    except ValueError:
        return None
    return params


POOL_MAX = OpSpec(name="pool2d_max", n_inputs=1, n_outputs=1, shape=_pool_shape, ref=_max_ref,
                  z3_params=("kernel", "stride", "pad"), emit=_emit("MaxPool"), onnx_types=("MaxPool",), parse=_parse)
POOL_AVG = OpSpec(name="pool2d_avg", n_inputs=1, n_outputs=1, shape=_pool_shape, ref=_avg_ref,
                  z3_params=("kernel", "stride", "pad"), emit=_emit("AveragePool"), onnx_types=("AveragePool",),
                  parse=_parse)
SPECS = [POOL_MAX, POOL_AVG]
