"""The NASRNN cell of TASO's benchmark (``examples/nasrnn.py``), unrolled over a few timesteps.

Each step computes 8 gates ``x_t @ W_i + h @ U_i`` - sixteen small MatMuls, eight of them sharing ``x_t``
and eight sharing ``h`` - and combines them with the cell's Add/Mul/Tanh/Sigmoid/Relu tree.  This is the
graph where merging MatMuls that share an input (concat the weights, one big MatMul, split) pays off.
Two deliberate differences from TASO's script, both to match a real unrolled RNN export: the weights are
shared by all timesteps (TASO draws fresh ones per step), and the initial state is a graph input.
"""
from __future__ import annotations

import onnx

from models.builder import GraphBuilder

HIDDEN = 512
STEPS = 5


def _cell(b: GraphBuilder, h: str, x: str, t: int, weights: list[tuple[str, str]], out: str | None) -> str:
    p = f"cell{t}"
    gates = []
    for i, (wx, wh) in enumerate(weights):
        a = b.op("MatMul", [x, wx], f"{p}/gate{i}/MatMul")
        c = b.op("MatMul", [h, wh], f"{p}/gate{i}/MatMul_1")
        gates.append(b.op("Add", [a, c], f"{p}/gate{i}/Add"))

    def u(op: str, v: str) -> str:
        return b.op(op, [v], f"{p}/{op}")

    def bi(op: str, l: str, r: str) -> str:
        return b.op(op, [l, r], f"{p}/{op}")

    m0 = bi("Add", u("Relu", gates[0]), u("Sigmoid", gates[3]))
    m1 = bi("Add", u("Sigmoid", gates[1]), u("Tanh", gates[2]))
    m2 = bi("Mul", u("Sigmoid", gates[4]), u("Tanh", gates[5]))
    m3 = bi("Mul", u("Sigmoid", gates[6]), u("Relu", gates[7]))
    m4 = bi("Add", u("Sigmoid", m1), u("Tanh", m2))
    m5 = bi("Mul", u("Tanh", m0), u("Tanh", m3))
    m6 = bi("Mul", u("Tanh", m4), u("Tanh", m5))
    return b.op("Tanh", [m6], f"{p}/Tanh_out", out=out)


def build_nasrnn(seed: int = 0, hidden: int = HIDDEN, steps: int = STEPS, batch: int = 1,
                 name: str = "nasrnn") -> onnx.ModelProto:
    b = GraphBuilder(name, seed, opset=17)
    xs = [b.input(f"x{t}", (batch, hidden)) for t in range(steps)]
    h = b.input("h0", (batch, hidden))
    weights = [(b.normal(f"cell.gate{i}.w_x", (hidden, hidden), hidden ** -0.5),
                b.normal(f"cell.gate{i}.w_h", (hidden, hidden), hidden ** -0.5)) for i in range(8)]
    for t, x in enumerate(xs):
        h = _cell(b, h, x, t, weights, out="h_out" if t == steps - 1 else None)
    b.output("h_out", (batch, hidden))
    return b.model(f"NASRNN cell, hidden {hidden}, unrolled {steps} steps")
