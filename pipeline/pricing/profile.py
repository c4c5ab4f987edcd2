"""Per-kernel time inside the compiled model (the Relax VM's instrument hook): what says which kernels
dominate end to end, cold caches and call overheads included.  bench-model --profile prints it; the
untuned build's sanity floor (:mod:`pipeline.pricing.sanity`) reads it; run-model --profile maps it to the ONNX nodes
(:mod:`pipeline.pricing.layer_profile`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from graphopt.feeds import sample_feeds
from graphopt.fileio import signals_held
from kerneltune.targets.registry import device_for
from pipeline.compile import to_device


@dataclass
class KernelTime:
    name: str
    calls: int  # per model run
    ms: float  # total per model run


@dataclass
class CallTime:
    """One kernel call of a model run, in execution order."""

    name: str
    ms: float  # mean over the timed runs


def time_calls(vm, args: Sequence, dev, runs: int = 3) -> list[CallTime]:
    """Each kernel call of ``vm["main"](*args)`` timed in place (``set_instrument``: a device sync before and
    after the call), averaged over ``runs`` runs after one untimed run.  A run makes the same calls in the
    same order, so the k-th call of every run is the same call site."""
    vm["main"](*args)  # warm-up outside the instrument
    names: list[str] = []
    total: list[float] = []
    started: list[float] = []
    position = [0]

    def instrument(func, name, before_run, ret_value, *args):
        if before_run:
            dev.sync()
            started.append(time.perf_counter())
            return
        dev.sync()
        seconds = time.perf_counter() - started.pop()
        k = position[0]
        if k == len(names):
            names.append(str(name))
            total.append(0.0)
        total[k] += seconds
        position[0] = k + 1

    vm.set_instrument(instrument)
    # The timer is a Python callback inside the VM: a Ctrl-C raised there would come out of the VM as a
    # RuntimeError (an "internal error", not an interrupt), so it waits for the runs.
    with signals_held():
        for _ in range(runs):
            position[0] = 0
            vm["main"](*args)
    return [CallTime(n, t / runs * 1e3) for n, t in zip(names, total)]


def by_kernel(calls: list[CallTime]) -> list[KernelTime]:
    """Calls summed per kernel, slowest first."""
    ms: dict[str, float] = {}
    count: dict[str, int] = {}
    for c in calls:
        ms[c.name] = ms.get(c.name, 0.0) + c.ms
        count[c.name] = count.get(c.name, 0) + 1
    return sorted((KernelTime(n, count[n], ms[n]) for n in ms), key=lambda k: -k.ms)


def profile_kernels(compiled, imported, runs: int = 3, seed: int = 0, samples: dict | None = None) -> list[KernelTime]:
    """Per-kernel time inside the VM of a build in this process, slowest first."""
    dev = device_for(compiled.spec)
    args = to_device(sample_feeds(imported.graph, samples, seed), compiled.input_names, dev)
    return by_kernel(time_calls(compiled.vm(), args, dev, runs))


PREPACKED = "_prepacked"  # a kernel reading pre-packed weights (kerneltune.prepack) is its task's kernel


def by_task_name(kernels: list[KernelTime]) -> dict[str, float]:
    """The kernels' times (ms per run) by the name of the task they belong to: a pre-packed kernel counts
    for its task."""
    ms: dict[str, float] = {}
    for k in kernels:
        name = k.name.removesuffix(PREPACKED)
        ms[name] = ms.get(name, 0.0) + k.ms
    return ms


def task_times(compiled, imported, tasks, runs: int = 3, seed: int = 0,
               samples: dict | None = None) -> dict[int, float]:
    """Each task's time in one inference of the build, all its calls (ms), timed in place: what report.json's
    kernel table gives per task (the tuner's figures are each kernel alone, and only for tuned tasks)."""
    ms = by_task_name(profile_kernels(compiled, imported, runs, seed, samples))
    return {t.index: sum(ms.get(n, 0.0) for n in t.names) for t in tasks}
