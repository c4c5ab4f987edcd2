"""Why a measurement failed: the config's fault, or the environment's.

A failed trial is recorded either way, but the two mean different things on resume:

* a **config** failure says something about the config and is final: it was rejected by the template
  (``invalid config``), did not compile (``build failed``), computed the wrong result (``wrong result``),
  raised while running (``run failed``), or was pathologically slow (a timeout while the machine worked,
  see below).  Measuring it again would give the same answer, so a resumed run takes the record as it is.
* an **environmental** failure says nothing about the config: the RPC device could not be reached or the
  session was lost (``session failed``), a worker process was killed from outside (SIGKILL: the OOM killer
  under load, an operator), the measurer itself raised, the task's reference could not be prepared, or a
  timeout happened while the machine or device was not working.  It is recorded as such and measured again
  when the run resumes.

The timeout rule: a build or run timeout is the config's own when another config of the *same batch* built
and ran (the machine and the device worked at that moment, so this kernel was the slow one); when nothing
in the batch ran, the batch's timeouts are environmental (an overloaded or hung machine, a device gone).
It needs no load-average reading and depends only on what the batch itself showed.

A worker that dies by a signal of its own making (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT: an
out-of-bounds kernel, a compiler abort) crashed on the config; killed by SIGKILL or dead with an unknown
status, it is environmental.
"""
from __future__ import annotations

import re
import signal
from typing import Sequence

CONFIG = "config"
ENVIRONMENT = "environment"

# Substrings of an error that say the device or the session went away (RPC sockets, TVM's RPC layer).
_SESSION_LOST = ("session failed", "connection", "broken pipe", "socket", "rpcsession", "rpc session",
                 "measurer raised", "run failed: reference")
_SELF_INFLICTED = {-int(s) for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)}
_EXIT_CODE = re.compile(r"worker died \(exit code (-?\d+)\)")
_TIMEOUT = ("build timeout", "run timeout")


def classify(error: str | None, batch_ran: bool = True) -> str | None:
    """:data:`CONFIG`, :data:`ENVIRONMENT`, or None when ``error`` is None (the config ran).

    ``batch_ran``: whether some config of the same batch ran successfully (decides timeouts)."""
    if error is None:
        return None
    low = error.lower()
    crash = _EXIT_CODE.search(low)
    if crash:
        code = int(crash.group(1))
        return CONFIG if code in _SELF_INFLICTED else ENVIRONMENT
    if "worker died" in low:
        return ENVIRONMENT
    if any(s in low for s in _SESSION_LOST):
        return ENVIRONMENT
    if low.startswith(_TIMEOUT):
        return CONFIG if batch_ran else ENVIRONMENT
    return CONFIG


def classify_batch(errors: Sequence[str | None]) -> list[str | None]:
    """:func:`classify` for every result of one measured batch (the timeout rule looks at its neighbours)."""
    ran = any(e is None for e in errors)
    return [classify(e, ran) for e in errors]
