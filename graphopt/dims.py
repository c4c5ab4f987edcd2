"""Named dimensions: ``--dim NAME=N`` fixes the symbolic dimension ``NAME`` (an ONNX ``dim_param``) in every
input that has it.

Exporters name the dimensions they leave open (``batch``, ``sequence``, ``s0``), and the same name in several
inputs is one size: a BERT's ``input_ids``, ``attention_mask`` and ``token_type_ids`` share ``sequence``.
``--input-shape`` makes the user spell that size once per input; ``--dim`` names it once (issue 41).  Here the
dims become per-input shapes (:func:`resolve_dims`), so every stage after :func:`graphopt.validate.check_model`
sees the same ``input_shapes`` it always did.

``--dim NAME=LO:HI`` (keep the dimension symbolic over a range) is parsed but refused: a build compiles one
size until symbolic compilation exists.  No TVM here.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

import onnx

from graphopt.errors import UserError
from graphopt.onnx_io import MAX_DIM, InputShapes, parse_input_shapes, runtime_inputs

Dims = dict[str, int]  # --dim, as checked: a size per dimension name
DIM_EXAMPLE = "--dim sequence=128"
DIM_HELP = ("fix the symbolic dimension NAME (as the model's inputs name it) to N in every input, e.g. "
            "--dim batch=1 --dim sequence=128 or --dim batch=1,sequence=128 (repeatable; LO:HI ranges are not "
            "supported yet)")


class ShapeRequest(dict):
    """What the command line asks of the input shapes: the ``--input-shape`` shapes by input name (the dict
    itself, an :data:`~graphopt.onnx_io.InputShapes`) and :attr:`dims`, the ``--dim`` sizes by dimension
    name.  One value, so that whatever hands ``--input-shape`` on to :func:`graphopt.validate.check_model`
    (the build context's ``input_shapes``) hands ``--dim`` on with it."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]] | None = None, dims: Mapping[str, int] | None = None):
        super().__init__(shapes or {})
        self.dims: Dims = dict(dims or {})

    def __reduce__(self):  # a dict subclass with an attribute: pickled whole (a forked or spawned worker)
        return ShapeRequest, (dict(self), self.dims)


def dims_of(shapes: Mapping[str, Any] | None) -> Dims:
    """The ``--dim`` sizes an ``input_shapes`` value carries (none for a plain dict)."""
    return dict(getattr(shapes, "dims", None) or {})


# ---- parsing -------------------------------------------------------------------------------------------------

def shape_request(input_shapes: list[str] | None, dims: list[str] | None) -> ShapeRequest:
    """A command line's ``--input-shape`` and ``--dim`` options, parsed and checked (before the model is read)."""
    return ShapeRequest(parse_input_shapes(input_shapes), parse_dims(dims))


def parse_dims(specs: list[str] | None) -> Dims:
    """``--dim NAME=N`` options (repeatable; ``--dim batch=1,sequence=128`` gives several at once), checked
    (:func:`check_dims`): a one-line UserError for any the build cannot take."""
    values: dict[str, int | tuple[int, int]] = {}
    for spec in specs or []:
        for piece in spec.split(","):
            name, value = _parse_piece(spec, piece)
            if name in values and values[name] != value:
                raise UserError(f"--dim gives {name!r} two sizes ({_text(values[name])} and {_text(value)}): "
                                "give it once")
            values[name] = value
    return check_dims(values, lambda name, value: f"--dim {name}={_text(value)}")


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


def check_dims(values: Mapping[str, Any], spell: Callable[[str, Any], str]) -> Dims:
    """``values`` ({name: size, or a (low, high) range}) as a build takes them, or a one-line UserError that
    ``spell(name, value)`` words as the caller's option (``--dim sequence=0``, ``dims={'sequence': 0}``).

    A range is read, then refused: it would keep the dimension symbolic, and a build compiles one size until
    symbolic compilation is built (issue 41)."""
    dims: Dims = {}
    for name, value in values.items():
        if isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
            low, high = value
            if not 1 <= low <= high:
                raise UserError(f"{spell(name, value)}: a range is LO:HI with 1 <= LO <= HI")
            raise UserError(f"{spell(name, value)}: ranges are not supported yet (a build is compiled for one size): "
                            f"fix the dimension with {name}=N, e.g. {spell(name, high)}")
        if not _is_int(value):
            raise UserError(f"{spell(name, value)}: the size must be a whole number N, e.g. {spell(name, 128)}")
        if not 1 <= value <= MAX_DIM:
            raise UserError(f"{spell(name, value)}: the size is {'not positive' if value < 1 else 'too large'}; "
                            f"give the size to compile for, e.g. {spell(name, 128)}")
        dims[name] = int(value)
    return dims


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
