"""Append-only JSON-lines tuning records: what makes tuning resumable and crash-safe.

One line per measured config: ``{"task", "target", "config", "latency_s", "gflops", "error", "failure",
"time", "timing", ...}``.  Every line is flushed and fsync'd as soon as its result is known, so a run killed
with SIGKILL loses at most the batch that was being measured.  A kill can leave a half-written last line;
loading skips any line that is not a complete record (with a warning) and the next append starts on a fresh
line so the damage never spreads to new records.  One file may hold many tasks and targets (a model's
tuning run): readers filter by ``(task, target, timing)``: latencies taken with warm caches and with flushed
ones (``timing`` "warm" / "cold", see :mod:`kerneltune.measure`) are not comparable, so one never resumes
the other.

``failure`` says whose fault a failed measurement was (:mod:`kerneltune.failures`): a "config" failure is
final, an "environment" one is measured again when the run resumes.  Lines of another ``kind`` than
``"trial"`` (the end-to-end verdicts earlier versions kept here; they live in :mod:`graphopt.verdicts` now)
are never results: loading skips them.

Trust: a records file is input like any other.  Loading checks every line's types and internal consistency
(:func:`problem`) and skips a bad one with a warning; the tuner also checks a record against its task
(:func:`kerneltune.tune.ResultCache`: GFLOP/s consistent with the task's FLOPs and the latency, below the
target's ceiling), so a forged or corrupt line can never become a task's "best".

One tuner per file: a writer holds an exclusive ``flock`` on the file for its whole run (:meth:`RecordLog.acquire`).
Two tuners measuring at once would skew each other's timings on a shared machine and store them; the
second one waits up to :data:`LOCK_WAIT_S` and then refuses with one line naming the holder's PID.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from graphopt.errors import UserError
from graphopt.fileio import lock_holder
from kerneltune.failures import CONFIG, ENVIRONMENT, classify

log = logging.getLogger(__name__)

REQUIRED = ("task", "target", "config", "gflops")
TRIAL = "trial"
LOCK_WAIT_S = 5.0  # a finishing run releases the file within seconds; a running one holds it for its whole run


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
    failure: str | None = None      # None (it ran), "config" or "environment" (kerneltune.failures)
    kind: str = TRIAL               # "trial"; another kind is skipped (see the module docstring)

    @property
    def environmental(self) -> bool:
        """A failure that says nothing about the config: measured again on resume."""
        return self.failure == ENVIRONMENT

    def to_line(self) -> str:
        d = asdict(self)
        d.update(d.pop("extra"))
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Record":
        names = ("task", "target", "config", "gflops", "latency_s", "error", "time", "timing", "failure", "kind")
        known = {k: d[k] for k in names if k in d}
        extra = {k: v for k, v in d.items() if k not in known}
        rec = cls(**known, extra=extra)
        if rec.error is not None and rec.failure is None:  # written before failures were classified
            rec.failure = classify(rec.error)
        return rec


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def problem(d: Any) -> str | None:
    """Why a parsed line is not a usable record (types, ranges, consistency), or None when it is."""
    if not isinstance(d, dict) or any(k not in d for k in REQUIRED):
        return "missing fields"
    if d.get("kind", TRIAL) != TRIAL:
        return None if isinstance(d["task"], str) and isinstance(d["config"], dict) else "malformed decision"
    if not isinstance(d["task"], str) or not isinstance(d["target"], str) or not isinstance(d["config"], dict):
        return "task/target/config of the wrong type"
    g, lat, err = d["gflops"], d.get("latency_s"), d.get("error")
    if not _number(g) or g < 0:
        return f"gflops {g!r} is not a non-negative number"
    if lat is not None and (not _number(lat) or lat <= 0):
        return f"latency_s {lat!r} is not a positive number"
    if err is not None and not isinstance(err, str):
        return f"error {err!r} is not a string"
    if g > 0 and (lat is None or err is not None):
        return "a result without a latency, or with an error"
    if g == 0 and err is None:
        return "neither a result nor a failure"
    if d.get("failure") not in (None, CONFIG, ENVIRONMENT):
        return f"unknown failure kind {d.get('failure')!r}"
    if not isinstance(d.get("timing", "warm"), str):
        return "timing is not a string"
    return None


class RecordLog:
    """A records file: :meth:`load` reads it tolerantly, :meth:`append` writes durably (holding the lock)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fh = None

    def load(self, task: str | None = None, target: str | None = None, timing: str | None = None) -> list[Record]:
        """Trial records in file order, optionally only those of one task/target/timing; bad lines skipped
        with a warning."""
        if not self.path.exists():
            return []
        out = []
        with open(self.path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    d = json.loads(raw)
                    why = problem(d)
                    if why is not None:
                        raise ValueError(why)
                    rec = Record.from_dict(d)
                except (ValueError, TypeError, UnicodeDecodeError) as exc:
                    log.warning("warning: %s line %d is not a valid tuning record (%s); skipped",
                                self.path, lineno, str(exc)[:80])
                    continue
                if (rec.kind == TRIAL and (task is None or rec.task == task)
                        and (target is None or rec.target == target) and (timing is None or rec.timing == timing)):
                    out.append(rec)
        return out

    def check_free(self, wait_s: float = LOCK_WAIT_S) -> None:
        """Fail now, creating nothing, if the file cannot be a records file or another tuner holds it (a
        check before long work; the lock itself is taken by :meth:`acquire`)."""
        if self.path.is_dir():
            raise UserError(f"the records file {self.path} is a directory; pass a file: --records FILE")
        if not self.path.exists() or self._fh is not None:  # absent, or already held by this run
            return
        self.acquire(wait_s)  # taken and given back: the run takes it again when it starts writing
        self.close()

    def acquire(self, wait_s: float = LOCK_WAIT_S) -> None:
        """Open the file for appending and take its exclusive lock (one tuner per file); wait up to
        ``wait_s`` for another holder, then a one-line UserError naming it."""
        if self._fh is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "ab")
        except OSError as exc:
            raise UserError(f"cannot write the records file {self.path} ({exc.strerror or exc}); pass a writable "
                            "--records FILE") from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = lock_holder(self.path)
                    fh.close()
                    raise UserError(f"records file {self.path} is in use by another tuner"
                                    f"{f' (PID {holder})' if holder else ''}; wait for it to finish or pass "
                                    "another --records file") from None
                time.sleep(0.1)
        self._fh = fh
        if fh.tell() > 0 and not self._ends_with_newline():
            fh.write(b"\n")   # isolate a half-written line left by a killed run

    def append(self, records: Iterable[Record]) -> None:
        """Write each record as one line, flushed and fsync'd before the next."""
        self.acquire()
        for rec in records:
            self._fh.write(rec.to_line().encode() + b"\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"

    def close(self) -> None:
        """Release the lock and close the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "RecordLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
