"""``graphopt cache``: the folders this tool keeps measurements in, listed and cleared.

Builds measure what no description of the machine says and keep it, per CPU and thread count, so the next
build on the same machine skips the measuring: the graph stage's operator costs, the kernel and layout prices,
the machine probe, the calibrated template choices and the end-to-end verdicts (``$OPTIMIZE_MODEL_CACHE``,
else ``optimize-model`` in the user's cache folder), and generated substitution libraries (``$GRAPHOPT_CACHE``,
else ``graphopt`` there).
The user's cache folder is ``$XDG_CACHE_HOME``, else ``~/.cache``.  A cleared cache is measured again on the
next build (seconds to a minute); nothing else depends on it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from graphopt.cost.cache import cache_dir
from graphopt.errors import UserError
from graphopt.library import rules_cache_dir


@dataclass(frozen=True)
class CacheFolder:
    name: str
    path: Path
    holds: str

    def files(self) -> list[Path]:
        """The cache files in the folder (``*.json``, the form every cache here is written in)."""
        return sorted(p for p in self.path.glob("*.json") if p.is_file()) if self.path.is_dir() else []


def folders() -> list[CacheFolder]:
    return [CacheFolder("measurements", cache_dir(), "operator costs, kernel and layout prices, the machine "
                                                    "probe, calibrated template choices, end-to-end verdicts "
                                                    "(per CPU and threads)"),
            CacheFolder("rules", rules_cache_dir(), "generated substitution libraries, by build key")]


def describe() -> str:
    """One block per folder: where, what it holds, its files and their sizes."""
    lines = []
    for folder in folders():
        files = folder.files()
        total = sum(p.stat().st_size for p in files)
        lines.append(f"{folder.name}: {folder.path} ({len(files)} files, {total / 1024:.1f} KiB) - {folder.holds}")
        lines += [f"  {p.name}  {p.stat().st_size / 1024:.1f} KiB" for p in files]
    return "\n".join(lines)


def clear() -> int:
    """Remove every cache file (the folders stay); returns how many were removed."""
    removed = 0
    for folder in folders():
        for p in folder.files():
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise UserError(f"cannot remove {p} ({exc.strerror or exc}): check the folder's permissions") from None
            removed += 1
    return removed


def add_cache_parser(sub) -> None:
    p = sub.add_parser("cache", help="list (or --clear) the folders of measurements kept between builds",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--clear", action="store_true", help="remove the cache files (measured again on the next build)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.clear:
        print(f"removed {clear()} cache files")
    else:
        print(describe())
    return 0
