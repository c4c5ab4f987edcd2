"""LSTM, GRU and RNN unrolled over their static time axis into MatMul, Add, Mul, activations, Slice, Concat.

Semantics are onnxruntime's (its CPU kernels, ``onnxruntime/core/providers/cpu/rnn``), which is what every
output of the pipeline is checked against, for every attribute of the ONNX operators
(https://onnx.ai/onnx/operators/onnx__LSTM.html, ``__GRU``, ``__RNN``; opsets 7-22):

* ``direction`` forward / reverse / bidirectional; ``layout`` 0 (time major) or 1 (batch major), handled by
  transposing X, the initial states and the outputs once, so the cell code is time major only;
* ``sequence_lens``: entry b runs ``lens[b]`` steps; Y is zero past that, Y_h / Y_c hold the state of the
  last valid step (the state is frozen by a select; zero for an entry of length 0, as ORT writes it), and
  the reverse direction starts at each entry's own last valid step (the valid prefixes are reversed by one
  Gather, :mod:`graphopt.legalize.sequence`).
  Lengths that are weights make the masks constants: steps every entry runs need no select, steps no entry
  runs are not computed, and lengths all equal to the sequence length disappear;
* ``initial_h`` / ``initial_c`` (absent: zero, so the first step skips the recurrent MatMul), ``clip``
  (applied to every activation's input), ``activations`` with ``activation_alpha`` / ``activation_beta``
  consumed in order by the functions that take them (the alpha list by those taking alpha, the beta list by
  those taking beta; ORT's defaults when a list runs out: LeakyRelu 0.01, HardSigmoid 0.2/0.5, Elu 1.0,
  anything else 0 - note ThresholdedRelu's 0 differs from the operator's own default of 1.0);
* GRU ``linear_before_reset``; LSTM peepholes ``P`` and ``input_forget`` (f = 1 - i); outputs Y, Y_h,
  Y_c in any subset.

The input projection is hoisted: one MatMul of all steps' inputs with W (plus both biases) before the
loop, split once into steps, each added to ``H @ R^T``; gates are taken with Slices, not a Split, so each
step fuses into one MatMul kernel and two element-wise kernels in TVM.  Unrolled naively, each step has its
own ``x_t @ W^T``; the graph search can merge those pairwise (TASO's ``matmul(x,W), matmul(y,W) ->
split(matmul(concat0(x,y),W))``) but needs S-1 rewrites per direction to reach the same GEMM.  Measured
with ``bench/rnn_projection.py`` (``lstm-lm``: 2 layers, hidden 256, seq 32, batch 1; pipeline build with
default schedules; medians of 5 interleaved rounds x 30 runs, 2-core machine under load 3-4):

========================  =========  =========
form                      1 thread   2 threads
========================  =========  =========
hoisted                   2.52 ms    8.4 ms
naive                     3.22 ms    11.0 ms
naive + graph search      2.80 ms    9.8 ms
hoisted + graph search    2.60 ms    8.0 ms
onnxruntime, its LSTM op  1.37 ms    1.65 ms
========================  =========  =========

The search does find the merges (all 62 pairwise ones in the 1-thread run, 42 in the 2-thread run, each
stopped by its time limit; the graph stage took 106 s and 146 s) but the result is a tree of Concat/Split around many MatMuls, still slower than one
GEMM; on the hoisted form it finds nothing to apply (the same graph: the 3% difference is noise), so the
lowering hoists.  (Each step's [1, 256] x [256, 1024] MatMul dominates what is left; its default
schedule is a tuning target, and two threads only add pool overhead to kernels this small.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphopt.errors import UserError
from graphopt.ir import Node
from graphopt.legalize.registry import register
from graphopt.legalize.builder import Builder
from graphopt.legalize.sequence import reversal_index, reverse_steps, step_mask

# Activation name -> (takes alpha, takes beta); and ORT's defaults when the attribute lists run out.
_TAKES = {"affine": (True, True), "relu": (False, False), "leakyrelu": (True, False),
          "thresholdedrelu": (True, False), "tanh": (False, False), "scaledtanh": (True, True),
          "sigmoid": (False, False), "hardsigmoid": (True, True), "elu": (True, False),
          "softsign": (False, False), "softplus": (False, False)}
_DEFAULTS = {"leakyrelu": (0.01, 0.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}


@dataclass(frozen=True)
class Activation:
    name: str  # lower case, as ORT matches them
    alpha: float = 0.0
    beta: float = 0.0


@dataclass(frozen=True)
class Cell:
    """What differs between the three operators: gate count, default activations, extra state/inputs."""

    op: str
    gates: int
    activations: tuple[str, ...]  # per direction

    @property
    def has_cell_state(self) -> bool:
        return self.op == "LSTM"


CELLS = {"LSTM": Cell("LSTM", 4, ("Sigmoid", "Tanh", "Tanh")), "GRU": Cell("GRU", 3, ("Sigmoid", "Tanh")),
         "RNN": Cell("RNN", 1, ("Tanh",))}


# The longest sequence unrolled: the graph grows by ~10 operators a step and the build with it (a 256-step
# LSTM builds in ~12 s), so a user-given length of millions would spin for hours instead of failing.
MAX_STEPS = 2048


@dataclass
class Recurrence:
    """One RNN node, parsed and validated: static sizes, per-direction activations, optional inputs."""

    node: Node
    cell: Cell
    steps: int
    batch: int
    hidden: int
    dtype: str
    directions: list[str]  # "forward" / "reverse", one per output direction
    activations: list[list[Activation]]  # per direction
    layout: int
    clip: float | None
    linear_before_reset: bool
    input_forget: bool
    inputs: list[str]  # X, W, R, B, sequence_lens, initial_h, initial_c, P ("" when absent); states time major

    def input(self, i: int) -> str:
        return self.inputs[i]

    def output(self, i: int) -> str:
        return self.node.outputs[i] if len(self.node.outputs) > i else ""

    def fail(self, what: str) -> UserError:
        return UserError(f"{self.cell.op} node {self.node.name!r}: {what}")


def parse(node: Node, b: Builder) -> Recurrence:
    """Read and check the node's attributes and input shapes (one-line UserError for what cannot work)."""
    cell = CELLS[node.op_type]

    def fail(what: str) -> UserError:
        return UserError(f"{cell.op} node {node.name!r}: {what}")

    x_shape = b.graph.shape(node.inputs[0])
    if x_shape is None or len(x_shape) != 3 or not all(isinstance(d, int) for d in x_shape):
        raise fail(f"input X has shape {x_shape}, but unrolling needs a static [seq, batch, input] shape; "
                   "pass --input-shape for the model inputs")
    dtype = b.dtype(node.inputs[0])
    if dtype not in ("float16", "float32", "float64"):
        raise fail(f"input X has dtype {dtype}; LSTM/GRU/RNN take float16, float32 or float64")
    layout = int(node.attr("layout", 0))
    if layout not in (0, 1):
        raise fail(f"layout={layout} is not 0 or 1")
    steps, batch = (x_shape[0], x_shape[1]) if layout == 0 else (x_shape[1], x_shape[0])
    if steps > MAX_STEPS:
        raise fail(f"{steps} time steps: unrolling is limited to {MAX_STEPS} steps (each adds ~10 operators to "
                   "compile); pass a shorter sequence with --input-shape, or split the sequence")
    direction = node.attr("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else str(direction)
    dirs = {"forward": ["forward"], "reverse": ["reverse"], "bidirectional": ["forward", "reverse"]}.get(direction)
    if dirs is None:
        raise fail(f"direction={direction!r} is not forward, reverse or bidirectional")
    r_shape = b.graph.shape(node.inputs[2])
    if r_shape is None or len(r_shape) != 3 or not all(isinstance(d, int) for d in r_shape):
        raise fail(f"weight R has shape {r_shape}; it needs a static [directions, {cell.gates}*hidden, hidden] shape")
    hidden = int(node.attr("hidden_size", r_shape[2]))
    if tuple(r_shape) != (len(dirs), cell.gates * hidden, hidden):
        raise fail(f"weight R has shape {list(r_shape)}, expected {[len(dirs), cell.gates * hidden, hidden]} for "
                   f"direction={direction} and hidden_size={hidden}")
    nd, gh, inp = len(dirs), cell.gates * hidden, x_shape[2]
    state = [nd, batch, hidden] if layout == 0 else [batch, nd, hidden]
    expected = {1: ("W", [nd, gh, inp]), 3: ("B", [nd, 2 * gh]), 4: ("sequence_lens", [batch]),
                5: ("initial_h", state), 6: ("initial_c", state), 7: ("P", [nd, 3 * hidden])}
    for i, (what, shape) in expected.items():
        name = node.inputs[i] if len(node.inputs) > i else ""
        if name and (i < 6 or cell.op == "LSTM"):
            got = b.graph.shape(name)
            if got is None or list(got) != shape:
                raise fail(f"input {what} has shape {None if got is None else list(got)}, expected {shape}")
    clip = node.attr("clip")
    acts = _activations(node, cell, len(dirs), fail)
    return Recurrence(node=node, cell=cell, steps=steps, batch=batch, hidden=hidden, dtype=dtype, directions=dirs,
                      activations=acts, layout=layout, clip=None if clip is None else float(clip),
                      linear_before_reset=bool(node.attr("linear_before_reset", 0)),
                      input_forget=bool(node.attr("input_forget", 0)),
                      inputs=list(node.inputs) + [""] * (8 - len(node.inputs)))


def _activations(node: Node, cell: Cell, n_dirs: int, fail) -> list[list[Activation]]:
    names = [a.decode() if isinstance(a, bytes) else str(a) for a in node.attr("activations", [])]
    per_dir = len(cell.activations)
    if not names:
        names = list(cell.activations) * n_dirs
    elif cell.op == "RNN" and n_dirs == 1 and len(names) == 2:
        names = names[:1]  # the RNN schema's default lists two (one per direction) even for one direction
    if len(names) != per_dir * n_dirs:
        raise fail(f"'activations' lists {len(names)} functions, expected {per_dir * n_dirs} "
                   f"({per_dir} per direction)")
    alphas = [float(a) for a in node.attr("activation_alpha", [])]
    betas = [float(v) for v in node.attr("activation_beta", [])]
    out: list[Activation] = []
    for name in names:
        key = name.lower()
        if key not in _TAKES:
            raise fail(f"activation {name!r} is not one of {', '.join(sorted(_TAKES))}")
        takes_alpha, takes_beta = _TAKES[key]
        da, db = _DEFAULTS.get(key, (0.0, 0.0))
        alpha = (alphas.pop(0) if alphas else da) if takes_alpha else 0.0
        beta = (betas.pop(0) if betas else db) if takes_beta else 0.0
        out.append(Activation(key, alpha, beta))
    return [out[d * per_dir:(d + 1) * per_dir] for d in range(n_dirs)]


def activate(b: Builder, act: Activation, x: str) -> str:
    """``act(x)`` with ONNX ops (ORT's formulas for the ones that are not ONNX operators)."""
    dt = b.dtype(x)
    name = act.name
    if name in ("sigmoid", "tanh", "relu", "softsign", "softplus"):
        return b.unary({"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu", "softsign": "Softsign",
                        "softplus": "Softplus"}[name], x)
    if name == "affine":  # alpha * x + beta
        return b.binary("Add", b.mul(x, b.const(act.alpha, dt)), b.const(act.beta, dt))
    if name == "scaledtanh":  # alpha * tanh(beta * x)
        return b.mul(b.unary("Tanh", b.mul(x, b.const(act.beta, dt))), b.const(act.alpha, dt))
    if name == "leakyrelu":
        return b.unary("LeakyRelu", x, alpha=act.alpha)
    if name == "elu":
        return b.unary("Elu", x, alpha=act.alpha)
    if name == "hardsigmoid":
        return b.unary("HardSigmoid", x, alpha=act.alpha, beta=act.beta)
    # thresholdedrelu: x if x > alpha else 0 (an ONNX operator only from opset 10)
    if b.opset >= 10:
        return b.unary("ThresholdedRelu", x, alpha=act.alpha)
    return b.mul(x, b.cast(b.binary("Greater", x, b.const(act.alpha, dt)), dt))


@dataclass
class Weights:
    """One direction's weights, transposed for ``x @ W``: projection, recurrence, biases, peepholes."""

    w: str  # [input, gates*hidden]
    r: str  # [hidden, gates*hidden]
    bias: str | None  # added to the projection: Wb + Rb (GRU with linear_before_reset: Wb + Rb[z, r] only)
    rbh: str | None  # GRU with linear_before_reset: Rb[h], which the reset gate multiplies
    peep: list[str] | None  # LSTM: [Pi, Po, Pf]


def _weights(rec: Recurrence, b: Builder, d: int) -> Weights:
    hidden, gh = rec.hidden, rec.cell.gates * rec.hidden
    w = b.transpose(b.gather(rec.input(1), d), [1, 0])
    r = b.transpose(b.gather(rec.input(2), d), [1, 0])
    bias = rbh = None
    if rec.input(3):
        both = b.gather(rec.input(3), d)
        wb, rb = b.slice(both, 0, 0, gh), b.slice(both, 0, gh, 2 * gh)
        if rec.cell.op == "GRU" and rec.linear_before_reset:
            rbh = b.slice(rb, 0, 2 * hidden, 3 * hidden)
            rb = b.concat([b.slice(rb, 0, 0, 2 * hidden), b.const(np.zeros(hidden, rec.dtype), hint="zeros")], 0)
        bias = b.binary("Add", wb, rb)
    peep = None
    if rec.cell.op == "LSTM" and rec.input(7):
        peep = b.slices(b.gather(rec.input(7), d), 0, [hidden] * 3)
    return Weights(w, r, bias, rbh, peep)


class Steps:
    """Which steps run for which batch entries, from ``sequence_lens``; and the selects that apply it."""

    def __init__(self, rec: Recurrence, b: Builder):
        self.b, self.rec = b, rec
        self.lens = rec.input(4) or None
        self.known: np.ndarray | None = None
        self._masks: list[str] | None = None
        self._float: dict[str, str] = {}
        if self.lens is None:
            return
        known = b.value(self.lens)
        if known is not None:
            known = known.astype(np.int64)
            if known.min() < 0 or known.max() > rec.steps:
                raise rec.fail(f"sequence_lens {known.tolist()} must lie in [0, {rec.steps}]")
            if (known == rec.steps).all():
                self.lens = None  # every entry runs every step: plain unrolling
                return
        self.known = known

    @property
    def computed(self) -> int:
        """Steps to compute: past the longest known length nothing changes and Y is zero."""
        return self.rec.steps if self.known is None else int(self.known.max())

    def mask(self, k: int) -> str | None:
        """Boolean [batch, 1] of the entries still running at step k, or None when all of them are."""
        if self.lens is None:
            return None
        b, rec = self.b, self.rec
        if self.known is not None:
            if (self.known > k).all():
                return None
            return b.const((self.known > k).reshape(rec.batch, 1), hint="mask")
        if self._masks is None:  # lengths known at run time: one mask per step, shared by both directions
            mask3 = b.reshape(step_mask(b, self.lens, rec.steps), [rec.steps, rec.batch, 1])
            self._masks = _per_step(b, mask3, rec.steps)
        return self._masks[k]

    def select(self, mask: str, new: str, old: str | None) -> str:
        """``new`` where the mask holds, else ``old`` (None: zero)."""
        b, dt = self.b, self.rec.dtype
        if b.opset >= 9:
            return b.where(mask, new, old if old is not None else b.const(0, dt))
        if mask not in self._float:  # no Where before opset 9: mask * new + (1 - mask) * old
            self._float[mask] = b.cast(mask, dt)
        m = self._float[mask]
        out = b.mul(m, new)
        if old is not None:
            out = b.add(out, b.mul(b.binary("Sub", b.const(1, dt), m), old))
        return out

    def final(self, state: str | None) -> str | None:
        """A final state as ORT reports it: zero for entries of length 0 (not their initial state)."""
        if self.lens is None or state is None or (self.known is not None and self.known.min() > 0):
            return state
        b, rec = self.b, self.rec
        if self.known is not None:
            running = b.const((self.known > 0).reshape(rec.batch, 1), hint="mask")
        else:
            running = b.reshape(step_mask(b, self.lens, 1), [rec.batch, 1])
        return self.select(running, state, None)

    def reversal(self) -> str | None:
        if self.lens is None:
            return None
        return reversal_index(self.b, self.lens, self.rec.steps)


def _lstm_step(b: Builder, rec: Recurrence, wt: Weights, acts: list[Activation], xw: str,
               h: str | None, c: str | None) -> tuple[str, str]:
    hid, dt = rec.hidden, rec.dtype
    f, g, hh = acts
    gates = b.add(xw, b.matmul(h, wt.r) if h is not None else None)
    i_pre, o_pre, f_pre, c_pre = b.slices(gates, 1, [hid] * 4)
    pi, po, pf = wt.peep if wt.peep is not None else (None, None, None)

    def gate(act: Activation, pre: str, peep: str | None, state: str | None) -> str:
        if peep is not None and state is not None:
            pre = b.add(pre, b.mul(state, peep))
        return activate(b, act, b.clip(pre, -rec.clip, rec.clip) if rec.clip is not None else pre)

    i = gate(f, i_pre, pi, c)
    fg = b.binary("Sub", b.const(1, dt), i) if rec.input_forget else gate(f, f_pre, pf, c)
    c_new = b.add(b.mul(i, gate(g, c_pre, None, None)), b.mul(fg, c) if c is not None else None)
    o = gate(f, o_pre, po, c_new)
    return b.mul(o, activate(b, hh, c_new)), c_new


def _gru_step(b: Builder, rec: Recurrence, wt: Weights, acts: list[Activation], xw: str,
              h: str | None) -> str:
    hid, dt = rec.hidden, rec.dtype
    f, g = acts

    def gate(act: Activation, pre: str) -> str:
        return activate(b, act, b.clip(pre, -rec.clip, rec.clip) if rec.clip is not None else pre)

    xw_z, xw_r, xw_h = b.slices(xw, 1, [hid] * 3)
    if rec.linear_before_reset:  # h~ = g(Xt Wh + r * (Ht-1 Rh + Rbh) + Wbh)
        hr_z, hr_r, hr_h = b.slices(b.matmul(h, wt.r), 1, [hid] * 3) if h is not None else (None, None, None)
        hr_h = b.add(hr_h, wt.rbh) if hr_h is not None else wt.rbh
        z, r = gate(f, b.add(xw_z, hr_z)), gate(f, b.add(xw_r, hr_r))
        h_pre = b.add(xw_h, b.mul(r, hr_h) if hr_h is not None else None)
    else:  # h~ = g(Xt Wh + (r * Ht-1) Rh + Rbh + Wbh)
        r_zr, r_h = b.slice(wt.r, 1, 0, 2 * hid), b.slice(wt.r, 1, 2 * hid, 3 * hid)
        hr_z, hr_r = b.slices(b.matmul(h, r_zr), 1, [hid] * 2) if h is not None else (None, None)
        z, r = gate(f, b.add(xw_z, hr_z)), gate(f, b.add(xw_r, hr_r))
        h_pre = b.add(xw_h, b.matmul(b.mul(r, h), r_h) if h is not None else None)
    cand = gate(g, h_pre)
    return b.add(b.mul(b.binary("Sub", b.const(1, dt), z), cand), b.mul(z, h) if h is not None else None)


def _rnn_step(b: Builder, rec: Recurrence, wt: Weights, acts: list[Activation], xw: str, h: str | None) -> str:
    pre = b.add(xw, b.matmul(h, wt.r) if h is not None else None)
    if rec.clip is not None:
        pre = b.clip(pre, -rec.clip, rec.clip)
    return activate(b, acts[0], pre)


FANIN = 16


def _stack(b: Builder, parts: list[str]) -> str:
    """Concat along axis 0 as a tree of at most FANIN inputs per node.

    Why: TVM schedules and compiles one Concat of n inputs in time that grows faster than n (each output
    element selects among n inputs); a 256-step Y built flat took 5 s of one kernel's compile.
    """
    while len(parts) > FANIN:
        parts = [b.concat(parts[i:i + FANIN], 0) for i in range(0, len(parts), FANIN)]
    return b.concat(parts, 0)


def _per_step(b: Builder, x: str, count: int) -> list[str]:
    """The first ``count`` steps of ``x`` [S, B, N] as [B, N] tensors, by Splits of at most FANIN pieces.

    Why Split and not a Gather per step: one kernel instead of S.  Why a tree: the CPU schedule rules take
    time quadratic in a kernel's outputs (a flat 256-way Split: 55 s to schedule).
    """
    steps, batch, width = b.shape(x)
    if count == 0:
        return []
    if count == 1 and steps == 1:
        return [b.reshape(x, [batch, width])]
    if count <= FANIN:
        sizes = [1] * count + ([steps - count] if steps > count else [])
        return [b.reshape(p, [batch, width]) for p in b.split(x, 0, sizes)[:count]]
    chunk = -(-count // FANIN) if count > FANIN * FANIN else FANIN
    sizes = [min(chunk, count - i) for i in range(0, count, chunk)]
    sizes += [steps - count] if steps > count else []
    out: list[str] = []
    for piece, n in zip(b.split(x, 0, sizes), sizes):
        if len(out) < count:
            out += _per_step(b, piece, n)
    return out[:count]


@dataclass
class DirectionResult:
    y: str | None  # [S, B, H] in time order (None when Y is not wanted)
    h: str | None  # final states [B, H] (None: zero)
    c: str | None


def _run_direction(rec: Recurrence, b: Builder, x: str, d: int, steps: Steps, want_y: bool,
                   hoist: bool) -> DirectionResult:
    """Unroll one direction over time-major ``x`` [S, B, I]."""
    reverse = rec.directions[d] == "reverse"
    index = steps.reversal() if reverse else None
    if index is not None:  # per-entry reversal of the valid prefix, then run forward with masks
        x = reverse_steps(b, x, index)
    order = list(range(rec.steps))[::-1] if reverse and index is None else list(range(rec.steps))
    wt = _weights(rec, b, d)
    acts = rec.activations[d]
    h = b.gather(rec.input(5), d, axis=0) if rec.input(5) else None
    c = b.gather(rec.input(6), d, axis=0) if rec.cell.has_cell_state and rec.input(6) else None
    computed = steps.computed
    if hoist:  # one GEMM over all steps: [S, B, I] @ [I, G*H], biases included
        xw_steps = _per_step(b, b.add(b.matmul(x, wt.w), wt.bias), computed)
    else:  # one small GEMM per step, for comparison (see the module docstring), its step taken by a Gather
        # (the form measured in the table; the Split form builds too since pipeline/cpu_rules.py stopped
        # reverse-inlining into a buffer with other readers - FlattenBuffer "used before its definition")
        xw_steps = [b.add(b.matmul(b.gather(x, t), wt.w), wt.bias) for t in range(computed)]
    zeros = b.const(np.zeros((rec.batch, rec.hidden), rec.dtype), hint="zeros")
    ys: dict[int, str] = {}
    for k, t in enumerate(order):
        if k >= computed:  # no entry runs this step: state unchanged, output zero
            ys[t] = zeros
            continue
        xw = xw_steps[t]
        c_new = None
        if rec.cell.op == "LSTM":
            h_new, c_new = _lstm_step(b, rec, wt, acts, xw, h, c)
        elif rec.cell.op == "GRU":
            h_new = _gru_step(b, rec, wt, acts, xw, h)
        else:
            h_new = _rnn_step(b, rec, wt, acts, xw, h)
        mask = steps.mask(k)
        if mask is None:
            h, c, ys[t] = h_new, c_new, h_new
        else:
            if want_y:
                ys[t] = steps.select(mask, h_new, None)
            h = steps.select(mask, h_new, h)
            if c_new is not None:
                c = steps.select(mask, c_new, c)
    h, c = steps.final(h), steps.final(c)
    if not want_y:
        return DirectionResult(None, h, c)
    y = _stack(b, [b.reshape(ys[t], [1, rec.batch, rec.hidden]) for t in range(rec.steps)])
    if index is not None:  # computed in per-entry reversed order: the same Gather puts it back in time order
        y = reverse_steps(b, y, index)
    return DirectionResult(y, h, c)


def lower(node: Node, b: Builder, hoist: bool = True) -> dict[str, str]:
    """Replace one LSTM/GRU/RNN node; ``hoist=False`` is the naive per-step projection (for measuring)."""
    rec = parse(node, b)
    x = rec.input(0)
    if rec.layout == 1:  # batch major: X [B, S, I] and the initial states [B, dirs, H] to time major
        x = b.transpose(x, [1, 0, 2])
        for i in (5, 6):
            if rec.inputs[i]:
                rec.inputs[i] = b.transpose(rec.inputs[i], [1, 0, 2])
    steps = Steps(rec, b)
    y_name, yh_name, yc_name = rec.output(0), rec.output(1), rec.output(2) if rec.cell.has_cell_state else ""
    results = [_run_direction(rec, b, x, d, steps, bool(y_name), hoist) for d in range(len(rec.directions))]
    zeros = b.const(np.zeros((rec.batch, rec.hidden), rec.dtype), hint="zeros")
    out: dict[str, str] = {}
    if y_name:
        y = b.concat([b.reshape(r.y, [rec.steps, 1, rec.batch, rec.hidden]) for r in results if r.y], 1)
        out[y_name] = b.transpose(y, [2, 0, 1, 3]) if rec.layout == 1 else y
    for name, states in ((yh_name, [r.h for r in results]), (yc_name, [r.c for r in results])):
        if name:
            final = b.concat([b.reshape(s if s is not None else zeros, [1, rec.batch, rec.hidden])
                              for s in states], 0)
            out[name] = b.transpose(final, [1, 0, 2]) if rec.layout == 1 else final
    return out


@register("LSTM", "GRU", "RNN")
def lower_recurrence(node: Node, b: Builder) -> dict[str, str]:
    return lower(node, b)
