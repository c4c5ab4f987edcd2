"""Winograd convolution: a 3x3 stride-1 ``Conv`` rewritten into transforms around a batched matmul.

A direct 3x3 convolution spends 9 multiply-adds per output per input channel; the minimal filtering
algorithm F(m x m, 3 x 3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", CVPR 2016)
computes an m x m output tile from an (m+2) x (m+2) input tile with (m+2)^2 multiplies per channel pair:

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A

F(2x2,3x3) does 16 instead of 36 (2.25x fewer), F(4x4,3x3) 36 instead of 144 (4x).  Summed over input
channels, the elementwise products become one matmul per tile position: V[a*a, tiles, C] @ U[a*a, C, K].  The
filter transform ``G g G^T`` is applied to the constant weights here, once; the input and output transforms
are small constant matmuls.  What it costs instead: the transforms' memory traffic (the transformed input is
(m+2)^2/m^2 times the activation) and weights (m+2)^2/9 times larger, so it pays on convolutions with many
channels (the matmul dominates), not on thin ones (the transforms do), and not where the weights dominate
the traffic (few tiles, big C x K): which convolutions it pays on is decided by price, per layer
(:func:`graphopt.stage.winograd_alternative`), then checked end to end like every rewrite.

The transform matrices are built exactly (``fractions.Fraction``) by Toom-Cook interpolation at the points
0, 1, -1 (and 2, -2 for m = 4) and infinity; :func:`prove` shows with Z3 that they compute the convolution of
one symbolic tile exactly (a polynomial identity in the 9 filter and (m+2)^2 input variables), so the only
difference from a direct convolution is fp32 rounding (measured in ``tests/test_winograd.py``).

The rewrite is written in plain ONNX operators, in NHWC between its transforms so that every copy moves whole
channel vectors: ``Transpose`` to NHWC, ``Pad``, the overlapping tiles gathered with ``Slice``/``Reshape``/
``Concat``, ``MatMul`` by the input transform (kron(B^T, B^T), one 36 x 36 or 16 x 16 constant), the batched
``MatMul`` with the transformed weights, ``MatMul`` by the output transform, ``Reshape``/``Transpose`` back to
rows, ``Slice``, the bias, ``Transpose`` to NCHW.  Two Winograd convolutions in a row meet as
``Transpose(to NCHW) -> Relu -> Transpose(to NHWC)``, which :func:`cancel_transposes` removes.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import numpy as np

from graphopt.ir import Graph, Node, TensorInfo

TILES = (2, 4)  # the output tile sizes m of F(m x m, 3 x 3) the plain-operator rewrite offers
# Interpolation points of each tile size (the point at infinity is added): Lavin and Gray's choice; F(6x6)
# needs the fractions +-1/2, whose reciprocals in B^T (5.25, 4.25) cost it digits (kerneltune's Winograd
# kernel, which offers it, measures how many).
# A CPU's multiply-add rate over the memory bandwidth one layer's weights stream at (FLOP per byte; 2 cores
# at 250 GFLOP/s over ~15 GB/s): what weighs the transformed weights' size against the GEMMs' work
# (ConvSite.kernel_tile).
FLOPS_PER_BYTE = 16
POINTS = {2: (0, 1, -1), 4: (0, 1, -1, 2, -2), 6: (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2))}
# The plain-operator rewrite's Pad takes its pads as an input (opset 11; Slice's inputs: opset 10): an older
# graph (the opset-9 model zoo) is not given operators its opset spells otherwise.  A mark (the compiler's
# kernel) adds no operator, so it takes convolutions at any opset.
MIN_OPSET = 11
NCHW_TO_NHWC, NHWC_TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
# Elementwise unary operators a layout transpose commutes with (cancel_transposes moves them across).
UNARY = {"Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "Elu", "Selu", "HardSigmoid", "HardSwish"}


# ---- the algorithm ----------------------------------------------------------------------------------------

def _points(m: int) -> list[Fraction]:
    if m not in POINTS:
        raise ValueError(f"F({m}x{m},3x3) is not offered (tile sizes {tuple(POINTS)})")
    return [Fraction(p) for p in POINTS[m]]


def _poly_from_roots(roots: list[Fraction]) -> list[Fraction]:
    """Coefficients, lowest degree first, of prod (x - r)."""
    c = [Fraction(1)]
    for r in roots:
        nxt = [Fraction(0)] * (len(c) + 1)
        for d, v in enumerate(c):
            nxt[d + 1] += v
            nxt[d] -= r * v
        c = nxt
    return c


@lru_cache(maxsize=None)
def transform_matrices(m: int) -> tuple[tuple[tuple[Fraction, ...], ...], ...]:
    """``(A^T, G, B^T)`` of F(m x m, 3 x 3), exact: A^T is m x a, G a x 3, B^T a x a, a = m + 2.

    Toom-Cook with the finite points p_i and the point at infinity: A^T evaluates the output polynomial
    (row j: p_i^j; infinity contributes the top coefficient), G evaluates the filter at each point divided
    by the Lagrange denominator prod_{k != i}(p_i - p_k), and B^T's rows are the coefficients of
    prod_{k != i}(x - p_k) (the last row, for infinity, of prod_k (x - p_k))."""
    pts = _points(m)
    a = m + 2
    at = [[p ** j for p in pts] + [Fraction(int(j == m - 1))] for j in range(m)]
    g = []
    for i, p in enumerate(pts):
        den = Fraction(1)
        for k, q in enumerate(pts):
            if k != i:
                den *= p - q
        g.append([p ** j / den for j in range(3)])
    g.append([Fraction(0), Fraction(0), Fraction(1)])
    bt = []
    for i in range(len(pts)):
        c = _poly_from_roots([q for k, q in enumerate(pts) if k != i])
        bt.append(c + [Fraction(0)] * (a - len(c)))
    bt.append(_poly_from_roots(pts))
    return tuple(tuple(map(tuple, mat)) for mat in (at, g, bt))


def float_matrices(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.array([[float(x) for x in row] for row in mat]) for mat in transform_matrices(m))


def _tile_product(m: int, d, g, mul, add, zero):
    """A^T [(G g G^T) (.) (B^T d B)] A over any ring (Z3 terms or numbers), d a x a, g 3 x 3 nested lists."""
    at, gm, bt = transform_matrices(m)
    a = m + 2

    def matmul(x, y):
        return [[_sum([mul(x[i][k], y[k][j]) for k in range(len(y))], add, zero) for j in range(len(y[0]))]
                for i in range(len(x))]

    def t(x):
        return [list(r) for r in zip(*x)]

    u = matmul(matmul([list(r) for r in gm], g), t(gm))
    v = matmul(matmul([list(r) for r in bt], d), t(bt))
    prod = [[mul(u[i][j], v[i][j]) for j in range(a)] for i in range(a)]
    return matmul(matmul([list(r) for r in at], prod), t(at))


def _sum(terms, add, zero):
    out = zero
    for x in terms:
        out = add(out, x)
    return out


def prove(m: int) -> bool:
    """Z3: F(m x m, 3 x 3) applied to one symbolic input tile and filter equals the direct correlation for
    every real input and filter (no assignment makes any output differ: unsat)."""
    import z3

    a = m + 2
    d = [[z3.Real(f"d{i}_{j}") for j in range(a)] for i in range(a)]
    g = [[z3.Real(f"g{i}_{j}") for j in range(3)] for i in range(3)]

    def const(x):
        return z3.RealVal(f"{x.numerator}/{x.denominator}") if isinstance(x, Fraction) else x

    y = _tile_product(m, d, g, lambda x, w: const(x) * const(w), lambda x, w: const(x) + const(w), z3.RealVal(0))
    solver = z3.Solver()
    solver.add(z3.Or([y[i][j] != z3.Sum([d[i + u][j + v] * g[u][v] for u in range(3) for v in range(3)])
                      for i in range(m) for j in range(m)]))
    return solver.check() == z3.unsat


def filter_transform(weight: np.ndarray, m: int) -> np.ndarray:
    """U[a*a, C, K] = G w G^T for every (K, C) filter, in float64 then float32 (the build-time constant)."""
    _, g, _ = float_matrices(m)
    a = m + 2
    k, c = weight.shape[:2]
    u = np.einsum("ir,kcrs,js->ijck", g, weight.astype(np.float64), g)
    return u.reshape(a * a, c, k).astype(np.float32)


# ---- where it applies ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConvSite:
    """A convolution the rewrite can take: 3x3, stride 1, dilation 1, one group, constant weights, a static
    4-D input.  ``signature`` is what its price depends on (shapes, padding, bias), so equal layers are
    priced once."""

    node: str  # the conv's output tensor: unique in a graph, where node names need not be
    n: int
    c: int
    k: int
    h: int
    w: int
    pads: tuple[int, int, int, int]
    bias: bool
    weight: str = ""  # the weight initializer: what a mark for the compiler's kernel names (mark)

    @property
    def out_hw(self) -> tuple[int, int]:
        return self.h + self.pads[0] + self.pads[2] - 2, self.w + self.pads[1] + self.pads[3] - 2

    @property
    def signature(self) -> tuple:
        return (self.n, self.c, self.k, self.h, self.w, self.pads, self.bias)

    @property
    def macs(self) -> int:
        ho, wo = self.out_hw
        return self.n * self.c * self.k * 9 * ho * wo

    def tile(self) -> int:
        """The tile size m for this layer: the one that pads the output least (a 14x14 map is 7 tiles of 2
        but 4 tiles of 4 = 16x16, 31% wasted), the larger on a tie (fewer multiplies)."""
        ho, wo = self.out_hw

        def covered(m: int) -> int:
            return -(-ho // m) * m * -(-wo // m) * m

        return min(TILES, key=lambda m: (covered(m), -m))

    def kernel_tile(self) -> int:
        """The tile size for the compiler's Winograd kernel (:func:`mark`), which also offers F(6x6): the
        least ``(m+2)^2 * (2 * tiles + 4 * R)`` per input x output channel pair, the GEMMs' multiply-adds and
        the transformed weights' bytes read from memory (U is (m+2)^2 / 9 times the weights) at
        :data:`FLOPS_PER_BYTE`; F(6x6) charged 5% more for its longer transforms.  Many tiles (large maps)
        favour large tiles, few tiles with many channels favour small ones, whose U is smaller.  Measured on
        an Intel Xeon, 2 threads, cold weights: 256 -> 256 at 14x14 F(2x2) 0.87 ms, F(4x4) 1.21, direct 1.07-1.19;
        64 -> 64 at 224x224 F(6x6) 5.4, F(4x4) 7.2; at 56x56 F(4x4) 0.43, F(6x6) 0.50."""
        ho, wo = self.out_hw

        def cost(m: int) -> float:
            tiles = self.n * -(-ho // m) * -(-wo // m)
            return (m + 2) ** 2 * (2 * tiles + 4 * FLOPS_PER_BYTE) * (1.05 if m == 6 else 1.0)

        return min(sorted(POINTS, reverse=True), key=cost)


def conv_sites(graph: Graph, operators: bool = True) -> list[ConvSite]:
    """Every convolution of ``graph`` Winograd can take (see :class:`ConvSite`); for the plain-operator rewrite
    (``operators``), none below :data:`MIN_OPSET`."""
    if operators and graph.onnx_opset < MIN_OPSET:
        return []
    sites = []
    for n in graph.nodes:
        if n.op_type != "Conv" or n.domain not in ("", "ai.onnx") or len(n.inputs) < 2:
            continue
        w = n.inputs[1]
        shape = graph.shape(n.inputs[0])
        if not graph.is_constant(w) or shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape):
            continue
        weight = graph.initializers[w]
        pad_mode = n.attr("auto_pad", "NOTSET")
        pad_mode = pad_mode.decode() if isinstance(pad_mode, bytes) else pad_mode
        if (weight.ndim != 4 or weight.shape[2:] != (3, 3) or list(n.attr("strides", [1, 1])) != [1, 1]
                or list(n.attr("dilations", [1, 1])) != [1, 1] or n.attr("group", 1) != 1
                or pad_mode not in ("NOTSET", "") or weight.dtype != np.float32):
            continue
        bias = len(n.inputs) > 2 and bool(n.inputs[2])
        if bias and (not graph.is_constant(n.inputs[2]) or graph.initializers[n.inputs[2]].ndim != 1):
            continue
        pads = tuple(int(p) for p in n.attr("pads", [0, 0, 0, 0]))
        site = ConvSite(node=n.outputs[0], n=shape[0], c=shape[1], k=int(weight.shape[0]), h=shape[2], w=shape[3],
                        pads=pads, bias=bias, weight=w)
        if min(site.out_hw) >= 1:
            sites.append(site)
    return sites


def neighbours(graph: Graph, sites: list[ConvSite]) -> dict[str, tuple[bool, bool]]:
    """Per site: whether its input comes from another of ``sites`` and whether its output feeds one, through
    unary elementwise operators only, each read once: where both are rewritten, the layout transposes
    between them cancel (:func:`cancel_transposes`)."""
    names = {s.node for s in sites}
    producers, consumers = graph.producers(), graph.consumers()
    outputs = set(graph.output_names)

    def reaches(t: str, step) -> bool:
        """Whether walking from tensor ``t`` by ``step`` (t -> (node, the tensor after it) or None) through
        singly-read unary operators meets another site's conv."""
        while len(consumers.get(t, [])) == 1 and t not in outputs:
            hop = step(t)
            if hop is None:
                return False
            node, t = hop
            if node.outputs and node.outputs[0] in names:
                return True
            if node.op_type not in UNARY:
                return False
        return False

    def up(t: str):
        return (producers[t][0], producers[t][0].inputs[0]) if t in producers else None

    def down(t: str):
        c = consumers[t][0]
        return c, c.outputs[0] if c.outputs else ""

    return {s.node: (reaches(producers[s.node][0].inputs[0], up), reaches(s.node, down)) for s in sites}


def layer_graph(graph: Graph, site: ConvSite, nhwc: tuple[bool, bool] = (False, False)) -> Graph:
    """The convolution of ``site`` alone, as a model (its input a graph input, its weights ``graph``'s): what
    a layer's direct and Winograd forms are priced as.  ``nhwc``: the model's input, output is NHWC,
    transposed to the conv's NCHW, which is how a Winograd layer meets a Winograd neighbour once
    :func:`rewrite` has cancelled the transposes between them (its price is then not that of a layout copy
    such a pair does not make); a layer between direct convs pays both copies."""
    node = next(n for n in graph.nodes if n.outputs and n.outputs[0] == site.node)
    ho, wo = site.out_hw
    x_shape, y_shape = (site.n, site.c, site.h, site.w), (site.n, site.k, ho, wo)
    conv = Node(node.op_type, list(node.inputs), list(node.outputs), dict(node.attrs), node.name, node.domain,
                dict(node.attr_types))
    nodes, value_info = [conv], {}
    x, y = node.inputs[0], node.outputs[0]
    if nhwc[0]:
        x = f"{x}_nhwc"
        nodes.insert(0, Node("Transpose", [x], [conv.inputs[0]], {"perm": NHWC_TO_NCHW}, f"{x}_transpose"))
        value_info[conv.inputs[0]] = TensorInfo(conv.inputs[0], "float32", x_shape)
        x_shape = tuple(x_shape[i] for i in NCHW_TO_NHWC)
    if nhwc[1]:
        y = f"{y}_nhwc"
        nodes.append(Node("Transpose", [conv.outputs[0]], [y], {"perm": NCHW_TO_NHWC}, f"{y}_transpose"))
        value_info[conv.outputs[0]] = TensorInfo(conv.outputs[0], "float32", y_shape)
        y_shape = tuple(y_shape[i] for i in NCHW_TO_NHWC)
    weights = {t: graph.initializers[t] for t in node.inputs[1:] if t}
    return Graph(nodes, [TensorInfo(x, "float32", x_shape)], [TensorInfo(y, "float32", y_shape)], weights,
                 value_info, name=f"{node.name}_layer", opset_imports=dict(graph.opset_imports),
                 ir_version=graph.ir_version)


# ---- the rewrite --------------------------------------------------------------------------------------------

def _rewrite_one(graph: Graph, node: Node, site: ConvSite, m: int) -> list[Node]:
    """The nodes replacing ``node`` (weights and value_info added to ``graph``)."""
    at, _, bt = float_matrices(m)
    a = m + 2
    n, c, k, h, w = site.n, site.c, site.k, site.h, site.w
    ho, wo = site.out_hw
    th, tw = -(-ho // m), -(-wo // m)
    p = n * th * tw
    hp, wp = m * (th + 1), m * (tw + 1)  # one tile row/column more, so the overlap is two slices of whole tiles
    base = graph.fresh_name(f"{node.name or 'conv'}_wino{m}")
    nodes: list[Node] = []
    count = [0]

    def tensor(shape, dtype="float32") -> str:
        count[0] += 1
        name = f"{base}_{count[0]}"
        graph.value_info[name] = TensorInfo(name, dtype, tuple(shape))
        return name

    def const(values, dtype) -> str:
        count[0] += 1
        name = f"{base}_c{count[0]}"
        graph.initializers[name] = np.asarray(values, dtype=dtype)
        return name

    def op(op_type: str, inputs: list[str], shape, out: str | None = None, **attrs) -> str:
        out = out or tensor(shape)
        nodes.append(Node(op_type, inputs, [out], attrs, name=f"{out}_{op_type.lower()}"))
        return out

    def slice_(x: str, start: int, end: int, axis: int, shape) -> str:
        return op("Slice", [x, const([start], np.int64), const([end], np.int64), const([axis], np.int64)], shape)

    def reshape(x: str, shape) -> str:
        return op("Reshape", [x, const(list(shape), np.int64)], shape)

    x = op("Transpose", [node.inputs[0]], (n, h, w, c), perm=NCHW_TO_NHWC)
    pads = site.pads
    x = op("Pad", [x, const([0, pads[0], pads[1], 0, 0, hp - h - pads[0], wp - w - pads[1], 0], np.int64)],
           (n, hp, wp, c))
    # rows of every tile: tile rows 0..m-1 are the padded rows cut into whole tiles; rows m, m+1 are the
    # first two rows of the next tile
    r0 = reshape(slice_(x, 0, m * th, 1, (n, m * th, wp, c)), (n, th, m, wp, c))
    r1 = reshape(slice_(x, m, m * th + m, 1, (n, m * th, wp, c)), (n, th, m, wp, c))
    rows = op("Concat", [r0, slice_(r1, 0, 2, 2, (n, th, 2, wp, c))], (n, th, a, wp, c), axis=2)
    c0 = reshape(slice_(rows, 0, m * tw, 3, (n, th, a, m * tw, c)), (n, th, a, tw, m, c))
    c1 = reshape(slice_(rows, m, m * tw + m, 3, (n, th, a, m * tw, c)), (n, th, a, tw, m, c))
    tiles = op("Concat", [c0, slice_(c1, 0, 2, 4, (n, th, a, tw, 2, c))], (n, th, a, tw, a, c), axis=4)
    d = reshape(op("Transpose", [tiles], (a, a, n, th, tw, c), perm=[2, 4, 0, 1, 3, 5]), (a * a, p * c))
    v = op("MatMul", [const(np.kron(bt, bt), np.float32), d], (a * a, p * c))
    u = const(filter_transform(graph.initializers[node.inputs[1]], m), np.float32)
    prod = op("MatMul", [reshape(v, (a * a, p, c)), u], (a * a, p, k))
    y = op("MatMul", [const(np.kron(at, at), np.float32), reshape(prod, (a * a, p * k))], (m * m, p * k))
    y = op("Transpose", [reshape(y, (m, m, n, th, tw, k))], (n, th, m, tw, m, k), perm=[2, 3, 0, 4, 1, 5])
    y = reshape(y, (n, m * th, m * tw, k))
    if (m * th, m * tw) != (ho, wo):
        y = op("Slice", [y, const([0, 0], np.int64), const([ho, wo], np.int64), const([1, 2], np.int64)],
               (n, ho, wo, k))
    if site.bias:
        y = op("Add", [y, node.inputs[2]], (n, ho, wo, k))
    op("Transpose", [y], None, out=node.outputs[0], perm=NHWC_TO_NCHW)
    return nodes


def rewrite(graph: Graph, tiles: dict[str, int]) -> Graph:
    """A copy of ``graph`` with each convolution in ``tiles`` (by :attr:`ConvSite.node`) computed by
    F(m x m, 3 x 3), m its value, the layout transposes between them cancelled and what no longer has a
    reader dropped."""
    out = graph.copy()
    sites = {s.node: s for s in conv_sites(out)}
    nodes: list[Node] = []
    for node in out.nodes:
        key = node.outputs[0] if node.outputs else None
        site = sites.get(key) if key in tiles else None
        nodes.extend([node] if site is None else _rewrite_one(out, node, site, tiles[key]))
    out.nodes = nodes
    cancel_transposes(out)
    out.remove_unused()
    return out


def mark(graph: Graph, tiles: dict[str, int]) -> Graph:
    """A copy of ``graph`` whose convolutions in ``tiles`` (by :attr:`ConvSite.node`) the compiler computes
    with its Winograd kernel, F(m x m, 3 x 3) with m their value (:attr:`Graph.winograd`, by weight): the
    graph's operators are unchanged, so the model still computes the same function, and the compiler's
    kernel reads and writes the blocked layout of the direct conv, no transposes around it."""
    out = graph.copy()
    for site in conv_sites(out, operators=False):
        if site.node in tiles:
            out.winograd[site.weight] = tiles[site.node]
    return out


def cancel_transposes(graph: Graph) -> int:
    """``Transpose(NHWC->NCHW) -> unary* -> Transpose(NCHW->NHWC)`` becomes ``unary*`` on the NHWC tensor, when
    nothing else reads the tensors in between; returns the number of pairs removed."""
    removed = 0
    while True:
        producers = graph.producers()
        consumers = graph.consumers()
        outputs = set(graph.output_names)
        pair = None
        for last in graph.nodes:
            if last.op_type != "Transpose" or list(last.attr("perm", [])) != NCHW_TO_NHWC:
                continue
            chain, t = [], last.inputs[0]
            while t in producers and producers[t][0].op_type in UNARY and len(consumers.get(t, [])) == 1:
                chain.append(producers[t][0])
                t = producers[t][0].inputs[0]
            first = producers.get(t, (None, 0))[0]
            if (first is None or first.op_type != "Transpose" or list(first.attr("perm", [])) != NHWC_TO_NCHW
                    or len(consumers.get(t, [])) != 1 or t in outputs or last.outputs[0] in outputs
                    or any(c.outputs[0] in outputs for c in chain)):
                continue
            pair = (first, chain, last)
            break
        if pair is None:
            return removed
        first, chain, last = pair
        src = first.inputs[0]
        src_shape = graph.shape(src)
        for node in reversed(chain):  # innermost first: each now reads and writes the NHWC layout
            node.inputs[0] = src
            graph.value_info[node.outputs[0]] = TensorInfo(node.outputs[0], graph.tensor(node.outputs[0]).dtype,
                                                           src_shape)
            src = node.outputs[0]
        for node in graph.nodes:
            node.inputs = [src if i == last.outputs[0] else i for i in node.inputs]
        graph.nodes = [x for x in graph.nodes if x is not first and x is not last]
        removed += 1
