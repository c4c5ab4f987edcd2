"""Silence log lines TVM's C++ runtime writes straight to file descriptor 2.

Python's ``sys.stderr`` redirection cannot catch them: exporting a Relax executable prints one
"Scope Saving" warning per kernel, the RPC session prints "load_module" per measured config, and TOPI's
fast ``take`` warns at every Gather.  They bury the progress bars and the one-line results a user reads,
so the few calls known to chatter run with fd 2 pointed at /dev/null; real failures still raise.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

# fd 2 is the process's: threads building side by side (kerneltune.machine_gate) share one redirection, made
# by the first to enter and undone by the last to leave (each saving and restoring its own left fd 2 on
# /dev/null when two interleaved)
_lock = threading.Lock()
_held = {"count": 0, "saved": -1}


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Send fd 2 to /dev/null for the duration (unless OPTIMIZE_MODEL_VERBOSE=1)."""
    if os.environ.get("OPTIMIZE_MODEL_VERBOSE") == "1":
        yield
        return
    with _lock:
        if _held["count"] == 0:
            sys.stderr.flush()
            _held["saved"] = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        _held["count"] += 1
    try:
        yield
    finally:
        with _lock:
            _held["count"] -= 1
            if _held["count"] == 0:
                sys.stderr.flush()
                os.dup2(_held["saved"], 2)
                os.close(_held["saved"])
