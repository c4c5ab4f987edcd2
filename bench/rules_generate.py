"""Time generate + prune + verify of the rule library from scratch and print its statistics as JSON.

    python bench/rules_generate.py [--max-ops 3] [--jobs 2] [-o graphopt/data/rules.json] [--json out.json]

Always rebuilds (no cache), so the ``seconds`` it reports is the full cost on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from graphopt.fileio import write_text_atomic
from graphopt.library import generate
from graphopt.rules import LIBRARY_PATH, save_rules


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-ops", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout-ms", type=int, default=1500)
    ap.add_argument("-o", "--output", default=str(LIBRARY_PATH))
    ap.add_argument("--json", default="bench/results/rules_generate.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rules, meta = generate(args.max_ops, args.jobs, args.timeout_ms)
    save_rules(rules, args.output, meta)
    wall = time.perf_counter() - t0
    out = {**meta["stats"], "wall_seconds": round(wall, 1), "jobs": args.jobs, "cpu_count": os.cpu_count(),
           "details": meta["details"]}
    write_text_atomic(args.json, json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
