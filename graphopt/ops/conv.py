"""2-D convolution and the tensors that make convolutions composable.

``conv2d`` params: ``stride`` (sh, sw), ``pad`` "SAME" (symmetric k//2, odd kernels, as in TASO so that
enlarging a kernel keeps its centre) or "VALID", ``act`` "none" or "relu" (fused activation; exported as
Conv + Relu), ``groups``.  ``enlarge(w, ref)`` zero-pads kernel ``w`` (centred) to the spatial size of kernel
``ref`` (TASO's enlarge: only applied to rule inputs), ``Iconv(w)`` is the identity kernel shaped like the
square kernel ``w`` and ``Cpool[kernel](x)`` the dense averaging kernel that turns an average pool of image
``x`` into a convolution.  Constants are exported as weights, enlarge as ``Pad``.
"""
from __future__ import annotations

import numpy as np

from graphopt.ops.base import OpSpec, check
from graphopt.ops.onnx_util import const, dtype_of, intermediate, node, static_shape

from graphopt.ops.base import ACT_CODES as ACTS


def same_pads(pad: str, kh: int, kw: int) -> tuple[int, int]:
    if pad == "VALID":
        return 0, 0
    check(pad == "SAME", f"unknown padding {pad!r}")
    check(kh % 2 == 1 and kw % 2 == 1, "SAME padding needs odd kernel sizes")
    return kh // 2, kw // 2


def window_out(h: int, k: int, p: int, s: int) -> int:
    o = (h + 2 * p - k) // s + 1
    check(o >= 1 and h + 2 * p >= k, "window larger than padded input")
    return o


def _conv_shape(params, shapes):
    x, w = shapes
    check(len(x) == 4 and len(w) == 4, "conv2d needs 4-D input and kernel")
    g = params.get("groups", 1)
    check(g >= 1 and x[1] == w[1] * g and w[0] % g == 0, f"conv2d channels do not match: {x} * {w} groups={g}")
    check(params.get("act", "none") in ACTS, "unknown activation")
    sh, sw = params["stride"]
    ph, pw = same_pads(params["pad"], w[2], w[3])
    return [(x[0], w[0], window_out(x[2], w[2], ph, sh), window_out(x[3], w[3], pw, sw))]


def pad_hw(x: np.ndarray, ph: int, pw: int, value=0) -> np.ndarray:
    if ph == 0 and pw == 0:
        return x
    out = np.empty(x.shape[:2] + (x.shape[2] + 2 * ph, x.shape[3] + 2 * pw), dtype=x.dtype)
    out[...] = value
    out[:, :, ph:ph + x.shape[2], pw:pw + x.shape[3]] = x
    return out


def windows(xp: np.ndarray, kh: int, kw: int, sh: int, sw: int) -> tuple[np.ndarray, int, int]:
    """[N, C, kh*kw, Ho, Wo] view of all sliding windows of a padded image."""
    ho = (xp.shape[2] - kh) // sh + 1
    wo = (xp.shape[3] - kw) // sw + 1
    cols = np.stack([xp[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]
                     for i in range(kh) for j in range(kw)], axis=2)
    return cols, ho, wo


def _conv_ref(params, ins, ar):
    x, w = ins
    g = params.get("groups", 1)
    o, cg, kh, kw = w.shape
    ph, pw = same_pads(params["pad"], kh, kw)
    zero = ar.full((), 0)[()]
    cols, ho, wo = windows(pad_hw(x, ph, pw, zero), kh, kw, *params["stride"])
    n = x.shape[0]
    cols = cols.reshape(n, g, cg * kh * kw, ho * wo)
    out = np.matmul(w.reshape(g, o // g, cg * kh * kw)[None], cols).reshape(n, o, ho, wo)
    return [ar.relu(out) if params.get("act", "none") == "relu" else out]


def _conv_emit(params, inputs, outputs, graph):
    x, w = inputs
    ws = static_shape(graph, w)
    ph, pw = same_pads(params["pad"], ws[2], ws[3])
    attrs = dict(kernel_shape=[ws[2], ws[3]], strides=list(params["stride"]), pads=[ph, pw, ph, pw],
                 group=params.get("groups", 1), dilations=[1, 1])
    if params.get("act", "none") == "none":
        return [node(graph, "Conv", [x, w], outputs, **attrs)]
    xs = static_shape(graph, x)
    shape = _conv_shape(params, [xs, ws])[0] if xs and ws else None
    mid = intermediate(graph, outputs[0] + "_preact", x, shape)
    return [node(graph, "Conv", [x, w], [mid], **attrs), node(graph, "Relu", [mid], outputs)]


def _conv_parse(n, graph):
    if len(n.inputs) != 2 or len(n.outputs) != 1:
        return None
    xs, ws = static_shape(graph, n.inputs[0]), static_shape(graph, n.inputs[1])
    if xs is None or ws is None or len(xs) != 4 or len(ws) != 4:
        return None
    if any(d != 1 for d in n.attr("dilations", [1, 1])):
        return None
    kh, kw = ws[2], ws[3]
    stride = tuple(int(s) for s in n.attr("strides", [1, 1]))
    auto = n.attr("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    pads = list(n.attr("pads", [0, 0, 0, 0]))
    odd = kh % 2 == 1 and kw % 2 == 1
    if auto == "VALID" or (auto == "NOTSET" and not any(pads)):
        pad = "VALID"
    elif auto == "NOTSET" and odd and pads == [kh // 2, kw // 2, kh // 2, kw // 2]:
        pad = "SAME"
    elif auto in ("SAME_UPPER", "SAME_LOWER") and odd and stride == (1, 1):
        pad = "SAME"
    else:
        return None
    params = {"stride": stride, "pad": pad, "act": "none", "groups": int(n.attr("group", 1))}
    try:
        _conv_shape(params, [xs, ws])
    except ValueError:
        return None
    return params


def _enlarge_shape(params, shapes):
    w, ref = shapes
    check(len(w) == 4 and len(ref) == 4, "enlarge needs two kernels")
    dh, dw = ref[2] - w[2], ref[3] - w[3]
    check(dh >= 0 and dw >= 0 and dh % 2 == 0 and dw % 2 == 0, f"cannot centre kernel {w} in {ref}")
    return [(w[0], w[1], ref[2], ref[3])]


def _enlarge_ref(params, ins, ar):
    w, ref = ins
    dh, dw = (ref.shape[2] - w.shape[2]) // 2, (ref.shape[3] - w.shape[3]) // 2
    return [pad_hw(w, dh, dw, ar.full((), 0)[()]) if (dh or dw) else w.copy()]


def _enlarge_emit(params, inputs, outputs, graph):
    w, ref = static_shape(graph, inputs[0]), static_shape(graph, inputs[1])
    dh, dw = (ref[2] - w[2]) // 2, (ref[3] - w[3]) // 2
    pads = const(graph, outputs[0] + "_pads", np.array([0, 0, dh, dw, 0, 0, dh, dw], dtype=np.int64))
    return [node(graph, "Pad", [inputs[0], pads], outputs, mode="constant")]


def _iconv_shape(params, shapes):
    (w,) = shapes
    check(len(w) == 4 and w[0] == w[1] and w[2] % 2 == 1 and w[3] % 2 == 1,
          "Iconv needs a square kernel reference with odd sizes")
    return [tuple(w)]


def _iconv_value(shape, ar):
    c, _, kh, kw = shape
    out = ar.full(shape, 0)
    for i in range(c):
        out[i, i, kh // 2, kw // 2] = ar.full((), 1)[()]
    return out


def _iconv_emit(params, inputs, outputs, graph):
    graph.initializers[outputs[0]] = _iconv_value(static_shape(graph, inputs[0]), _NP_FLOAT).astype(
        dtype_of(graph, inputs[0]))
    return []


def _cpool_shape(params, shapes):
    (x,) = shapes
    check(len(x) == 4, "Cpool needs an image reference")
    kh, kw = params["kernel"]
    return [(x[1], x[1], kh, kw)]


def _cpool_ref(params, ins, ar):
    c = ins[0].shape[1]
    kh, kw = params["kernel"]
    out = ar.full((c, c, kh, kw), 0)
    one = ar.scale(ar.full((kh, kw), 1), 1, kh * kw)
    for i in range(c):
        out[i, i] = one
    return [out]


def _cpool_emit(params, inputs, outputs, graph):
    c = static_shape(graph, inputs[0])[1]
    kh, kw = params["kernel"]
    val = np.zeros((c, c, kh, kw), dtype=dtype_of(graph, inputs[0]))
    for i in range(c):
        val[i, i] = 1.0 / (kh * kw)
    graph.initializers[outputs[0]] = val
    return []


class _NpFloat:
    """Minimal arithmetic for materialising constants at export time."""

    @staticmethod
    def full(shape, value):
        return np.full(shape, value, dtype=np.float64)


_NP_FLOAT = _NpFloat()

CONV2D = OpSpec(name="conv2d", n_inputs=2, n_outputs=1, shape=_conv_shape, ref=_conv_ref,
                z3_params=("stride", "pad", "act", "groups"), emit=_conv_emit, onnx_types=("Conv",), parse=_conv_parse,
                doc="conv2d[stride,pad,act,groups](x, w)", fusion="anchor")
ENLARGE = OpSpec("enlarge", 2, 1, _enlarge_shape, _enlarge_ref, (), _enlarge_emit, shape_inputs=(1,),
                 doc="zero-pad kernel w (centred) to the size of kernel ref")
ICONV = OpSpec("Iconv", 1, 1, _iconv_shape, lambda p, i, ar: [_iconv_value(i[0].shape, ar)], (),
               _iconv_emit, shape_inputs=(0,), doc="identity kernel shaped like w")
CPOOL = OpSpec("Cpool", 1, 1, _cpool_shape, _cpool_ref, ("kernel",),
               _cpool_emit, shape_inputs=(0,), doc="averaging kernel [C,C,kh,kw] for image x")
SPECS = [CONV2D, ENLARGE, ICONV, CPOOL]
