"""Files the product writes: output paths checked before the work, every artifact written atomically.

Checked first (:func:`check_output_dir`, :func:`check_output_file`): a path under a kernel pseudo-filesystem
(/proc, /sys, /dev), a file where a folder is expected or the reverse, a folder nobody may write to (probed
by creating a file: permission bits say nothing to root or about a read-only mount), a disk without the
room the run will need.  Each is one line before any minute of work is spent.

Written atomically (:func:`write_bytes_atomic`, :func:`atomic_path`): a run killed half-way (Ctrl-C, out of
memory, a full disk) must not leave a truncated ``optimized.onnx``, ``model.so`` or ``report.json`` that a
later run or a user reads as valid.  The bytes go to a temporary file in the destination's own folder (same
filesystem, so the rename is atomic) and ``os.replace`` swaps it in; readers see either the old file or the
new one (POSIX ``rename``).  A full disk is reported as "no space left on DIR", and the temporary file is
removed.

Temporary folders (:func:`private_tempdir`): each console script puts everything it and the libraries it
calls create with :mod:`tempfile` (TVM's export folders, the measurer's build folders, worker processes'
files) under one folder named after its process id, removed at exit; a run killed with SIGKILL cannot
remove it, so the next run removes the folders no process holds any more.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from graphopt.errors import UserError

PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


# ---- checks before the work --------------------------------------------------------------------------------

def _pseudo(p: Path) -> str | None:
    for root in PSEUDO_FILESYSTEMS:
        if p == Path(root) or Path(root) in p.parents:
            return root
    return None


def _existing_ancestor(p: Path) -> Path:
    a = p
    while not a.exists() and a != a.parent:
        a = a.parent
    return a


def _check_place(p: Path, option: str, need_bytes: int) -> None:
    """The folder that will hold ``p`` (or its nearest existing ancestor) is a writable folder with room."""
    root = _pseudo(p.resolve())
    if root is not None:
        raise UserError(f"{option} {str(p)!r} is under {root}, a kernel pseudo-filesystem: write to a normal "
                        "folder")
    ancestor = _existing_ancestor(p.parent.resolve() if not p.is_dir() else p.resolve())
    if not ancestor.is_dir():
        raise UserError(f"{option} {str(p)!r}: {str(ancestor)!r} is a file, not a folder; choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise UserError(f"no space left on {ancestor}: free some space or choose another place with {option}") \
                from None
        raise UserError(f"{option} {str(p)!r}: cannot write in {str(ancestor)!r} ({exc.strerror}); choose a "
                        "writable folder") from None
    free = shutil.disk_usage(ancestor).free
    if need_bytes and free < need_bytes:
        raise UserError(f"no space left on {ancestor}: {free / 1e6:.1f} MB free, about {need_bytes / 1e6:.1f} MB "
                        f"needed; free some space or choose another place with {option}")


def check_output_dir(path: str | os.PathLike, option: str = "-o", need_bytes: int = 0) -> Path:
    """``path`` is (or can be created as) a writable folder with ``need_bytes`` free."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"{option} {str(p)!r} is a file, not a folder: give a folder for the outputs")
    _check_place(p / "x", option, need_bytes)
    return p


def check_output_file(path: str | os.PathLike, option: str = "--json", need_bytes: int = 0) -> Path:
    """``path`` is (or can be created as) a writable file (not a folder) with ``need_bytes`` free."""
    p = Path(path).expanduser()
    if str(path).endswith(os.sep) or p.is_dir():
        raise UserError(f"{option} {str(p)!r} is a folder: give a file name")
    _check_place(p, option, need_bytes)
    return p


# ---- atomic writes -----------------------------------------------------------------------------------------

def _write_error(exc: OSError, p: Path) -> UserError:
    if exc.errno in _NO_SPACE:
        return UserError(f"no space left on {p.parent}: {p.name} was not written; free some space or write elsewhere")
    if exc.errno in _DENIED:
        return UserError(f"cannot write {str(p)!r} ({exc.strerror}); choose a writable folder")
    return UserError(f"cannot write {str(p)!r} ({exc.strerror or exc}); check the path")


def _mkdir(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"cannot create folder {str(d)!r}: a file of that name is in the way") from None
    except OSError as exc:
        raise _write_error(exc, d / ".") from None


def _new_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file under this process's umask (0644 usually)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, so tools that look at it behave) for a writer that
    needs a file name (a compiler, a plotting library); renamed onto ``path`` when the block succeeds,
    removed otherwise.  A full disk inside the block, even when the writer reports it only in its message
    (a linker's "No space left on device"), becomes the one-line "no space left" error."""
    p = Path(path)
    _mkdir(p.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.stem}.", suffix=p.suffix or ".tmp")
        os.close(fd)
    except OSError as exc:
        raise _write_error(exc, p) from None
    try:
        yield Path(tmp)
        os.chmod(tmp, _new_file_mode())  # mkstemp makes 0600: give the artifact the mode open() would have
        os.replace(tmp, p)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise _write_error(exc, p) from None
        if isinstance(exc, Exception) and "No space left on device" in str(exc):
            raise UserError(f"no space left on {p.parent}: {p.name} was not written; free some space or write "
                            "elsewhere") from None
        raise


@contextlib.contextmanager
def staging_dir(folder: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder inside ``folder`` (same filesystem: its files can be ``os.replace`` d into
    ``folder`` atomically) for a writer that writes several files at once (a model and its weights file);
    removed afterwards with whatever is left in it.  Write failures become the one-line errors of
    :func:`atomic_path`."""
    d = Path(folder)
    _mkdir(d)
    try:
        tmp = Path(tempfile.mkdtemp(dir=d, prefix=".staging."))
    except OSError as exc:
        raise _write_error(exc, d / ".staging") from None
    try:
        yield tmp
    except OSError as exc:
        if exc.errno is not None:
            raise _write_error(exc, d / (Path(exc.filename).name if exc.filename else ".")) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (parents created); returns the path."""
    p = Path(path)
    with atomic_path(p) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return p


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (parents created); returns the path."""
    return write_bytes_atomic(path, text.encode("utf-8"))


FIGURE_FORMATS = ("png", "pdf", "svg")


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Render a matplotlib figure in memory (format from the suffix, :data:`FIGURE_FORMATS`) and write it
    atomically: ``savefig`` to the final name would leave half a PNG on a full disk.  The canvas is fitted
    to what is drawn (``bbox_inches="tight"``), so long tick labels and legends are never cut off."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi, bbox_inches="tight")
    return write_bytes_atomic(path, buf.getvalue())


# ---- temporary folders -------------------------------------------------------------------------------------

_PRIVATE_PREFIX = "optimize-model-"
_LOCK = ".owner.lock"
_held: list[int] = []  # the open, locked file descriptor of this process's folder (kept for its lifetime)


def _owner_gone(d: Path) -> bool:
    """True when no process holds the lock of folder ``d`` (its owner exited or was killed: the kernel drops
    a ``flock`` with its last descriptor).  A lock, not a process id, because a process id may be reused or
    belong to another PID namespace sharing this /tmp."""
    try:
        fd = os.open(d / _LOCK, os.O_RDWR)
    except OSError:
        return False  # no lock file: being created right now, or not ours
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def remove_stale_tempdirs(base: str | os.PathLike | None = None) -> list[Path]:
    """Remove the private temporary folders whose process is gone; returns what was removed."""
    base = Path(base or tempfile.gettempdir())
    removed = []
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return removed
    for d in entries:
        if d.name.startswith(_PRIVATE_PREFIX) and d.is_dir() and _owner_gone(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def private_tempdir() -> Path:
    """Make a private folder the default of :mod:`tempfile` for this process (and ``TMPDIR`` for its child
    processes), removed at exit; the stale folders of killed runs are removed first.  Idempotent; a child
    process that inherited one keeps using it."""
    current = Path(tempfile.gettempdir())
    if current.name.startswith(_PRIVATE_PREFIX) and current.is_dir():
        return current
    remove_stale_tempdirs(current)
    d = Path(tempfile.mkdtemp(prefix=f"{_PRIVATE_PREFIX}{os.getpid()}-", dir=current))
    fd = os.open(d / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held.append(fd)
    tempfile.tempdir = str(d)
    os.environ["TMPDIR"] = str(d)
    atexit.register(shutil.rmtree, d, True)
    return d
