"""Measured prices for the layout search: one convolution in one layout at its template default config, and
one layout transform of one tensor; cached on disk per CPU and thread count.

Each price comes from the code the pipeline really runs: a one-operator Relax module goes through the same
lowering (:mod:`pipeline.layout.nchwc` for blocked convs), fusion (:func:`pipeline.partition.partition`) and
scheduling (:func:`pipeline.compile.schedule`: the template's default config, or the CPU rules for a
transform or a kernel no template covers); the scheduled kernel is built in this process (0.1-0.5 s) and
timed cold by :func:`pipeline.pricing.kernel_price.cold_timer` (the graph stage's kernel prices use it too): its weight
packed the way the model packs it at build time, one call per timing after every argument but the
activation was flushed from the caches (inside a model a conv's weights come from DRAM), the median taken.

Prices are cached in ``~/.cache/optimize-model/layout-<cpu>-t<threads>.json`` (``$OPTIMIZE_MODEL_CACHE``):
a decision is taken once per machine and then read back, so the same command makes the same decision
(:mod:`pipeline.layout.search` also leaves close calls to a fixed preference order).  :data:`VERSION` is
part of every key: bump it when kernels or timing change what a price means.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import tvm
from tvm import relax

from graphopt.cost.cache import CostCache, cache_dir, flag
from graphopt.verdicts import VerdictStore, Verdicts, default_store
from kerneltune.machine_gate import built_in_batches, serial
from kerneltune.templates import conv_nchwc
from kerneltune.targets.host import host_cpu, num_cores
from kerneltune.targets.registry import TargetSpec
from kerneltune.targets.threads import tvm_num_threads
from pipeline.layout import nchwc
from pipeline.compile import schedule
from pipeline.pricing.kernel_price import MEASURE_BATCH, cold_timer
from pipeline.partition import partition

# 3: NCHW depthwise convs inline their padding, stride-2 convs read it as phases (cpu template defaults);
# 2: inputs packed from their logical shapes (1 priced garbage inputs)
VERSION = 3

Block = "int | None"  # a channel block; None is plain NCHW


@dataclass(frozen=True)
class ConvOption:
    """How one conv can run: input block ``a`` and output block ``d`` (None, None: the NCHW kernel), with
    its groups merged ``merge`` at a time first (:func:`kerneltune.templates.conv_nchwc.merge_groups`)."""

    a: int | None
    d: int | None
    merge: int = 1

    @property
    def nchw(self) -> bool:
        return self.a is None

    def label(self) -> str:
        if self.nchw:
            return "nchw"
        return f"{self.a}c>{self.d}c" + (f"/merge{self.merge}" if self.merge > 1 else "")


def _conv_key(spec: conv_nchwc.ConvSpec) -> str:
    return (f"{spec.n}x{spec.c}x{spec.h}x{spec.w}-f{spec.f}-k{spec.kh}x{spec.kw}-s{spec.stride[0]}x{spec.stride[1]}"
            f"-p{'.'.join(map(str, spec.pad))}-d{spec.dilation[0]}x{spec.dilation[1]}-g{spec.groups}-{spec.dtype}")


def _conv_price_key(spec: conv_nchwc.ConvSpec, option: ConvOption) -> str:
    return f"conv|{_conv_key(spec)}|{option.label()}"


def _block_name(b: int | None) -> str:
    return "nchw" if b is None else f"{b}c"


class Pricer:
    """Prices in seconds, measured on first use and cached (see the module docstring)."""

    def __init__(self, spec: TargetSpec, path: str | Path | None = None, verdicts: VerdictStore | None = None):
        self.spec = spec
        threads = tvm_num_threads(num_cores(spec.target))  # what this process's kernels really run with
        self.cache = CostCache(Path(path) if path else cache_dir() / f"layout-{host_cpu()}-t{threads}.json")
        # the whole-model verdicts of the layout search (graphopt.verdicts)
        self.verdicts = Verdicts(verdicts or default_store(), f"layout|v{VERSION}|{spec.target}|t{threads}")
        self.measured = 0  # prices measured by this instance (0 on a warm cache)
        self.looked_up = 0
        self._pending: dict[str, Callable[[], tvm.IRModule]] | None = None  # inside batch(): prices to measure

    def flush(self) -> None:
        self.cache.flush()

    def _price(self, key: str, make) -> float:
        key = f"v{VERSION}|{key}"
        hit = self.cache.get(key)
        if self._pending is not None:  # batch(): noted, priced when the batch ends
            if hit is None:
                self._pending.setdefault(key, make)
            return 0.0 if hit is None else hit
        self.looked_up += 1
        if hit is None:
            hit = self._time(make())
            self.measured += 1
            self.cache.put(key, hit)
        return hit

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Prices asked for inside are noted (each 0 there) and measured when the block ends, their kernels
        built side by side and timed alone, in turn (:mod:`kerneltune.machine_gate`): the layout search walks
        its problem once so, then again with every price cached.  A price that fails here is left to the
        second walk, which meets the failure as before."""
        self._pending = {}
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
        timers = built_in_batches([partial(self._timer_or_failure, make) for make in pending.values()],
                                  MEASURE_BATCH)
        for key, timer in zip(pending, timers):
            if not isinstance(timer, Exception):
                self.cache.put(key, timer())
                self.measured += 1
        self.flush()

    def _timer_or_failure(self, make) -> Callable[[], float] | Exception:
        try:
            with serial():  # the module is made with TVM's Python side (legalization)
                mod = make()
            return self._timer(mod)
        except Exception as exc:  # noqa: BLE001 - priced again outside the batch, where it fails as before
            return exc

    def conv(self, spec: conv_nchwc.ConvSpec, option: ConvOption) -> float:
        """Seconds of one call of the conv (``spec``'s logical shape) run as ``option``."""
        return self._price(_conv_price_key(spec, option), lambda: conv_module(spec, option))

    def confirm_conv(self, spec: conv_nchwc.ConvSpec, option: ConvOption) -> bool:
        """Time the conv as ``option`` once more and keep the mean of the two timings as its price, once per
        price (the cache remembers it): a decision that turns on this price then rests on two timings, not on
        one cold run's noise.  True when it was timed now."""
        key = f"v{VERSION}|{_conv_price_key(spec, option)}"
        if self.cache.get(key + "|confirmed", flag):
            return False
        first = self.conv(spec, option)
        self.cache.put(key, (first + self._time(conv_module(spec, option))) / 2)
        self.cache.put(key + "|confirmed", 1.0)
        self.measured += 1
        return True

    def transform(self, shape: tuple[int, ...], src: int | None, dst: int | None) -> float:
        """Seconds of one layout transform of the NCHW tensor ``shape`` from block ``src`` to ``dst``."""
        if src == dst:
            return 0.0
        key = f"transform|{'x'.join(map(str, shape))}|{_block_name(src)}>{_block_name(dst)}"
        return self._price(key, lambda: transform_module(shape, src, dst))

    def _time(self, mod: tvm.IRModule) -> float:
        """Schedule the module's one kernel as the pipeline does, build it here and time it cold."""
        return self._timer(mod)()

    def _timer(self, mod: tvm.IRModule) -> Callable[[], float]:
        """The module's one kernel scheduled as the pipeline does and built here (:func:`cold_timer`)."""
        with serial():  # TVM's Python side (kerneltune.machine_gate)
            part = partition(mod)
            scheduled, _ = schedule(part, self.spec)
        func = scheduled[part.tasks[-1].names[0]] if part.tasks else None
        if func is None:
            raise ValueError("nothing to price: the module has no kernel")
        return cold_timer(func, self.spec)


def _weight(spec: conv_nchwc.ConvSpec) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.uniform(-0.1, 0.1, spec.weight_shape).astype(spec.dtype)


def conv_module(spec: conv_nchwc.ConvSpec, option: ConvOption) -> tvm.IRModule:
    """``main(data) -> conv(data, constant weight)`` with the conv run as ``option``."""
    w = _weight(spec)
    if option.nchw:
        bb = relax.BlockBuilder()
        x = relax.Var("data", relax.TensorType((spec.n, spec.c, spec.h, spec.w), spec.dtype))
        with bb.function("main", [x]):
            with bb.dataflow():
                y = bb.emit_output(relax.op.nn.conv2d(x, relax.const(w), strides=spec.stride, padding=spec.pad,
                                                      dilation=spec.dilation, groups=spec.groups))
            bb.emit_func_output(y)
        return bb.get()
    groups = spec.groups
    if option.merge > 1:
        w = conv_nchwc.merge_groups(w, groups, option.merge)
        groups //= option.merge
    blocked = replace(spec, groups=groups, ic_block=option.a, oc_block=option.d)
    mod = conv_nchwc.make_relax(blocked, "none")
    mod = relax.transform.BindParams("main", {"weight": w})(mod)
    return nchwc._LowerBlockedConvs(mod).transform()


def _index_map(src: int | None, dst: int | None):
    if src is None:
        return lambda n, c, h, w: (n, c // dst, h, w, c % dst)
    if dst is None:
        return lambda n, cb, h, w, ci: (n, cb * src + ci, h, w)
    return lambda n, cb, h, w, ci: (n, (cb * src + ci) // dst, h, w, (cb * src + ci) % dst)


def transform_module(shape: tuple[int, ...], src: int | None, dst: int | None) -> tvm.IRModule:
    """``main(x) -> layout_transform(x)`` of the NCHW tensor ``shape`` held in block ``src``, to ``dst``."""
    n, c, h, w = shape
    held = (n, c, h, w) if src is None else (n, c // src, h, w, src)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(held, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.layout_transform(x, index_map=_index_map(src, dst)))
        bb.emit_func_output(y)
    return bb.get()
