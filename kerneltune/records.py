"""Append-only JSON-lines tuning records: what makes tuning resumable and crash-safe.

One line per measured config: ``{"task", "target", "config", "latency_s", "gflops", "error", "time", ...}``.
Every line is flushed and fsync'd as soon as its result is known, so a run killed with SIGKILL loses at most
the batch that was being measured.  A kill can leave a half-written last line; loading skips any line that
is not a complete record (with a warning) and the next append starts on a fresh line so the damage never
spreads to new records.  One file may hold many tasks and targets (a model's tuning run): readers filter by
``(task, target, timing)``: latencies taken with warm caches and with flushed ones (``timing`` "warm" /
"cold", see :mod:`kerneltune.measure`) are not comparable, so one never resumes the other.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

REQUIRED = ("task", "target", "config", "gflops")


@dataclass
class Record:
    task: str                       # the task key (operator, shape, epilogue)
    target: str                     # the target, as the tuner names it
    config: dict[str, Any]          # knob name -> value (tuples become lists in JSON)
    gflops: float                   # 0 for a failure
    latency_s: float | None = None  # None for a failure
    error: str | None = None        # why it failed, None when it ran
    time: float = 0.0               # unix time the result was recorded
    extra: dict[str, Any] = field(default_factory=dict)   # build_s, run_s, searcher, ...
    timing: str = "warm"            # "warm" or "cold" (caches flushed before each call)

    def to_line(self) -> str:
        d = asdict(self)
        d.update(d.pop("extra"))
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Record":
        known = {k: d[k] for k in ("task", "target", "config", "gflops", "latency_s", "error", "time", "timing")
                 if k in d}
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**known, extra=extra)


class RecordLog:
    """A records file: :meth:`load` reads it tolerantly, :meth:`append` writes durably."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fh = None

    def load(self, task: str | None = None, target: str | None = None, timing: str | None = None) -> list[Record]:
        """Records in file order, optionally only those of one task/target/timing; bad lines skipped with a
        warning."""
        if not self.path.exists():
            return []
        out = []
        with open(self.path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    d = json.loads(raw)
                    if not isinstance(d, dict) or any(k not in d for k in REQUIRED):
                        raise ValueError("missing fields")
                    rec = Record.from_dict(d)
                except (ValueError, TypeError, UnicodeDecodeError) as exc:
                    log.warning("warning: %s line %d is not a complete tuning record (%s); skipped",
                                self.path, lineno, str(exc)[:80])
                    continue
                if ((task is None or rec.task == task) and (target is None or rec.target == target)
                        and (timing is None or rec.timing == timing)):
                    out.append(rec)
        return out

    def append(self, records: Iterable[Record]) -> None:
        """Write each record as one line, flushed and fsync'd before the next."""
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "ab")
            if self._fh.tell() > 0 and not self._ends_with_newline():
                self._fh.write(b"\n")   # isolate a half-written line left by a killed run
        for rec in records:
            self._fh.write(rec.to_line().encode() + b"\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "RecordLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
