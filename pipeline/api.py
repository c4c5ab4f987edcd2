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

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnx

from graphopt.errors import UserError
from kerneltune.targets import use_threads
from pipeline.artifact import Model, read_report


def load(directory: str | os.PathLike, threads: int | None = None, rpc: str | None = None) -> Model:
    """The model built into ``directory`` by optimize-model (or :func:`optimize`), ready to run here, or on
    the device of a TVM RPC tracker with ``rpc="HOST:PORT:KEY"``."""
    return Model.load(directory, threads, rpc)


def optimize(model: str | os.PathLike | onnx.ModelProto, target: str = "llvm", trials: int = 0,
             output: str | os.PathLike | None = None, *, threads: int | None = None,
             input_shapes: Mapping[str, Any] | None = None, inputs: str | os.PathLike | Mapping[str, Any] | None = None,
             skip_graph: bool = False, seed: int = 0, kernels: str | None = None, scheduler: str = "gradient",
             searcher: str = "opevo", records: str | os.PathLike | None = None, rpc: str | None = None,
             skip_tune: bool = False, progress: bool = False) -> Model:
    """Optimize and compile ``model`` (a path or an ``onnx.ModelProto``) for ``target`` as optimize-model
    does, into ``output`` (a temporary folder, removed with the returned model, when None: use
    ``.save(DIR)`` to keep it).  ``inputs`` are sample inputs (an .npz path or a dict of arrays) for the
    checks; their shapes fix the compiled shapes, as ``input_shapes`` ({name: (d1, d2, ...)}) do."""
    from pipeline.optimize_model import TuneOptions, optimize_model  # deferred: loads TVM

    if trials < 0:
        raise UserError(f"trials={trials}: give 0 (no tuning) or a positive budget")
    n = use_threads(threads, "threads")
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
        tuning = TuneOptions(trials, kernels, scheduler, searcher, str(records) if records else None, rpc, skip_tune,
                             progress)
        optimize_model(str(model), target, str(out), n, shapes, skip_graph=skip_graph, seed=seed, tuning=tuning,
                       inputs=str(inputs) if inputs is not None else None)
        built = Model(out, read_report(out), n)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if output is None:
        weakref.finalize(built, shutil.rmtree, scratch, True)  # the temporary build lives as long as the model
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return built
