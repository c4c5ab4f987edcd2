"""The Python API: ``pipeline.optimize(...)`` builds a model and gives back something runnable,
``pipeline.load(DIR)`` gives the same object back from a built folder.

    import pipeline
    model = pipeline.optimize("bert.onnx", target="llvm", trials=0, output="bert-built")
    outputs = model.run({"input_ids": ids, "attention_mask": mask})   # dict in, dict of outputs out
    same = pipeline.load("bert-built")                                # later, or on another machine

Both are the command-line tools' code (``optimize-model``, ``run-model``) without the argument parsing, so
the checks, the artifacts and the one-line errors (:class:`graphopt.errors.UserError`) are the same.
"""
from __future__ import annotations

import numbers
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnx

from graphopt.dims import ShapeRequest, check_dims
from graphopt.errors import UserError
from kerneltune.scheduler import SCHEDULERS
from kerneltune.searchers import SEARCHERS
from kerneltune.targets.threads import fork_safe, use_threads
from pipeline.artifact import Model, read_report
from pipeline.context import PRECISIONS, TIME_LIMIT, BuildContext, TuneOptions
from pipeline.layout.modes import LAYOUTS

_PATH, _OPTIONAL_PATH = (str, os.PathLike), (str, os.PathLike, type(None))
_INT, _OPTIONAL_INT = (numbers.Integral,), (numbers.Integral, type(None))
_OPTIONAL_STR = (str, type(None))
# Each argument of optimize() and load(): the types it takes and what to give, for the one-line error.  A bool
# is refused where an int is meant (True is an int to Python, not a trial count).
ARGUMENTS: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str, os.PathLike, onnx.ModelProto), "an .onnx path or an onnx.ModelProto"),
    "directory": (_PATH, "the path of a folder built by optimize-model"),
    "target": ((str,), "a target string such as 'llvm'"),
    "trials": (_INT, "0 (no tuning) or a positive number of trials"),
    "output": (_OPTIONAL_PATH, "a folder path, or None for a temporary folder"),
    "threads": (_OPTIONAL_INT, "a positive number of threads, or None for the cores this process may use"),
    "input_shapes": ((Mapping, type(None)), "a dict {input name: (d1, d2, ...)}"),
    "dims": ((Mapping, type(None)), "a dict {dimension name: size}, e.g. {'sequence': 128}"),
    "inputs": ((str, os.PathLike, Mapping, type(None)), "an .npz path or a dict {input name: array}"),
    "skip_graph": ((bool,), "True or False"),
    "seed": (_INT, "a non-negative integer"),
    "kernels": (_OPTIONAL_STR, "a task selection such as '0,3' or 'matmul', or None"),
    "scheduler": ((str,), f"one of {', '.join(SCHEDULERS)}"),
    "searcher": ((str,), f"one of {', '.join(SEARCHERS)}"),
    "records": (_OPTIONAL_PATH, "a records file path, or None"),
    "rpc": (_OPTIONAL_STR, "'HOST:PORT:KEY' of a TVM RPC tracker, or None"),
    "skip_tune": ((bool,), "True or False"),
    "tuning_timeout": ((numbers.Real, type(None)), "a positive number of seconds, or None for no time limit"),
    "early_stop": (_OPTIONAL_INT, "a positive number of trials without a gain, or None (off)"),
    "progress": ((bool,), "True or False"),
    "precision": ((str,), f"one of {', '.join(PRECISIONS)}"),
    "calibration": (_OPTIONAL_PATH, "an .npz path of stacked sample sets, or None"),
    "layout": ((str,), f"one of {', '.join(LAYOUTS)}"),
    "time_limit": ((numbers.Real,), "a positive number of seconds for the graph stage"),
}


def check_arguments(values: Mapping[str, Any]) -> None:
    """Every API argument's type and value, before any work: a UserError naming the first wrong one, as the
    command line's parser does for its options (a raw TypeError from deep inside otherwise)."""
    for name, value in values.items():
        types, what = ARGUMENTS[name]
        wrong_type = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if wrong_type or not _valid_value(name, value):
            raise UserError(f"{name}={value!r:.80}: give {what}")


def _valid_value(name: str, value: Any) -> bool:
    """The values a right type may still get wrong (the type is already checked); the tuning options' by
    their one check (:meth:`pipeline.context.TuneOptions.invalid`)."""
    if name in ("trials", "scheduler", "searcher", "early_stop"):
        return TuneOptions(**{name: value}).invalid() is None
    if name == "tuning_timeout":
        return TuneOptions(timeout=value).invalid() is None
    if name == "seed":
        return value >= 0
    if name == "precision":
        return value in PRECISIONS
    if name == "layout":
        return value in LAYOUTS
    if name == "time_limit":
        return 0 < value < float("inf")
    if name == "dims" and value is not None:  # the sizes themselves: check_dims, which words a range's refusal
        return all(isinstance(k, str) for k in value)
    if name == "input_shapes" and value is not None:
        return all(isinstance(k, str) and not isinstance(v, (str, bytes)) and hasattr(v, "__iter__")
                   and all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in v)
                   for k, v in value.items())
    return True


def load(directory: str | os.PathLike, threads: int | None = None, rpc: str | None = None) -> Model:
    """The model built into ``directory`` by optimize-model (or :func:`optimize`), ready to run here, or on
    the device of a TVM RPC tracker with ``rpc="HOST:PORT:KEY"``."""
    check_arguments({"directory": directory, "threads": threads, "rpc": rpc})
    return Model.load(directory, threads, rpc)


@fork_safe  # in a forked child, on a thread with a TVM pool of its own
def optimize(model: str | os.PathLike | onnx.ModelProto, target: str = "llvm", trials: int = 0,
             output: str | os.PathLike | None = None, *, threads: int | None = None,
             input_shapes: Mapping[str, Any] | None = None,
             dims: Mapping[str, int | tuple[int, int]] | None = None,
             inputs: str | os.PathLike | Mapping[str, Any] | None = None,
             skip_graph: bool = False, seed: int = 0, kernels: str | None = None, scheduler: str = "gradient",
             searcher: str = "opevo", records: str | os.PathLike | None = None, rpc: str | None = None,
             skip_tune: bool = False, progress: bool = False, precision: str = "fp32",
             calibration: str | os.PathLike | None = None, tuning_timeout: float | None = None,
             early_stop: int | None = None, layout: str = "auto", time_limit: float = TIME_LIMIT) -> Model:
    """Optimize and compile ``model`` (a path or an ``onnx.ModelProto``) for ``target`` as optimize-model
    does, into ``output`` (a temporary folder, removed with the returned model, when None: use
    ``.save(DIR)`` to keep it).  ``inputs`` are sample inputs (an .npz path or a dict of arrays) for the
    checks; their shapes fix the compiled shapes, as ``input_shapes`` ({name: (d1, d2, ...)}) do, and ``dims``
    ({"sequence": 128}: ``--dim``) fixes a symbolic dimension by its name in every input that has it; a range
    ({"sequence": (2, 512)}) keeps it symbolic, and the build serves every size in it (:mod:`pipeline.symbolic`).
    ``precision="int8"`` quantizes the model with onnxruntime first, calibrated on ``calibration`` (an .npz
    of sample sets stacked on a first axis) or ``inputs`` (:mod:`pipeline.quantize`; the accuracy vs fp32 in
    report.json's ``precision``).  ``tuning_timeout`` (seconds) and ``early_stop`` (trials without a gain, per
    task) end kernel tuning before ``trials`` are spent, as optimize-model's ``--timeout`` and ``--early-stop``
    do (report.json's ``stages.tune.stop_reason`` says what ended it).  ``layout`` is ``--layout`` (the conv
    layouts: ``auto``, ``nchwc``, ``nchw``) and ``time_limit`` ``--time-limit`` (the graph stage's seconds)."""
    check_arguments(dict(locals()))  # first: locals() holds the arguments only
    sizes, ranges = check_dims(dims or {}, lambda name, value: f"dims={{{name!r}: {value!r}}}")
    from pipeline.optimize_model import optimize_model  # deferred: loads TVM

    n = use_threads(int(threads) if threads is not None else None, "threads")
    scratch = Path(tempfile.mkdtemp(prefix="optimize-model-api-"))
    try:
        if isinstance(model, onnx.ModelProto):
            path = scratch / "model.onnx"
            onnx.save(model, str(path))
            model = path
        if isinstance(inputs, Mapping):
            path = scratch / "inputs.npz"
            np.savez(path, **{k: np.asarray(v) for k, v in inputs.items()})
            inputs = path
        shapes = {str(k): tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
        out = Path(output) if output is not None else scratch / "built"
        tuning = TuneOptions(trials=int(trials), kernels=kernels, scheduler=scheduler, searcher=searcher,
                             records=str(records) if records else None, rpc=rpc, skip=skip_tune, progress=progress,
                             timeout=None if tuning_timeout is None else float(tuning_timeout),
                             early_stop=None if early_stop is None else int(early_stop))
        ctx = BuildContext.create(target, threads=n, seed=int(seed), tuning=tuning, skip_graph=skip_graph,
                                  layout=layout, graph_time_limit=float(time_limit),
                                  input_shapes=ShapeRequest(shapes, sizes, ranges),
                                  inputs=str(inputs) if inputs is not None else None,
                                  precision=precision, calibration=str(calibration) if calibration else None)
        optimize_model(str(model), str(out), ctx)
        built = Model(out, read_report(out), n)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if output is None:
        weakref.finalize(built, shutil.rmtree, scratch, True)  # the temporary build lives as long as the model
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return built
