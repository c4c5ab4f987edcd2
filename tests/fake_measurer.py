"""A stand-in for :class:`kerneltune.measure.Measurer` in the tuning tests: the task's default config takes
1 ms and every other config ``lo``..``lo + 1`` ms, a fixed function of the config, so a test can check the
tuner's bookkeeping (budgets, records, resumes, which build ships) exactly and without timing anything.

Tests subclass it: ``lo`` sets how good the tuned configs are, :meth:`seen` counts calls or interrupts a
run, :meth:`key` chooses what the latency hashes."""
from __future__ import annotations

import zlib
from types import SimpleNamespace

from kerneltune import templates


class FakeMeasurer:
    lo = 0.4  # configs other than the default take lo..lo+1 ms (below 1: many beat the default)

    def __init__(self, target, rpc):
        self.target = target

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def key(self, task, config) -> str:
        return repr(config)

    def seen(self, task, configs) -> None:
        """Called once per measure call, before anything is measured."""

    def latency(self, task, config, default) -> float:
        if config == default:
            return 1e-3
        return (self.lo + zlib.crc32(self.key(task, config).encode()) % 1000 / 1000) * 1e-3

    def measure(self, task, configs):
        self.seen(task, configs)
        default = templates.default_config(task, self.target)
        out = []
        for c in configs:
            lat = self.latency(task, c, default)
            out.append(SimpleNamespace(gflops=task.flops / lat / 1e9, latency_s=lat, error=None))
        return out
