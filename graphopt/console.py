"""What every console script shows on the terminal besides its result: ``--version``, how much is logged
(``-v`` / ``-q``) and whether progress bars are drawn.

One home for the options all five scripts share: :class:`graphopt.errors.ArgumentParser` adds them to every
parser (:func:`add_common_options`) and applies them once the command line is parsed (:func:`configure`), so
no script repeats them.

Levels, through the :mod:`logging` module (https://docs.python.org/3/howto/logging.html):

- default: warnings and notes (``log.warning``) and progress bars, plus the result lines each command prints;
- ``-v``: also ``log.info`` (what a stage decided and why: resumed records, exhausted search spaces);
  ``-vv``: ``log.debug`` too;
- ``-q``: errors only: no warnings, notes or progress bars (the result on stdout is still printed).

Only our packages' loggers follow ``-v``; other libraries' stay at warnings (``-q``: errors), so ``-v`` is
not flooded with TVM's RPC chatter.

Progress bars (tqdm) are drawn only when stderr is a terminal: redirected to a file or a CI log, each update
would be another line (tqdm redraws with carriage returns), over a thousand for a tuning run.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("graphopt", "kerneltune", "pipeline", "models")
DISTRIBUTION = "optimize-model"  # the name in pyproject.toml's [project]
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def version() -> str:
    """The tool's version: pyproject.toml's, as installed (importlib.metadata); read from pyproject.toml
    beside the packages when they run from a checkout that was never installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        return str(tomllib.loads(_PYPROJECT.read_text())["project"]["version"])
    except (OSError, KeyError, ValueError):
        return "unknown"


ENGINES = (("apache-tvm", "tvm"), ("onnxruntime", "onnxruntime"), ("onnx", "onnx"))  # distribution, label


def engine_versions() -> dict[str, str | None]:
    """The pinned engines' installed versions by label (None: not installed), read from the package metadata
    so that nothing is imported: ``--version`` and report.json's ``versions`` give the same figures."""
    found: dict[str, str | None] = {}
    for dist, label in ENGINES:
        try:
            found[label] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[label] = None
    return found


def version_line(prog: str) -> str:
    """``--version``'s line: ours and the pinned engines' versions (what a bug report needs)."""
    engines = [f"{label} {v or 'not installed'}" for label, v in engine_versions().items()]
    return f"{prog} {version()} ({', '.join(engines)})"


def add_common_options(parser: argparse.ArgumentParser, top_level: bool) -> None:
    """--version, -v/--verbose, -q/--quiet and --debug.  A sub-command's parser takes them too (``graphopt
    optimize M -v``), with defaults suppressed so that they do not reset what was given before the
    sub-command.  ``--debug`` is acted on by :func:`graphopt.errors.cli_entry`, which takes it off the command
    line first; it is declared only so that every script's ``--help`` says it exists."""
    parser.add_argument("--version", action="version", version=version_line(parser.prog),
                        help="print the version (and the TVM, onnxruntime and onnx versions) and exit")
    default: Any = 0 if top_level else argparse.SUPPRESS
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="more messages: -v what each stage decided, -vv debugging detail")
    parser.add_argument("-q", "--quiet", action="count", default=default,
                        help="errors only: no warnings, notes or progress bars")
    # Read (and removed) by graphopt.errors.cli_entry before parsing; declared here so that --help lists it.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error instead of its one line")


class _Stderr(logging.Handler):
    """Writes to the *current* ``sys.stderr`` (like logging's last-resort handler), so a redirected or
    captured stderr gets the messages."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the program
            self.handleError(record)


class _Format(logging.Formatter):
    """Warnings and notes carry their own ``warning:`` / ``note:`` prefix; debug lines name their module."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        return f"debug: {record.name}: {text}" if record.levelno < logging.INFO else text


_handler = _Stderr()
_handler.setFormatter(_Format())


def level_for(verbosity: int) -> int:
    """-q (negative) -> ERROR, default (0) -> WARNING, -v -> INFO, -vv -> DEBUG."""
    if verbosity < 0:
        return logging.ERROR
    return {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)


def configure(verbosity: int) -> None:
    """Set the levels for one command (idempotent: tests run many commands in one process)."""
    level = level_for(verbosity)
    root = logging.getLogger()
    if _handler not in root.handlers:
        root.addHandler(_handler)
    root.setLevel(max(level, logging.WARNING))
    for name in PACKAGES:
        logging.getLogger(name).setLevel(level)


def show_progress(enabled: bool = True) -> bool:
    """Whether a progress bar is drawn: asked for (no --no-progress), not -q, and stderr is a terminal."""
    if not enabled or not logging.getLogger("graphopt.console").isEnabledFor(logging.WARNING):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def progress_bar(enabled: bool = True, **kwargs: Any):
    """A tqdm bar on stderr, disabled as :func:`show_progress` says (a disabled bar still counts)."""
    from tqdm import tqdm  # imported here: --help and the error paths do not need it

    return tqdm(file=sys.stderr, disable=not show_progress(enabled), **kwargs)
