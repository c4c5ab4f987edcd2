"""Named dimensions: ``--dim NAME=N`` fixes the symbolic dimension ``NAME`` (an ONNX ``dim_param``) in every
input that has it.

Exporters name the dimensions they leave open (``batch``, ``sequence``, ``s0``), and the same name in several
inputs is one size: a BERT's ``input_ids``, ``attention_mask`` and ``token_type_ids`` share ``sequence``.
``--input-shape`` makes the user spell that size once per input; ``--dim`` names it once (issue 41).  Here the
dims become per-input shapes (:func:`resolve_dims`), so every stage after :func:`graphopt.validate.check_model`
sees the same ``input_shapes`` it always did.

``--dim NAME=LO:HI`` keeps the dimension symbolic over a range (optimize-model only: one build serving every
size in it, :mod:`pipeline.symbolic`); every stage that works on one size sees the range's representative
size (:func:`representative`) in its place.  No TVM here.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

import onnx

from graphopt.errors import UserError
from graphopt.onnx_io import MAX_DIM, InputShapes, parse_input_shapes, runtime_inputs

Dims = dict[str, int]  # --dim, as checked: a size per dimension name
Ranges = dict[str, tuple[int, int]]  # --dim NAME=LO:HI, as checked: the sizes one build serves
DIM_EXAMPLE = "--dim sequence=128"
DIM_HELP = ("fix the symbolic dimension NAME (as the model's inputs name it) to N in every input, e.g. "
            "--dim batch=1 --dim sequence=128 or --dim batch=1,sequence=128 (repeatable)")
RANGE_HELP = (DIM_HELP[:-1] + "; NAME=LO:HI keeps it symbolic: one build serves every size from LO to HI, "
              "e.g. --dim batch=1 --dim sequence=2:512)")

# The size a range is priced, tuned and first checked at: BERT's usual serving length, moved into the range when
# the range does not hold it.
REPRESENTATIVE = 128


def representative(low: int, high: int) -> int:
    """The size the stages that work on one size use for a dimension served over ``low..high``."""
    return min(max(REPRESENTATIVE, low), high)


class ShapeRequest(dict):
    """What the command line asks of the input shapes: the ``--input-shape`` shapes by input name (the dict
    itself, an :data:`~graphopt.onnx_io.InputShapes`), :attr:`dims`, the ``--dim`` sizes by dimension name,
    and :attr:`ranges`, the ``--dim NAME=LO:HI`` ranges.  One value, so that whatever hands ``--input-shape``
    on to :func:`graphopt.validate.check_model` (the build context's ``input_shapes``) hands ``--dim`` on with
    it."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]] | None = None, dims: Mapping[str, int] | None = None,
                 ranges: Mapping[str, tuple[int, int]] | None = None):
        super().__init__(shapes or {})
        self.dims: Dims = dict(dims or {})
        self.ranges: Ranges = dict(ranges or {})

    def __reduce__(self):  # a dict subclass with attributes: pickled whole (a forked or spawned worker)
        return ShapeRequest, (dict(self), self.dims, self.ranges)

    @property
    def sizes(self) -> Dims:
        """Every named dimension's size for the stages that work on one size: the fixed ones, and each range's
        representative size."""
        return self.dims | {name: representative(lo, hi) for name, (lo, hi) in self.ranges.items()}


def dims_of(shapes: Mapping[str, Any] | None) -> Dims:
    """The ``--dim`` sizes an ``input_shapes`` value carries (none for a plain dict)."""
    return dict(getattr(shapes, "dims", None) or {})


def ranges_of(shapes: Mapping[str, Any] | None) -> Ranges:
    """The ``--dim NAME=LO:HI`` ranges an ``input_shapes`` value carries (none for a plain dict)."""
    return dict(getattr(shapes, "ranges", None) or {})


# ---- parsing -------------------------------------------------------------------------------------------------

def shape_request(input_shapes: list[str] | None, dims: list[str] | None, ranges: bool = False) -> ShapeRequest:
    """A command line's ``--input-shape`` and ``--dim`` options, parsed and checked (before the model is read);
    ``ranges``: whether the command builds for a range (optimize-model), else a range is refused."""
    fixed, spans = parse_dims(dims)
    if spans and not ranges:
        name, (lo, hi) = next(iter(spans.items()))
        raise UserError(f"--dim {name}={lo}:{hi}: a range is for optimize-model (one build serving every size in "
                        f"it); this command runs one size: give --dim {name}=N, e.g. --dim {name}={hi}")
    return ShapeRequest(parse_input_shapes(input_shapes), fixed, spans)


def parse_dims(specs: list[str] | None) -> tuple[Dims, Ranges]:
    """``--dim NAME=N`` and ``NAME=LO:HI`` options (repeatable; ``--dim batch=1,sequence=128`` gives several at
    once), checked (:func:`check_dims`): a one-line UserError for any the build cannot take."""
    values: dict[str, int | tuple[int, int]] = {}
    for spec in specs or []:
        for piece in spec.split(","):
            name, value = _parse_piece(spec, piece)
            if name in values and values[name] != value:
                raise UserError(f"--dim gives {name!r} two sizes ({_text(values[name])} and {_text(value)}): "
                                "give it once")
            values[name] = value
    return check_dims(values, lambda name, value: f"--dim {name}={_text(value)}")


def sizes_text(sizes: Mapping[str, int]) -> str:
    """``sequence=128, batch=1``: sizes as the messages, tables and reports name them."""
    return ", ".join(f"{name}={value}" for name, value in sizes.items())


def parse_size_lists(specs: list[str] | None) -> list[Dims]:
    """``run-model --dim NAME=N[,N...]``: the sizes to run a build serving a range at, one dict per run; one
    dimension may list several sizes (``--dim sequence=16,128,384``: three runs), the others one each.  [{}]
    without ``--dim``."""
    sizes: dict[str, list[int]] = {}
    for spec in specs or []:
        name = None
        for piece in spec.split(","):
            if "=" in piece:
                name, value = _parse_piece(spec, piece)
            elif name is not None and piece.strip().isdigit():
                value = int(piece)
            else:
                raise UserError(f"bad --dim {spec!r}: write NAME=N or NAME=N,N,... (several sizes of one dimension), "
                                "e.g. --dim sequence=16,128,384")
            if isinstance(value, tuple):
                raise UserError(f"--dim {spec}: run-model runs sizes, not a range: list them, e.g. "
                                f"--dim {name}={value[0]},{value[1]}")
            sizes.setdefault(name, []).append(value)
    several = [n for n, v in sizes.items() if len(v) > 1]
    if len(several) > 1:
        raise UserError(f"--dim lists several sizes of {' and '.join(several)}: list several of one dimension only")
    for name, values in sizes.items():
        for v in values:
            check_dims({name: v}, lambda n, x: f"--dim {n}={x}")
    if not several:
        return [{n: v[0] for n, v in sizes.items()}]
    fixed = {n: v[0] for n, v in sizes.items() if n != several[0]}
    return [fixed | {several[0]: v} for v in sizes[several[0]]]


def _parse_piece(spec: str, piece: str) -> tuple[str, int | tuple[int, int]]:
    """One ``NAME=N`` or ``NAME=LO:HI`` of a ``--dim`` option."""
    name, sep, value = piece.partition("=")
    name = name.strip()
    if not sep and name.isdigit() and "=" in spec:  # sequence=16,128: several sizes of one dimension
        raise UserError(f"--dim {spec}: one size per dimension (several sizes are not supported yet): "
                        f"write NAME=N, e.g. {DIM_EXAMPLE}")
    if not sep or not name:
        raise UserError(f"bad --dim {spec!r}: write NAME=N with NAME a symbolic dimension of the model's inputs, "
                        f"e.g. {DIM_EXAMPLE}")
    try:
        low, colon, high = value.partition(":")
        return name, (int(low), int(high)) if colon else int(value)
    except ValueError:
        raise UserError(f"--dim {piece}: the size must be a whole number N, e.g. --dim {name}=128") from None


def _text(value: int | tuple[int, int]) -> str:
    return f"{value[0]}:{value[1]}" if isinstance(value, tuple) else str(value)


def check_dims(values: Mapping[str, Any], spell: Callable[[str, Any], str]) -> tuple[Dims, Ranges]:
    """``values`` ({name: size, or a (low, high) range}) as a build takes them: the fixed sizes and the ranges
    (a range of one size is that size), or a one-line UserError that ``spell(name, value)`` words as the
    caller's option (``--dim sequence=0``, ``dims={'sequence': 0}``)."""
    dims: Dims = {}
    ranges: Ranges = {}
    for name, value in values.items():
        if isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
            low, high = (int(v) for v in value)
            if not 1 <= low <= high:
                raise UserError(f"{spell(name, value)}: a range is LO:HI with 1 <= LO <= HI")
            if high > MAX_DIM:
                raise UserError(f"{spell(name, value)}: the range's top is too large; give the largest size to "
                                f"serve, e.g. {spell(name, (low, 512))}")
            if low == high:
                dims[name] = low
            else:
                ranges[name] = (low, high)
            continue
        if not _is_int(value):
            raise UserError(f"{spell(name, value)}: the size must be a whole number N, e.g. {spell(name, 128)}")
        if not 1 <= value <= MAX_DIM:
            raise UserError(f"{spell(name, value)}: the size is {'not positive' if value < 1 else 'too large'}; "
                            f"give the size to compile for, e.g. {spell(name, 128)}")
        dims[name] = int(value)
    return dims, ranges


def _is_int(value: Any) -> bool:
    """A whole number (numpy's too), not a bool: True is an int to Python, not a size."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ---- against the model ---------------------------------------------------------------------------------------

def named_dims(model: onnx.ModelProto) -> list[str]:
    """The names of the symbolic dimensions of ``model``'s runtime inputs, in order of first appearance."""
    names: list[str] = []
    for inp in runtime_inputs(model):
        for d in inp.type.tensor_type.shape.dim:
            if d.dim_param and not d.HasField("dim_value") and d.dim_param not in names:
                names.append(d.dim_param)
    return names


def check_dim_names(model: onnx.ModelProto, dims: Dims) -> None:
    """Every ``--dim`` names a dimension some input has: a misspelt name fixes nothing, and the error that
    followed (a still-symbolic input) would not say why."""
    known = named_dims(model)
    for name in dims:
        if name not in known:
            has = (f"its named dimensions: {', '.join(known)}" if known
                   else "it has none: fix the inputs' sizes with --input-shape NAME=D1,D2,...")
            raise UserError(f"--dim {name}={dims[name]}: no input of the model has a dimension named {name!r} ({has})")


def check_agreement(model: onnx.ModelProto, dims: Dims, shapes: InputShapes, flag: str) -> None:
    """The shapes ``flag`` (``--input-shape`` or ``--inputs``) gives agree with ``--dim`` on every dimension
    both set: two sizes for one dimension is a mistake in one of them, and which one only the user knows."""
    for inp in runtime_inputs(model):
        model_dims = inp.type.tensor_type.shape.dim
        given = shapes.get(inp.name)
        if given is None or len(given) != len(model_dims):  # a rank mismatch: apply_input_shapes names it
            continue
        for axis, (d, size) in enumerate(zip(model_dims, given)):
            if d.dim_param in dims and not d.HasField("dim_value") and dims[d.dim_param] != size:
                shown = f"{inp.name}={','.join(map(str, given))}" if flag == "--input-shape" else \
                    f"{inp.name} of shape {list(given)}"
                raise UserError(f"{flag} {shown} sets {d.dim_param}={size} (axis {axis}), but --dim "
                                f"{d.dim_param}={dims[d.dim_param]}: make them agree, or drop one")


def ranged_axes(model: onnx.ModelProto, names: Mapping[str, Any]) -> list[tuple[str, int, str]]:
    """(input, axis, dimension name) of every runtime input axis left symbolic under one of ``names``."""
    return [(inp.name, axis, d.dim_param) for inp in runtime_inputs(model)
            for axis, d in enumerate(inp.type.tensor_type.shape.dim)
            if d.dim_param in names and not d.HasField("dim_value")]


def within_ranges(model: onnx.ModelProto, ranges: Ranges, shapes: InputShapes, flag: str) -> Dims:
    """The size of each ranged dimension that the shapes ``flag`` gives set (the one-size stages then work at
    it), else that dimension's :func:`representative` size; a size outside its range is a one-line UserError."""
    sizes = {name: representative(lo, hi) for name, (lo, hi) in ranges.items()}
    ranks = {inp.name: len(inp.type.tensor_type.shape.dim) for inp in runtime_inputs(model)}
    for name, axis, dim in ranged_axes(model, ranges):
        given = shapes.get(name)
        if given is None or len(given) != ranks[name]:  # a rank mismatch: apply_input_shapes names it
            continue
        lo, hi = ranges[dim]
        if not lo <= given[axis] <= hi:
            raise UserError(f"{flag} gives {name} {dim}={given[axis]} (axis {axis}), outside --dim {dim}={lo}:{hi}: "
                            "widen the range or change the size")
        sizes[dim] = int(given[axis])
    return sizes


def resolve_dims(model: onnx.ModelProto, dims: Dims, shapes: InputShapes) -> InputShapes:
    """``shapes`` (``--input-shape``, ``--inputs``) with the shape of every other input that ``dims`` fixes
    whole.  An input ``dims`` fixes in part is left out: :func:`graphopt.onnx_io.require_static_inputs` names
    what it still needs."""
    out = dict(shapes)
    for inp in runtime_inputs(model):
        tt = inp.type.tensor_type
        if inp.name in out or not tt.HasField("shape"):
            continue
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param) for d in tt.shape.dim]
        if any(d.dim_param in dims for d in tt.shape.dim if not d.HasField("dim_value")) and None not in shape:
            out[inp.name] = tuple(shape)
    return out
