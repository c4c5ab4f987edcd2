"""The TVM engine behind graphopt's measured cost model: a graph compiled the way the pipeline compiles it.

graphopt defines the :class:`~graphopt.cost.runners.GraphRunner` interface and ships the onnxruntime runner;
this one is injected by the pipeline (``optimize-model``, ``bench-model``, the ``graphopt`` console
command), so the graph search prices operators with the code the pipeline will really run: Relax import,
fusion, the template / dlight default schedules, the Relax VM.  How a graph is compiled is handed in
(``compile_graph``: :func:`pipeline.stages.compile_graph`, the stage chain's), so this module composes no
stage itself.
"""
from __future__ import annotations

import re
from functools import partial
from typing import Callable, Sequence

import onnx

from graphopt.cost.runners import GraphRunner, timing_feeds
from graphopt.ir import Graph
from graphopt.onnx_io import export_onnx
from kerneltune.machine_gate import build_concurrently
from kerneltune.targets.parse import build_spec, check_name
from kerneltune.targets.registry import TargetRequest, TargetSpec
from kerneltune.targets.threads import set_num_threads, tvm_num_threads
from pipeline.compile import CompiledModel, model_runner


class TvmRunner(GraphRunner):
    """One synchronised call of the graph compiled by the pipeline (import, partition, default schedules)."""

    name = "tvm"

    def __init__(self, compile_graph: Callable[[onnx.ModelProto, TargetSpec], CompiledModel], threads: int = 1,
                 spec: TargetSpec | None = None,
                 price_kernels: Callable[[list[tuple[onnx.ModelProto, Graph]], TargetSpec, bool], list[float]] | None = None,
                 compile_model: Callable[[onnx.ModelProto, TargetSpec], CompiledModel] | None = None,
                 request: TargetRequest | None = None):
        super().__init__(tvm_num_threads(threads))  # TVM's pool is sized once per process
        self.compile_graph = compile_graph  # one operator, as imported
        self.compile_model = compile_model or compile_graph  # a whole model, as the product builds it
        self.price_kernels = price_kernels  # the fusion-aware price (pipeline.pricing.kernel_price), None: none
        self._spec = spec  # None: built from the request when the first graph is prepared (loads TVM)
        # the --target it prices for (``-mcpu``/``-mattr`` included); None: this machine's llvm
        self._request = spec.request if spec is not None and request is None else request

    @property
    def cache_tag(self) -> str:
        """``tvm``, plus the CPU options of ``--target`` (``-mcpu``, ``-mattr``): code built for another CPU
        model runs at another speed on this one, so its timings are cached apart."""
        request = self._request
        options = [f"{k}-{v}" for k, v in (request.attrs if request else ()) if k in ("mcpu", "mattr")]
        tag = "-".join([self.name, *options])
        return re.sub(r"[^A-Za-z0-9.=_-]+", "_", tag)[:80]

    def _target(self) -> TargetSpec:
        set_num_threads(self.threads)
        if self._spec is None:  # built as optimize-model's BuildContext builds its spec: from the parsed request
            self._spec = build_spec(self._requested(), self.threads)
        return self._spec

    @property
    def blocked_winograd(self) -> bool:
        """A CPU target computes marked convs with kerneltune's Winograd NCHWc kernel (pipeline.layout).  Read
        off the request: asking loads nothing and sizes no thread pool."""
        return self._requested().kind == "llvm"

    def _requested(self) -> TargetRequest:
        """The ``--target`` this runner prices for; this machine's llvm when none was given."""
        return self._request or check_name("llvm")

    def kernel_times(self, graphs: Sequence[Graph], confirm: bool = False) -> list[float] | None:
        if self.price_kernels is None:
            return None
        return self.price_kernels([(export_onnx(g, check=False), g) for g in graphs], self._target(), confirm)

    def prepare(self, graph: Graph) -> Callable[[], object]:
        return self._prepare(graph, self.compile_graph)

    def prepare_model(self, graph: Graph) -> Callable[[], object]:
        return self._prepare(graph, self.compile_model)

    def prepare_many(self, graphs: Sequence[Graph]) -> list[Callable[[], object] | Exception]:
        """One-operator graphs built side by side (the graph stage's operator prices, before its search)."""
        self._target()  # the spec (and TVM's pool) made once, before the threads
        return build_concurrently([partial(self.prepare_or_failure, g) for g in graphs])

    def prepare_models(self, graphs: Sequence[Graph]) -> list[Callable[[], object]]:
        """Whole models built side by side (the end-to-end check's two: ResNet-50's 12.9 s in turn, 6.9 s
        side by side on 2 cores), then each made a runner."""
        spec = self._target()
        compiled = build_concurrently([partial(self.compile_model, export_onnx(g, check=False), spec)
                                       for g in graphs])
        return [model_runner(c, timing_feeds(g)) for c, g in zip(compiled, graphs)]

    def _prepare(self, graph: Graph, compile_: Callable[[onnx.ModelProto, TargetSpec], CompiledModel]):
        spec = self._target()
        return model_runner(compile_(export_onnx(graph, check=False), spec), timing_feeds(graph))
