"""A graph priced as the kernels TVM builds for it: the fusion-aware price of the graph stage.

graphopt's search adds up one-operator timings, which cannot see what Relax fuses: a bias, an activation or
a residual add costs nothing once it is a matmul's epilogue, a ``Split`` after a merged conv can cost a whole
copy, and two graphs with the same operator sum can build different kernels.  This price is taken on what
the pipeline really builds (Jia et al., TASO, SOSP'19, price each operator with the backend's own kernels;
here the backend's unit is the fused kernel): the graph is imported and fused exactly as the compiler does
(:func:`pipeline.relax_import.import_model`, then the partition the stage chain hands in: the heuristic
blocked conv layouts, as :func:`pipeline.stages.compile_model` times whole candidates), every fused kernel gets its default
schedule (:func:`pipeline.compile.schedule`), and each distinct kernel is built alone and timed cold
(:func:`time_cold`); the price is the sum over the model's kernel calls.

Kernels are keyed by the structural hash of their scheduled PrimFunc and cached on disk per CPU and thread
count (``~/.cache/optimize-model/kernels-<cpu>-t<threads>.json``, ``$OPTIMIZE_MODEL_CACHE``), so a candidate
that a rewrite changed in one place costs the import and partition plus the kernels it changed.

:func:`time_cold` is also what the layout stage prices its convs and transforms with
(:mod:`pipeline.layout.cost`): one call per timing after every argument but the first was flushed from the
caches, as inside a model a kernel's weights come from DRAM while its activation was just written.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from functools import partial, reduce
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import tvm
import tvm_ffi
from tvm import relax

from graphopt.cost.cache import CostCache, cache_dir
from graphopt.ir import Graph
from kerneltune import prepack
from kerneltune.machine_gate import built_in_batches, building, measuring
from kerneltune.native_log import quiet_native_stderr
from kerneltune.targets.host import host_cpu, num_cores
from kerneltune.targets.registry import TargetSpec
from kerneltune.targets.threads import tvm_num_threads
from kerneltune.task import build_func
from pipeline.compile import schedule
from pipeline.partition import Partition, partition
from pipeline.passes.int8 import lowering_for
from pipeline.relax_import import import_model, to_relax

VERSION = 2  # part of every cached key: bump it when kernels or timing change what a price means
# Timings per price: as many as fit in this many seconds, within these bounds (median taken).
TIMING_BUDGET_S = 0.25
MIN_REPEAT, MAX_REPEAT = 5, 25
# Kernels built side by side at a time when a price needs several (KernelPricer._measure).
MEASURE_BATCH = 8
# Graphs whose kernels are kept (KernelPricer._kernels): the input and the candidates compared with it.
RECENT_GRAPHS = 4
_RECENT: OrderedDict[tuple[str, str, str, str], list[tuple[str, str, int, object]]] = OrderedDict()


def time_cold(func: tvm.tirx.PrimFunc, spec: TargetSpec) -> float:
    """Seconds of one call of the scheduled kernel ``func``, built here, its weights packed the way the model
    packs them at build time, timed cold (median): :func:`cold_timer`, called once."""
    return cold_timer(func, spec)()


def cold_timer(func: tvm.tirx.PrimFunc, spec: TargetSpec) -> Callable[[], float]:
    """``func`` built and its inputs made (what can run beside another build), and the timing of one cold call
    (what runs alone).  Inputs are drawn in the kernel's logical shapes, then packed: drawn in the stripped
    kernel's packed shapes, the packing scattered them into a mostly uninitialized array (denormal garbage
    priced some blocked convs 100x too slow on an Intel Xeon).  Integer inputs are 0, a valid index for any
    axis."""
    params = list(func.params)
    func, packings = prepack.strip(func)
    with building(), quiet_native_stderr():
        lib = build_func(func, spec.target)
    rng = np.random.default_rng(0)
    shapes = [[int(s) for s in p.shape] for p in params]
    dtypes = [str(p.dtype) for p in params]
    inputs = [rng.uniform(-1, 1, s).astype(d) if d.startswith(("float", "bfloat")) else np.zeros(s, d)
              for s, d in zip(shapes[:-1], dtypes[:-1])]
    inputs = prepack.pack_inputs(inputs, packings)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    args.append(tvm.runtime.empty(shapes[-1], dtypes[-1], dev))

    def timed() -> float:
        with measuring():  # alone on the machine, not beside another build (kerneltune.machine_gate)
            probe = float(lib.time_evaluator("main", dev, number=1, repeat=1)(*args).mean)
            repeat = max(MIN_REPEAT, min(MAX_REPEAT, int(TIMING_BUDGET_S / max(probe, 1e-7))))
            timer = lib.time_evaluator("main", dev, number=1, repeat=repeat,
                                       f_preproc="cache_flush_cpu_non_first_arg")
            return float(np.median(timer(*args).results))
    return timed


@dataclass(frozen=True)
class KernelPrice:
    """One distinct fused kernel of a model, timed alone."""

    name: str  # the fused PrimFunc's name (first call)
    calls: int  # per model run
    seconds: float  # one call, cold


@dataclass
class GraphPrice:
    """A model's price: its kernels (or, compared with other models, those they do not all share)."""

    kernels: list[KernelPrice] = field(default_factory=list)
    measured: int = 0  # kernels timed for this price (0: every one was cached)

    @property
    def seconds(self) -> float:
        return sum(k.calls * k.seconds for k in self.kernels)


class KernelPricer:
    """Prices ONNX models as their fused kernels (see the module docstring), measured on first use and cached."""

    def __init__(self, spec: TargetSpec, path: str | Path | None = None,
                 partition_fn: Callable[[tvm.IRModule], Partition] | None = None, partition_key: str | None = None):
        self.spec = spec
        # how a module is cut into kernels: handed in (the stage chain's layout, then the partition), since the
        # layout stage prices with this module's timer; None: the partition as imported
        self.partition_fn = partition_fn or partition
        # names partition_fn (e.g. "layout=nchwc") so that a graph's kernels can be remembered; None: never
        self.partition_key = partition_key
        threads = tvm_num_threads(num_cores(spec.target))  # what this process's kernels really run with
        self.cache = CostCache(Path(path) if path else cache_dir() / f"kernels-{host_cpu()}-t{threads}.json")
        # code built for another -mcpu runs at another speed here: the target is part of every key
        self._target = hashlib.sha1(str(spec.target).encode()).hexdigest()[:10]

    def _kernels(self, model: onnx.ModelProto, graph: Graph | None) -> list[tuple[str, str, int, object]]:
        """(key, name, calls, scheduled PrimFunc) of each distinct fused kernel of the model.  With the graph IR
        and a ``partition_key``, remembered for the last :data:`RECENT_GRAPHS` graphs of the process: the graph
        stage compares the same input with each candidate (the search's result, the merge-everything graph,
        each Winograd layer), and importing, partitioning and scheduling BERT-base took 2.6 s a time (Intel
        Xeon, 2 cores)."""
        if graph is None or self.partition_key is None:
            return self._build_kernels(model, graph)
        # the structural hash names inputs, not their sizes
        sizes = repr([(t.name, t.dtype, t.shape) for t in graph.inputs])
        key = (repr(self.spec), self.partition_key, sizes, graph.structural_hash())
        if key not in _RECENT:
            _RECENT[key] = self._build_kernels(model, graph)
            while len(_RECENT) > RECENT_GRAPHS:
                _RECENT.popitem(last=False)
        _RECENT.move_to_end(key)
        return _RECENT[key]

    def _build_kernels(self, model: onnx.ModelProto, graph: Graph | None) -> list[tuple[str, str, int, object]]:
        int8 = lowering_for(self.spec)  # as the build imports it (pipeline.stages.lower)
        part = self.partition_fn(import_model(model, int8=int8).mod if graph is None
                                 else to_relax(model, graph, int8=int8))
        scheduled, _ = schedule(part, self.spec)
        out = []
        for task in part.tasks:
            func = scheduled[task.names[0]]
            if relax.analysis.has_reshape_pattern(func):
                # relax.build's RewriteDataflowReshape makes it a view of its input (vm.builtin.reshape): no
                # kernel runs (the Winograd rewrite's reshapes between matmuls priced 0.13 ms each otherwise)
                continue
            key = f"v{VERSION}|{self._target}|{tvm_ffi.structural_hash(func) & 0xFFFFFFFFFFFFFFFF:x}"
            out.append((key, task.name, task.weight, func))
        return out

    def _seconds(self, key: str, func, price: GraphPrice) -> float:
        seconds = self.cache.get(key)
        if seconds is None:
            seconds = time_cold(func, self.spec)
            self.cache.put(key, seconds)
            price.measured += 1
        return seconds

    def price(self, model: onnx.ModelProto, graph: Graph | None = None) -> GraphPrice:
        """The model's kernels with their prices; the model must have static input shapes.  ``graph``: the
        model's graph IR, already legalized for TVM (the graph stage's): then only TVM's importer runs, not
        the checks, shape inference and legalization of :func:`~pipeline.relax_import.import_model` (2.5 of
        the 4.5 s a BERT-base import takes)."""
        return self.compare([(model, graph)])[0]

    def compare(self, models: list[tuple[onnx.ModelProto, Graph | None]], retime: bool = False) -> list[GraphPrice]:
        """Each model's price over the kernel calls the models do not all share (all of them for one model):
        what a rewrite changed, with the kernels it left alone cancelled out rather than built and timed (on
        a cold cache they are most of the time: Inception-v3 has 64 distinct kernels, a merge changes 2-4).
        ``retime``: those kernels timed again even when cached, each kept at the faster of its two timings.
        One cold timing can land beside an interruption: BERT-base's merged Q/K/V priced 0.42 ms under the
        input's in one run and 0.94 in another, where the gate needs 1.15 (Intel Xeon, 2 cores); the faster of
        two is the kernel's speed, and a candidate that passed on one slow timing of the input is stopped
        before two whole models are built."""
        kernels = [self._kernels(m, g) for m, g in models]
        calls = [Counter() for _ in kernels]
        for c, ks in zip(calls, kernels):
            for key, _, n, _ in ks:
                c[key] += n
        shared = reduce(lambda a, b: a & b, calls) if len(calls) > 1 else Counter()
        fresh = self._measure({key: func for c, ks in zip(calls, kernels) for key, _, _, func in ks
                               if c[key] > shared[key] and (retime or self.cache.get(key) is None)})
        out = []
        for c, ks in zip(calls, kernels):
            price = GraphPrice()
            for key, name, _, func in ks:
                if c[key] > shared[key]:
                    price.kernels.append(KernelPrice(name, c[key] - shared[key], self._seconds(key, func, price)))
                    price.measured += key in fresh
                    c[key] = shared[key]  # a kernel listed twice (two names, one structure) counted once
            out.append(price)
        self.cache.flush()
        return out

    def _measure(self, todo: dict[str, object]) -> set[str]:
        """Time the kernels of ``todo`` (key -> scheduled PrimFunc), in batches built side by side
        (:func:`kerneltune.machine_gate.built_in_batches`: builds are most of a cold price) and timed alone,
        in turn; few enough at once that their inputs are not all held together; a kernel timed before keeps
        the faster timing.  Returns the keys timed."""
        timers = built_in_batches([partial(cold_timer, func, self.spec) for func in todo.values()], MEASURE_BATCH)
        for key, timer in zip(todo, timers):
            before = self.cache.get(key)  # timed again (compare's retime): the faster timing stands
            seconds = timer()
            self.cache.put(key, seconds if before is None else min(before, seconds))
        return set(todo)
