"""Run the long checks the CI suite leaves out (``pytest -m slow``) and record what each did.

The README's test command runs ``-m 'not slow'`` (``pyproject.toml``) so that it stays within 15 minutes on
a 2-core machine; the checks marked ``slow`` (whole corpus exports, a second exporter of a model the suite
already builds, long tuning runs) are run here instead:

    python bench/slow_tests.py --json bench/results/slow_tests.json [-k EXPR]

writes the CPU, the counts (passed, failed, skipped, errors) and every test's outcome and seconds; the exit
code is pytest's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from graphopt.fileio import write_text_atomic  # noqa: E402
from kerneltune.targets.host import host_model_name  # noqa: E402


def outcomes(junit: Path) -> list[dict]:
    """Every test case of a pytest JUnit XML report: its id, outcome and seconds."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0.0), 2)})
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the counts and every test's outcome and seconds to this file")
    p.add_argument("-k", dest="expr", help="only tests matching this pytest -k expression")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="slow-tests-") as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider",
                   f"--junitxml={junit}", *(["-k", args.expr] if args.expr else [])]
        rc = subprocess.run(command, cwd=ROOT).returncode
        cases = outcomes(junit) if junit.exists() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    result = {"cpu": host_model_name(), "cores": os.cpu_count(), "pytest_exit": rc, **counts,
              "seconds": round(sum(c["seconds"] for c in cases), 1), "tests": cases}
    print(json.dumps({k: v for k, v in result.items() if k != "tests"}))
    if args.json:
        write_text_atomic(Path(args.json), json.dumps(result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
