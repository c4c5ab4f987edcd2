"""The TVM engine behind graphopt's measured cost model: a graph compiled the way the pipeline compiles it.

graphopt defines the :class:`~graphopt.cost.runners.GraphRunner` interface and ships the onnxruntime runner;
this one is injected by the pipeline (``optimize-model``, ``bench-model``, the ``graphopt`` console
command), so the graph search prices operators with the code the pipeline will really run: Relax import,
fusion, the template / dlight default schedules, the Relax VM.
"""
from __future__ import annotations

import re
from typing import Callable

from graphopt.cost.runners import GraphRunner, timing_feeds
from graphopt.ir import Graph
from graphopt.onnx_io import export_onnx
from kerneltune.native_log import quiet_native_stderr
from kerneltune.targets.parse import check_name, parse_target
from kerneltune.targets.registry import TargetSpec, device_for
from kerneltune.targets.threads import set_num_threads, tvm_num_threads
from pipeline.compile import compile_partition, to_device
from pipeline.partition import partition
from pipeline.relax_import import import_model


class TvmRunner(GraphRunner):
    """One synchronised call of the graph compiled by the pipeline (import, partition, default schedules)."""

    name = "tvm"

    def __init__(self, threads: int = 1, target: str = "llvm"):
        super().__init__(tvm_num_threads(threads))  # TVM's pool is sized once per process
        self.target = target
        self._spec: TargetSpec | None = None

    @property
    def cache_tag(self) -> str:
        """``tvm``, plus the CPU options of ``--target`` (``-mcpu``, ``-mattr``): code built for another CPU
        model runs at another speed on this one, so its timings are cached apart."""
        options = [f"{k}-{v}" for k, v in check_name(self.target).attrs if k in ("mcpu", "mattr")]
        tag = "-".join([self.name, *options])
        return re.sub(r"[^A-Za-z0-9.=_-]+", "_", tag)[:80]

    def prepare(self, graph: Graph) -> Callable[[], object]:
        set_num_threads(self.threads)
        if self._spec is None:
            self._spec = parse_target(self.target, self.threads)
        imported = import_model(export_onnx(graph, check=False))
        with quiet_native_stderr():  # LLVM codegen warns about TOPI's pragmas ("Unknown pragma pragma_scope")
            compiled = compile_partition(imported, partition(imported.mod), self._spec)
        dev = device_for(self._spec)
        args = to_device(timing_feeds(graph), compiled.input_names, dev)
        main = compiled.vm()["main"]

        def once() -> None:
            main(*args)
            dev.sync()

        return once
