"""Variable-length sequences: the masks and the per-entry reversal that ``sequence_lens`` implies.

Both RNN lowerings and ``ReverseSequence`` need, for a batch of sequences padded to ``S`` steps, the rows
of ``x.reshape(S * B, ...)`` that reverse each entry's first ``lens[b]`` steps and keep the padding where it
is: ``idx[t, b] = lens[b] - 1 - t`` for ``t < lens[b]`` else ``t``, flattened as ``idx * B + b``.  One
Gather with that [S, B] index does the whole reversal; the map is its own inverse, so the same Gather puts
a reversed result back in time order.  Known lengths (weights) give a constant index; lengths that are
model inputs give a few integer ops, written with Mul/Add/Sub so they exist in every opset from 7 on.
"""
from __future__ import annotations

import numpy as np

from graphopt.errors import UserError
from graphopt.ir import Node
from graphopt.legalize.registry import register
from graphopt.legalize.builder import Builder


def step_mask(b: Builder, lens: str, steps: int) -> str:
    """Boolean [S, B]: step t is inside entry b's sequence (``t < lens[b]``)."""
    v = b.value(lens)
    if v is not None:
        return b.const(np.arange(steps)[:, None] < v.reshape(1, -1), hint="mask")
    batch = b.shape(lens)[0]
    # Less only takes integers from opset 9 on; small integers are exact in float32.
    dt = b.dtype(lens) if b.opset >= 9 else "float32"
    k = b.const(np.arange(steps).reshape(steps, 1), dt, hint="steps")
    return b.binary("Less", k, b.reshape(b.cast(lens, dt), [1, batch]))


def reversal_index(b: Builder, lens: str, steps: int) -> str:
    """Int [S, B] rows of ``x.reshape(S * B, ...)`` reversing each entry's valid prefix (see module doc)."""
    v = b.value(lens)
    batch = b.shape(lens)[0]
    if v is not None:
        t = np.arange(steps)[:, None]
        lens_row = v.reshape(1, -1).astype(np.int64)
        idx = np.where(t < lens_row, lens_row - 1 - t, t)
        return b.const(idx * batch + np.arange(batch)[None, :], np.int64, hint="rev_index")
    dt = b.dtype(lens)
    inside = b.cast(step_mask(b, lens, steps), dt)
    k = b.const(np.arange(steps).reshape(steps, 1), dt, hint="steps")
    lens_row = b.reshape(lens, [1, batch])
    rev = b.binary("Sub", b.binary("Sub", lens_row, b.const(1, dt)), k)
    idx = b.add(k, b.mul(inside, b.binary("Sub", rev, k)))  # t + inside * (rev - t)
    return b.add(b.mul(idx, b.const(batch, dt)), b.const(np.arange(batch).reshape(1, batch), dt))


def reverse_steps(b: Builder, x: str, index: str) -> str:
    """``x`` [S, B, ...] with each entry's valid prefix reversed, given :func:`reversal_index`."""
    shape = b.shape(x)
    flat = b.reshape(x, [shape[0] * shape[1], *shape[2:]])
    return b.gather(flat, index, axis=0)


@register("ReverseSequence")
def lower_reverse_sequence(node: Node, b: Builder) -> dict[str, str]:
    """ReverseSequence (opset 10): time and batch axes moved first, one Gather, moved back."""
    x, lens = node.inputs[0], node.inputs[1]
    shape = b.graph.shape(x)
    if shape is None or not all(isinstance(d, int) for d in shape):
        raise UserError(f"ReverseSequence node {node.name!r}: input {x!r} has unknown dimensions {shape}; "
                        "pass --input-shape for the model inputs")
    time_axis, batch_axis = int(node.attr("time_axis", 0)), int(node.attr("batch_axis", 1))
    rest = [a for a in range(len(shape)) if a not in (time_axis, batch_axis)]
    perm = [time_axis, batch_axis, *rest]
    moved = b.transpose(x, perm) if perm != list(range(len(shape))) else x
    out = reverse_steps(b, moved, reversal_index(b, lens, shape[time_axis]))
    if perm != list(range(len(shape))):
        out = b.transpose(out, [int(p) for p in np.argsort(perm)])
    return {node.outputs[0]: out}
