"""Measured cost: each distinct (operator, parameters, input shapes) timed once on this machine as a tiny
ONNX model by an injected :class:`~graphopt.cost.runners.GraphRunner`, and cached on disk per target, CPU,
engine (with the CPU its code is generated for), thread count and tool version
(``~/.cache/optimize-model/cost-<target>-<cpu>-<engine>-t<threads>-v<version>.json``;
:func:`graphopt.cost.cache.cpu_id`), as TASO/MetaFlow do with cuDNN.  The version is in the key because a new
release compiles operators differently (schedules, legalizations, pinned engines): its costs start afresh
instead of trusting timings of code it no longer generates.

Past the stage's deadline (:meth:`MeasuredCost.set_deadline`) nothing new is measured: an operator not in
the cache is priced by the roofline estimate (:class:`~graphopt.cost.analytic.AnalyticCost`), not cached,
and counted in ``estimated`` - a TVM compile per new operator must not run the stage past ``--time-limit``.

With the pipeline's TVM runner the search optimizes for the code the pipeline will really run; an operator
that engine cannot run alone is timed with onnxruntime instead.

Timing of one operator (:func:`best_time`): warm up, then batches of runs of ~20 ms, best of 3 batches;
the time of a trivial model (the fixed cost of one call from Python) is subtracted so that graphs with more,
smaller nodes are not overcharged for Python overhead that the real run does not pay.

:meth:`MeasuredCost.time_models` times whole graphs with the same engine through the project's one
whole-model timer (:func:`graphopt.timing.time_blocks`), so the graph stage can check that a graph the
per-operator sum prefers really runs faster end to end; each graph is built once per instance (the stage
times the input against several candidates, block after block).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from graphopt import ops
from graphopt.cost.analysis import numel
from graphopt.cost.analytic import AnalyticCost
from graphopt.cost.base import LAUNCH_OVERHEAD_S, CostModel, ModelTimes, Shape, params_key
from graphopt.console import version
from graphopt.cost.cache import CostCache, cache_dir, cpu_id, non_negative
from graphopt.cost.runners import GraphRunner, OrtRunner
from graphopt.ir import Graph, Node, TensorInfo, attrs_key
from graphopt.timing import WARMUP, time_blocks
from graphopt.verdicts import VerdictStore, Verdicts, default_store

# Untimed calls of a whole model before each round of :meth:`MeasuredCost.time_models`: the other model ran
# just before, so one call brings back its caches; the first calls of a new build (allocation, page faults)
# are made once, when it is built.  Three per round made half of ResNet-50's end-to-end check untimed calls.
ROUND_WARMUP = 1
# One-operator graphs :meth:`MeasuredCost.prefetch` builds at once: enough for the cores of a small machine to
# build side by side, few enough that their weights are not all held together (VGG-19's first classifier
# layer alone is 411 MB).
PREFETCH_BATCH = 4

SMALL_CONST = 64  # constant inputs up to this many elements are part of the key and embedded (shapes, axes)


class MeasuredCost(CostModel):
    """Times each distinct operator once with ``runner``, cached on disk per target, engine and threads."""

    name = "measured"

    def __init__(self, runner: GraphRunner, target: str = "llvm", path: str | Path | None = None,
                 verdicts: VerdictStore | None = None):
        self.runner = runner
        self.target = target
        self.backend = runner.name
        self.threads = runner.threads
        self.name = f"measured-{self.backend}"
        # onnxruntime runs every ONNX operator: the fallback for what the runner's engine cannot build alone
        self._fallback = runner if isinstance(runner, OrtRunner) else OrtRunner(runner.threads)
        self.cache = CostCache(Path(path) if path else cache_dir() / cache_file(target, runner.cache_tag,
                                                                                   self.threads))
        # the end-to-end verdicts (graphopt.verdicts)
        self._verdicts = Verdicts(verdicts or default_store(), f"graph|{target}|{self.backend}|t{self.threads}")
        self._baseline: float | None = None
        self.measured = 0  # how many timings this instance ran (0 on a warm cache)
        self.estimated = 0  # how many prices were estimated because the deadline had passed
        self.deadline: float | None = None
        self._analytic: AnalyticCost | None = None
        self._prepared: dict[tuple[str, str], Callable[[], object]] = {}  # (engine, graph hash) -> one run
        self._collect: dict[str, Callable[[], Graph]] | None = None  # prefetch's unpriced keys while it walks

    def flush(self) -> None:
        self.cache.flush()

    def set_deadline(self, deadline: float | None) -> None:
        self.deadline = deadline

    @property
    def verdicts(self) -> Verdicts:
        return self._verdicts

    def _estimate(self) -> AnalyticCost:
        if self._analytic is None:
            self._analytic = AnalyticCost()
        return self._analytic

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def _lookup(self, key: str, build: Callable[[], Graph], estimate: Callable[[], float]) -> float:
        hit = self.cache.get(key)
        if hit is None and self._collect is not None:  # prefetch's walk: note it, price it later
            self._collect.setdefault(key, build)
            return 0.0
        if hit is None:
            if self._past_deadline():
                self.estimated += 1
                return estimate()
            hit = self._time(build())
            self.cache.put(key, hit)
            self.measured += 1
        return hit

    # ---- pricing -------------------------------------------------------------------------------------------
    def op_cost(self, op: str, params: dict[str, Any], in_shapes: Sequence[Shape], dtype: str = "float32") -> float:
        key = f"op|{op}|{params_key(params)}|{[tuple(s) for s in in_shapes]}|{dtype}"

        def build() -> Graph:
            inputs = [TensorInfo(f"i{k}", dtype, tuple(s)) for k, s in enumerate(in_shapes)]
            out_shapes = ops.infer_shape(op, params, [tuple(s) for s in in_shapes])
            outputs = [TensorInfo(f"o{k}", dtype, tuple(s)) for k, s in enumerate(out_shapes)]
            g = Graph(nodes=[], inputs=inputs, outputs=outputs, opset_imports={"": 17})
            g.nodes = ops.to_onnx(op, params, [i.name for i in inputs], [o.name for o in outputs], g)
            return g

        return self._lookup(key, build, lambda: self._estimate().op_cost(op, params, in_shapes, dtype))

    def opaque_cost(self, node: Node, graph: Graph) -> float:
        const = [t for t in node.inputs if t and graph.is_constant(t)
                 and (numel(graph.shape(t)) or SMALL_CONST + 1) <= SMALL_CONST]
        parts = []
        for t in node.inputs:
            info = graph.tensor(t) if t else None
            if not t:
                parts.append("-")
            elif t in const:
                parts.append("c" + repr(graph.initializers[t].tolist()))
            else:
                parts.append(f"{info.dtype}{info.shape}" if info else "?")
        out_info = [graph.tensor(o) for o in node.outputs if o]
        outs = [f"{o.dtype}{o.shape}" if o else "?" for o in out_info]
        key = f"node|{node.domain}:{node.op_type}|{attrs_key(node.attrs)}|{parts}|{outs}"
        if any(o is None or o.shape is None for o in out_info) or any(
                (graph.tensor(t) is None or not graph.tensor(t).is_static) for t in node.inputs if t):
            return AnalyticCost().opaque_cost(node, graph)  # unknown shapes: cannot build a timing model

        def build() -> Graph:
            inputs, inits = [], {}
            names = []
            for k, t in enumerate(node.inputs):
                if not t:
                    names.append("")
                    continue
                name = f"i{k}"
                names.append(name)
                if t in const:
                    inits[name] = graph.initializers[t]
                else:
                    info = graph.tensor(t)
                    inputs.append(TensorInfo(name, info.dtype, tuple(info.shape)))
            outputs = [TensorInfo(f"o{k}", o.dtype, o.shape) for k, o in enumerate(out_info)]
            n = Node(node.op_type, names, [o.name for o in outputs], dict(node.attrs), "n", node.domain,
                     dict(node.attr_types))
            return Graph(nodes=[n], inputs=inputs, outputs=outputs, initializers=inits,
                         opset_imports=dict(graph.opset_imports), ir_version=graph.ir_version,
                         functions=list(graph.functions))

        return self._lookup(key, build, lambda: self._estimate().opaque_cost(node, graph))

    def prefetch(self, graph: Graph) -> None:
        """Price every operator of ``graph`` not priced yet, all at once: their one-operator graphs built side by
        side (:meth:`GraphRunner.prepare_many`), then each timed alone, in turn, until the deadline.  The search
        then finds its input's prices cached (ResNet-50's 37 operators: 4.7 s on 2 cores, the search 3.1 s after
        it).  One that neither engine builds is left to the search (which prices it the usual way)."""
        if self._past_deadline():
            return
        missing: dict[str, Callable[[], Graph]] = {}
        self._collect = missing
        try:
            CostModel.graph_cost(self, graph)  # every operator's key, through the pricing path the search takes
        finally:
            self._collect = None
        keys, graphs = [], []
        for key, build in missing.items():
            try:
                graphs.append(build())
                keys.append(key)
            except Exception:  # noqa: BLE001 - the search meets the same failure and prices it by estimate
                continue
        for start in range(0, len(graphs), PREFETCH_BATCH):
            batch = graphs[start:start + PREFETCH_BATCH]
            if self._past_deadline():
                break
            prepared = self.runner.prepare_many(batch) if self.runner is not self._fallback else [None] * len(batch)
            for key, graph, call in zip(keys[start:], batch, prepared):
                if self._past_deadline():
                    break
                try:
                    seconds = self._time(graph, None if isinstance(call, Exception) else call)
                except Exception:  # noqa: BLE001 - as above
                    continue
                self.cache.put(key, seconds)
                self.measured += 1
        self.cache.flush()

    # ---- timing --------------------------------------------------------------------------------------------
    def _run_time(self, graph: Graph, call: Callable[[], object] | None = None) -> float:
        """Seconds per run of ``graph`` (``call``: its engine build, when made already) with this model's engine,
        else onnxruntime."""
        if self.runner is not self._fallback:
            try:
                return best_time(call or self.runner.prepare(graph))
            except Exception:  # noqa: BLE001 - an op the engine cannot build alone is still priced, by onnxruntime
                pass
        return best_time(self._fallback.prepare(graph))

    def time_models(self, graphs: Sequence[Graph], runs: int = 20) -> ModelTimes:
        """Whole models, timed with this model's engine; if it cannot build one of them, all of them are
        timed in onnxruntime, so the comparison is always between like and like."""
        runner: GraphRunner = self.runner
        hashes = [g.structural_hash() for g in graphs]
        try:
            calls = self._prepare_models(runner, graphs, hashes)
        except Exception:  # noqa: BLE001 - fall back to the engine that runs every ONNX model
            if runner is self._fallback:
                raise
            runner = self._fallback
            calls = self._prepare_models(runner, graphs, hashes)
        # one engine: no other's workers to wait out; each model was warmed once when it was built (_prepare_models)
        times = time_blocks(dict(enumerate(calls)), runs, warmup=ROUND_WARMUP, gap_s=0.0)
        return ModelTimes([times[i].median_ms / 1e3 for i in range(len(calls))], runner.name)

    def kernel_times(self, graphs: Sequence[Graph], confirm: bool = False) -> list[float] | None:
        """The runner's fusion-aware prices of ``graphs``, recorded under their hashes (the confirmed ones
        apart): the same graphs are priced once per cache, and a rerun decides the same way."""
        # "kernels2": priced in the blocked conv layouts the product builds (the first prices were as imported)
        kind = "kernels2c" if confirm else "kernels2"
        keys = [f"{kind}|{'|'.join(g.structural_hash() for g in graphs)}|{i}" for i in range(len(graphs))]
        hits = [self.cache.get(k, non_negative) for k in keys]
        if any(h is None for h in hits):
            hits = self.runner.kernel_times(graphs, confirm)
            if hits is None:
                return None
            for k, h in zip(keys, hits):
                self.cache.put(k, h)
            self.cache.flush()
        return list(hits)

    def blocked_winograd(self) -> bool:
        return self.runner.blocked_winograd

    def _prepare_models(self, runner: GraphRunner, graphs: Sequence[Graph],
                        digests: Sequence[str]) -> list[Callable[[], object]]:
        """Each whole graph built once per stage (those not built yet together: :meth:`GraphRunner.prepare_models`)
        and warmed once when built."""
        keys = [(runner.name, d) for d in digests]
        todo = {k: g for k, g in zip(keys, graphs) if k not in self._prepared}
        for k, call in zip(todo, runner.prepare_models(list(todo.values()))):
            for _ in range(WARMUP):  # the first calls allocate and fault pages in: once per build
                call()
            self._prepared[k] = call
        return [self._prepared[k] for k in keys]

    def _time(self, graph: Graph, call: Callable[[], object] | None = None) -> float:
        if self._baseline is None:
            self._baseline = self.cache.get("baseline")
            if self._baseline is None:
                g = Graph(nodes=[Node("Identity", ["i0"], ["o0"], name="n")],
                          inputs=[TensorInfo("i0", "float32", (1,))], outputs=[TensorInfo("o0", "float32", (1,))])
                self._baseline = self._run_time(g)
                self.cache.put("baseline", self._baseline)
        return max(self._run_time(graph, call) - self._baseline, 0.0) + LAUNCH_OVERHEAD_S


def cache_file(target: str, backend: str, threads: int) -> str:
    """The cost cache's file name: one per target, CPU (:func:`~graphopt.cost.cache.cpu_id`), engine (with the
    CPU its code is built for, :attr:`~graphopt.cost.runners.GraphRunner.cache_tag`), thread count and tool
    version - the things a per-operator timing depends on beyond the operator itself."""
    return f"cost-{target}-{cpu_id()}-{backend}-t{threads}-v{version()}.json"


def best_time(run: Callable[[], object]) -> float:
    """Seconds per call of ``run``: warm-up, then the best of 3 batches of about 20 ms each (one operator;
    whole models go through :func:`graphopt.timing.time_blocks`)."""
    run()
    t = time.perf_counter()
    run()
    once = time.perf_counter() - t
    reps = max(3, min(1000, int(0.02 / max(once, 1e-7))))
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            run()
        best = min(best, (time.perf_counter() - t) / reps)
    return best
