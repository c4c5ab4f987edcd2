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
from typing import Iterator


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Send fd 2 to /dev/null for the duration (unless OPTIMIZE_MODEL_VERBOSE=1)."""
    if os.environ.get("OPTIMIZE_MODEL_VERBOSE") == "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
