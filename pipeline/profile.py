"""Per-kernel time inside the compiled model (the Relax VM's instrument hook), slowest first: what says which
kernels dominate end to end, cold caches and call overheads included.  bench-model --profile prints it; the
untuned build's sanity floor (:mod:`pipeline.sanity`) reads it."""
from __future__ import annotations

import time
from dataclasses import dataclass

from graphopt.feeds import sample_feeds
from graphopt.fileio import signals_held
from kerneltune.targets.registry import device_for
from pipeline.compile import to_device


@dataclass
class KernelTime:
    name: str
    calls: int  # per model run
    ms: float  # total per model run


def profile_kernels(compiled, imported, runs: int = 3, seed: int = 0, samples: dict | None = None) -> list[KernelTime]:
    """Per-kernel time inside the VM (``set_instrument`` times each call in place), slowest first.

    This is what says which kernels dominate end to end, cold caches and call overheads included.
    """
    dev = device_for(compiled.spec)
    vm = compiled.vm()
    args = to_device(sample_feeds(imported.graph, samples, seed), compiled.input_names, dev)
    vm["main"](*args)  # warm-up outside the instrument
    total: dict[str, float] = {}
    calls: dict[str, int] = {}
    started: list[float] = []

    def instrument(func, name, before_run, ret_value, *args):
        if before_run:
            dev.sync()
            started.append(time.perf_counter())
        else:
            dev.sync()
            total[name] = total.get(name, 0.0) + time.perf_counter() - started.pop()
            calls[name] = calls.get(name, 0) + 1

    vm.set_instrument(instrument)
    # The timer is a Python callback inside the VM: a Ctrl-C raised there would come out of the VM as a
    # RuntimeError (an "internal error", not an interrupt), so it waits for the runs.
    with signals_held():
        for _ in range(runs):
            vm["main"](*args)
    out = [KernelTime(n, calls[n] // runs, total[n] / runs * 1e3) for n in total]
    return sorted(out, key=lambda k: -k.ms)
