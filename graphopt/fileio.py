"""Atomic file writes: every artifact appears whole or not at all.

A run killed half-way (Ctrl-C, out of memory, a full disk) must not leave a truncated ``report.json`` or
cost cache that a later run reads as valid.  The bytes go to a temporary file in the destination's own
folder (same filesystem, so the rename is atomic) and ``os.replace`` swaps it in; readers see either the
old file or the new one.  See the POSIX ``rename`` specification for the atomicity guarantee.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (parents created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return p


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (parents created); returns the path."""
    return write_bytes_atomic(path, text.encode("utf-8"))
