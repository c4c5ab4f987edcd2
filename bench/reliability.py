"""Run the bad-input corpus (``tests/bad_inputs.py``) through the console scripts and count the outcomes.

Every case runs as a real subprocess of this checkout's console scripts (``optimize-model``, ``bench-model``,
``graphopt``, ``tune-kernels``, ``python -m models``), with its own time limit, and is judged as in
``tests/test_reliability.py``: ``clean`` (a one-line refusal naming the problem, or a success whose
artifact was recomputed and found right), ``internal``, ``hang``, ``wrong success``, ``unexpected`` or
``signal`` (the process was killed by one: SIGFPE, SIGSEGV, SIGBUS; the user saw no message).

    python bench/reliability.py --json bench/results/reliability.json

prints the counts as JSON ({"cases", "clean", "internal", "hangs", "wrong_successes", "unexpected",
"signals"}) and
writes them with every case's verdict to ``--json``.  The counts do not depend on the machine's load
(only the time does, and it is not written), so the JSON is committed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import bad_inputs as B  # noqa: E402  (the corpus lives with the tests that also run it)
from graphopt.fileio import write_text_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the counts and every case's verdict to this file")
    p.add_argument("-k", "--filter", default="", help="only cases whose name contains this")
    p.add_argument("-v", "--verbose", action="store_true", help="print each case's verdict as it finishes")
    args = p.parse_args(argv)
    unshare = B.unshare_available()
    summary, skipped = B.Summary(), []
    with tempfile.TemporaryDirectory(prefix="reliability-") as base:
        for case in B.all_cases():
            if args.filter not in case.name:
                continue
            if case.needs_unshare and not unshare:
                skipped.append(case.name)
                continue
            outcome = B.run_case(case, Path(base), in_process=False)
            summary.outcomes.append(outcome)
            if args.verbose or outcome.verdict != "clean":
                print(f"{outcome.verdict:14s} {outcome.seconds:6.1f}s {case.name:48s} {outcome.detail[:150]}",
                      file=sys.stderr, flush=True)
    counts = summary.counts()
    print(json.dumps(counts))
    if args.json:
        by_case = [{"case": o.case, "verdict": o.verdict, "rc": o.rc, "detail": o.detail.replace(base, "DIR")}
                   for o in summary.outcomes]
        doc = {**counts, "skipped_without_unshare": skipped,
               "categories": sorted({c.category for c in B.all_cases()}), "outcomes": by_case}
        write_text_atomic(args.json, json.dumps(doc, indent=1) + "\n")
    bad = counts["internal"] + counts["hangs"] + counts["wrong_successes"] + counts["unexpected"] + counts["signals"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
