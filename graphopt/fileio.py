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

The output folder (:func:`lock_output_dir`): one run writes it at a time (an exclusive ``flock`` on a lock
file beside it, taken before the long work and dropped by the kernel when the process dies, so a killed
run's lock never blocks), and a build replaces its contents in one step: every new file is written in a
staging folder beside it, the user's other files are linked in, and the two folders swap names with one
``renameat2(RENAME_EXCHANGE)``.  A run killed at any moment leaves the previous build or the new one, never
a mix or neither; SIGTERM is handled like Ctrl-C, so the temporaries go too.

Temporary folders (:func:`private_tempdir`): each console script puts everything it and the libraries it
calls create with :mod:`tempfile` (TVM's export folders, the measurer's build folders, worker processes'
files) under one folder named after its process id, removed at exit; a run killed with SIGKILL cannot
remove it, so the next run removes the folders no process holds any more.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import io
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Collection, Iterator

from graphopt import rlimits
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
    limit = rlimits.explain(exc)  # ulimit -f: "File too large"
    if limit:
        return UserError(f"{p.name}: {limit}")
    return UserError(f"cannot write {str(p)!r} ({exc.strerror or exc}); check the path")


def _mkdir(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"cannot create folder {str(d)!r}: a file of that name is in the way") from None
    except OSError as exc:
        raise _write_error(exc, d / ".") from None


def _umask() -> int:
    """This process's umask (reading it means setting it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _new_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file under this process's umask (0644 usually)."""
    return 0o666 & ~_umask()


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


# ---- the output folder: one writer, replaced in one step ---------------------------------------------------

_BESIDE = ".optimize-model"  # beside DIR: .DIR.optimize-model.lock and the staging .DIR.optimize-model-XXXXXXXX
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)  # kernel, C library or filesystem (NFS) lacks it
_LEFTOVER = re.compile(r"\.(?:staging|write-probe)\.[a-z0-9_]{8}")  # staging_dir's, _check_place's


def display_path(path: str | os.PathLike) -> str:
    """``path`` as text any reader of a UTF-8 report takes: the bytes of a name that are not UTF-8 (a Linux
    name may hold any) shown as ``\\xff``.  ``str(path)`` carries them as lone surrogates, which encoding to
    UTF-8 refuses (report.md failed after the whole compile)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def lock_holder(path: Path) -> int | None:
    """PID holding a ``flock`` on ``path``, read from Linux's /proc/locks (None where unknown)."""
    try:
        ino = os.stat(path).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            # "1: FLOCK  ADVISORY  WRITE 12345 fd:01:1234567 0 EOF"
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(ino):
                return int(parts[4])
    except (OSError, ValueError):
        pass
    return None


class OutputDir:
    """An output folder this process holds (:func:`lock_output_dir`); :meth:`replace` writes a build into it."""

    def __init__(self, path: Path, option: str) -> None:
        self.path = path  # as given: the messages name it
        self.real = path.resolve()  # where the folders swap: a symlink to the folder stays a symlink to it
        self.option = option
        self.lock_file = self.real.parent / f".{self.real.name}{_BESIDE}.lock"
        self._prefix = f".{self.real.name}{_BESIDE}-"

    def stale(self) -> list[Path]:
        """Staging folders of runs killed by SIGKILL (only the lock holder may call it: no other run is
        writing one)."""
        pattern = re.compile(re.escape(self._prefix) + r"[a-z0-9_]{8}(?:\.old)?")
        with contextlib.suppress(OSError):
            return [p for p in self.real.parent.iterdir() if pattern.fullmatch(p.name)]
        return []

    @contextlib.contextmanager
    def replace(self, drop: Collection[str]) -> Iterator[Path]:
        """An empty folder beside DIR (same filesystem) to write the whole build in.  When the block succeeds,
        DIR's other files (the user's, the tuning records) are linked in - all but the names in ``drop``,
        the build files an older build may have left - and it takes DIR's place in one step.  Failed or
        interrupted at any point: DIR as it was, the new folder removed; a write error names DIR.  Signals
        wait while the new folder is made and removed: a Ctrl-C between the two steps of making it would
        leave it behind."""
        staging: Path | None = None
        try:
            with signals_held():
                staging = self._staging()
            try:
                yield staging
            except UserError as exc:  # "no space left on DIR", not on the staging folder nobody knows
                raise UserError(str(exc).replace(str(staging), str(self.path))) from None
            _carry(self, staging, drop)
            os.chmod(staging, _folder_mode(self.real))
            _swap_in(staging, self.real)
        except OSError as exc:
            if exc.errno is None:
                raise
            written = Path(os.fsdecode(exc.filename)) if exc.filename else None
            raise _write_error(exc, self.path / written.name if written and written.parent == staging
                               else self.path) from None
        finally:  # the unfinished build, or the old folder after the swap
            if staging is not None:
                with signals_held():
                    for d in (staging, staging.with_name(staging.name + ".old")):
                        _remove_folder(d)

    def _staging(self) -> Path:
        """A new empty folder beside DIR."""
        try:
            return Path(tempfile.mkdtemp(dir=self.real.parent, prefix=self._prefix))
        except OSError as exc:
            raise _write_error(exc, self.path) from None


def _remove_folder(d: Path, patience_s: float = 10.0) -> None:
    """Remove folder ``d`` with its contents, again while something still writes into it: a Ctrl-C does not
    stop the linker a compile started, which may create its output after the removal listed the folder.
    Once the folder itself is gone nothing can appear in it."""
    deadline = time.monotonic() + patience_s
    shutil.rmtree(d, ignore_errors=True)
    while os.path.lexists(d) and time.monotonic() < deadline:
        time.sleep(0.01)
        shutil.rmtree(d, ignore_errors=True)


def _folder_mode(d: Path) -> int:
    """The permission bits the folder has (mkdtemp makes 0700), or those ``mkdir`` gives under the umask."""
    with contextlib.suppress(FileNotFoundError):
        return stat.S_IMODE(os.stat(d).st_mode)
    return 0o777 & ~_umask()


def _kept(folder: OutputDir, drop: Collection[str]) -> list[os.DirEntry]:
    """The entries of the folder a new build keeps: not a build file (``drop``), not a temporary a killed
    writer left (an :func:`atomic_path` temporary of a build file, a staging or probe leftover).  A folder in
    it is refused: it would have to move out and back, and a kill in between would lose it."""
    temporaries = [re.compile(re.escape(f".{Path(n).stem}.") + "[a-z0-9_]{8}" + re.escape(Path(n).suffix or ".tmp"))
                   for n in drop]
    kept = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        with os.scandir(folder.real) as it:
            for e in it:
                if e.name in drop or _LEFTOVER.fullmatch(e.name) or any(t.fullmatch(e.name) for t in temporaries):
                    continue
                if e.is_dir(follow_symlinks=False):
                    raise UserError(f"{folder.option} {str(folder.path)!r} holds a folder, {e.name!r}: a build "
                                    "replaces the folder in one step and keeps only files beside its own; move it "
                                    "out or choose another folder")
                kept.append(e)
    return kept


def _carry(folder: OutputDir, staging: Path, drop: Collection[str]) -> None:
    """Link the folder's kept entries (:func:`_kept`) into the new build's folder: hard links, so no byte
    is copied and a file appended to since (the records) is the same file; a copy where links fail."""
    for e in _kept(folder, drop):
        target = staging / e.name
        if os.path.lexists(target):  # the new build wrote it
            continue
        try:
            os.link(e.path, target, follow_symlinks=False)
        except OSError:  # a filesystem without hard links, a file of another user (protected_hardlinks)
            if e.is_symlink():
                os.symlink(os.readlink(e.path), target)
            else:
                shutil.copy2(e.path, target)


def _rename_exchange(a: Path, b: Path) -> None:
    """Swap the names of ``a`` and ``b`` in one system call (``renameat2``, Linux 3.15, glibc 2.28)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this C library")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(b))


def _swap_in(new: Path, dest: Path) -> None:
    """Put folder ``new`` at ``dest`` in one step, the old folder going to ``new``'s name (or ``new``.old).
    Where the filesystem cannot exchange names: two renames with SIGINT/SIGTERM held back between them, so
    only a SIGKILL at that instant could leave no folder at ``dest``."""
    try:
        _rename_exchange(new, dest)
    except FileNotFoundError:  # no folder there yet
        os.rename(new, dest)
    except OSError as exc:
        if exc.errno not in _NO_EXCHANGE:
            raise
        with signals_held():
            with contextlib.suppress(FileNotFoundError):
                os.rename(dest, new.with_name(new.name + ".old"))
            os.rename(new, dest)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM noted, not acted on, inside the block (a Python handler may run between any two
    statements, or inside a Python callback that native code called, where the KeyboardInterrupt it raises
    comes back out of the native call as a RuntimeError), then delivered to the handlers in place again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda n, _frame: got.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """Inside the block SIGTERM (``kill``, ``timeout``, a container's stop) raises KeyboardInterrupt as
    Ctrl-C does, so ``finally`` blocks remove the temporaries; by default it ends the process on the spot.
    Left alone outside the main thread (only it sets handlers) or where the program has its own handler."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    owner = os.getpid()

    def interrupt(signum: int, _frame: Any) -> None:
        if os.getpid() != owner:  # a forked worker that inherited the handler ends as it always did
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _check_replaceable(folder: OutputDir) -> None:
    """Folders a build cannot replace in one step, refused before the work: a mount point (it cannot be
    renamed), the current folder (the shell would be left in a removed one), one holding folders."""
    shown = f"{folder.option} {str(folder.path)!r}"
    if os.path.ismount(folder.real):
        raise UserError(f"{shown} is a mount point, which a build cannot replace in one step; give a folder inside "
                        f"it, e.g. {folder.option} {folder.path / 'build'}")
    with contextlib.suppress(OSError):  # a current folder that was removed: it cannot be the output folder
        cwd = Path.cwd()
        if cwd == folder.real or folder.real in cwd.parents:
            raise UserError(f"{shown} is the current folder: a build replaces the folder as a whole, which would "
                            f"leave this shell in a removed one; give a folder below it, e.g. {folder.option} build")
    _kept(folder, ())


def _lock(folder: OutputDir) -> int:
    """Create and ``flock`` the lock file beside the folder; a one-line refusal naming the holder's PID.  The
    holder removes the file when done, so a lock is taken only on the file still at that path."""
    _mkdir(folder.real.parent)
    while True:
        try:
            fd = os.open(folder.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"{folder.option} {str(folder.path)!r}: cannot write in {str(folder.real.parent)!r} "
                            f"({exc.strerror}), where a build is staged before it replaces the folder; choose a "
                            "folder whose parent is writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(folder.lock_file)
            os.close(fd)
            raise UserError(f"{folder.option} {str(folder.path)!r} is being written by another run"
                            f"{f' (PID {holder})' if holder else ''}: wait for it to finish or choose another "
                            "folder") from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(folder.lock_file)):
                return fd
        os.close(fd)  # its holder removed it between our open and flock: take the one at the path now


@contextlib.contextmanager
def lock_output_dir(path: str | os.PathLike, option: str = "-o") -> Iterator[OutputDir]:
    """Hold output folder ``path`` for this process, before the long work, until the block ends (also on an
    error): refused in one line when another run holds it or when a build cannot replace it in one step
    (:func:`_check_replaceable`); SIGTERM handled like Ctrl-C meanwhile.  A dead holder's lock went with it
    (``flock``); its staging folders are removed here."""
    folder = OutputDir(Path(path).expanduser(), option)
    _check_replaceable(folder)
    with _sigterm_as_ctrl_c():
        fd: int | None = None
        try:
            with signals_held():  # a signal between creating the lock file and holding it would leave it
                fd = _lock(folder)
            for d in folder.stale():
                shutil.rmtree(d, ignore_errors=True)
            yield folder
        finally:
            if fd is not None:
                with signals_held():
                    with contextlib.suppress(OSError):
                        os.unlink(folder.lock_file)
                    os.close(fd)


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
