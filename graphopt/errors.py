"""User-facing errors and the CLI guard that turns them into one-line messages.

Every stage raises :class:`UserError` for problems the user can fix (bad file, unknown target, missing
shape).  The console scripts wrap their entry point with :func:`cli_entry`, so a user sees one line on
stderr naming the problem and the fix, and exit code 2 - never a traceback unless ``--debug`` is given.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from typing import Callable

from graphopt import console, rlimits


class UserError(Exception):
    """A problem with the user's input or environment; the message says what to do."""


EXIT_USER_ERROR = 2


def seed(text: str) -> int:
    """argparse ``type`` of every ``--seed``: numpy's generators take non-negative integers only (a negative
    seed failed minutes into a run, at the first random draw)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a seed: give a non-negative integer")
    return value


def seconds(text: str) -> float:
    """argparse ``type`` of ``--time-limit``: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds: give e.g. 60") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds, e.g. 60")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line :class:`UserError` s (exit 2) like every other bad input,
    instead of a multi-line usage block, and which carries the options every console script shares
    (``--version``, ``-v``, ``-q``: :mod:`graphopt.console`), applied as soon as the command line is parsed;
    sub-command parsers are :class:`SubcommandParser` s."""

    top_level = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        console.add_common_options(self, self.top_level)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see {self.prog} --help)")

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", SubcommandParser)
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):  # parse_args calls it too
        namespace, rest = super().parse_known_args(args, namespace)
        if self.top_level:
            console.configure(namespace.verbose - namespace.quiet)
        return namespace, rest


class SubcommandParser(ArgumentParser):
    """A sub-command's parser (``graphopt rules show``): the shared options without defaults of its own."""

    top_level = False


def cli_entry(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI ``main(argv)`` so user errors print one line and exit 2.

    Unexpected exceptions are also reduced to one line (with the exception type) because a traceback is
    useless to a deployment engineer; ``--debug`` anywhere on the command line re-raises instead.
    """

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        args = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in args
        if debug:
            args.remove("--debug")
        try:
            return int(main(args) or 0)
        except KeyboardInterrupt:
            # The interrupt can land inside a library's constructor (TVM's TempDirectory before it set its
            # path), whose destructor then fails when the traceback lets go of it: "Exception ignored in ...",
            # a traceback after the one line.  Clean-up of a run the user stopped: not printed.
            sys.unraisablehook = lambda _unraisable: None
            print("error: interrupted; tuning records written so far are kept, rerun to resume", file=sys.stderr)
            return 130
        except BrokenPipeError:  # stdout closed by the reader (`| head`): nothing left to tell anyone
            with contextlib.suppress(OSError):  # and no second BrokenPipeError when Python flushes at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except UserError as exc:
            if debug:
                raise
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USER_ERROR
        except Exception as exc:  # noqa: BLE001 - last line of defence for a CLI
            if debug:
                raise
            limit = rlimits.explain(exc)  # ulimit -v / -f: named, not reported as our bug
            if limit:
                print(f"error: {limit}", file=sys.stderr)
                return EXIT_USER_ERROR
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"error: internal {type(exc).__name__}: {first[:300]} (rerun with --debug for the traceback "
                  "and report it)", file=sys.stderr)
            return 1

    return wrapper
