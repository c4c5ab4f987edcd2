"""The shipped rule library: generate -> prune -> verify -> save, its statistics, and the ``rules`` CLI.

``graphopt rules generate`` enumerates every domain of :func:`graphopt.generator.default_domains` (one
process per domain, ``--jobs`` at a time), drops pairs implied by more general ones and renaming
duplicates (:mod:`graphopt.prune`), proves each remaining candidate with Z3 in a process pool
(:mod:`graphopt.verifier`) and writes the proved ones.  The file's ``meta`` holds the statistics and a cache
key (:data:`LIBRARY_VERSION`, the operator set and the options), so a rebuild with nothing changed returns
at once (the result is also kept under ``~/.cache/graphopt``, :func:`rules_cache_dir`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

from graphopt import ops
from graphopt.console import progress_bar
from graphopt.errors import UserError
from graphopt.fileio import check_output_file, write_bytes_atomic, write_text_atomic
from graphopt.rules import LIBRARY_PATH, Rule, load_meta, load_rules, save_rules

log = logging.getLogger(__name__)

def rules_cache_dir() -> Path:
    """Where generated rule libraries are kept by their build key: ``$GRAPHOPT_CACHE``, else ``graphopt`` in the
    user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    from graphopt.cost.cache import user_cache_home

    return Path(os.environ.get("GRAPHOPT_CACHE") or user_cache_home() / "graphopt")
STATS_KEYS = ("enumerated_graphs", "candidate_pairs", "verified", "rejected", "unverified", "after_pruning",
              "properties", "seconds", "max_ops")


# The version of what `rules generate` produces.  Bump it whenever a change to the generator, the pruning,
# the properties, the verifier, an operator spec or the rule format could change the library: the cache key
# below then misses and the next `graphopt rules generate` rebuilds.  (It used to hash those modules'
# source, so any edit - a comment, a moved import - invalidated the shipped library's key.)
LIBRARY_VERSION = 1


def cache_key(max_ops: int, timeout_ms: int) -> str:
    """Key of one library build: the version, the operator set (a new op always rebuilds) and the options."""
    text = f"v{LIBRARY_VERSION}|ops={','.join(sorted(ops.REGISTRY))}|max_ops={max_ops}|timeout_ms={timeout_ms}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# The generator, pruning, properties and verifier (Z3) are imported where they run: this module is also the
# `rules` sub-command of every `graphopt` call, and none of them is needed to show or count rules.


def _enumerate(args: tuple[Any, int]) -> tuple[str, dict[str, int], list[Rule]]:
    from graphopt import generator
    domain, max_ops = args
    en = generator.enumerate_domain(domain, max_ops)
    st, rules = generator.candidate_rules(en)
    return domain.name, {"graphs": en.graphs, **vars(st)}, rules


def generate(max_ops: int = 3, jobs: int = 2, timeout_ms: int = 1500, progress: bool = True,
             ) -> tuple[list[Rule], dict[str, Any]]:
    """Build the library from scratch; returns (verified rules, meta with statistics)."""
    from graphopt import generator, prune
    from graphopt.properties import PROPERTIES
    from graphopt.verifier import verify_rules

    t0 = time.perf_counter()
    domains = generator.default_domains()
    work = [(d, max_ops) for d in domains]
    if jobs > 1:
        with mp.get_context("fork").Pool(min(jobs, len(work))) as pool:
            results = pool.map(_enumerate, work, chunksize=1)
    else:
        results = [_enumerate(w) for w in work]
    t_enum = time.perf_counter() - t0
    per_domain = {name: st for name, st, _ in results}
    candidates: list[Rule] = []
    for _, _, rules in results:
        candidates.extend(rules)
    unique = prune.dedup(candidates)
    t_prune = time.perf_counter() - t0 - t_enum

    verdicts: dict[int, str] = {}
    times: list[float] = []
    bar = progress_bar(progress, total=len(unique), desc="verifying rules", unit="rule")
    for i, v in verify_rules(unique, jobs=jobs, timeout_ms=timeout_ms):
        verdicts[i] = v.status
        times.append(v.seconds)
        bar.update(1)
    bar.close()
    shipped = [unique[i] for i in range(len(unique)) if verdicts[i] == "verified"]
    rules = [Rule(_name(k, r), r.src, r.dst, True, r.input_ranks) for k, r in enumerate(shipped)]
    seconds = time.perf_counter() - t0
    tot = lambda key: sum(st[key] for st in per_domain.values())  # noqa: E731
    stats = {
        "enumerated_graphs": tot("graphs"),
        "candidate_pairs": tot("candidate_pairs"),
        "verified": len(shipped),
        "rejected": tot("float_rejected") + sum(1 for s in verdicts.values() if s == "rejected"),
        "unverified": sum(1 for r in rules if not r.verified),
        "after_pruning": len(rules),
        "properties": len(PROPERTIES),
        "seconds": round(seconds, 1),
        "max_ops": max_ops,
    }
    meta = {
        "stats": stats,
        "details": {
            "unproved_candidates": sum(1 for s in verdicts.values() if s == "unverified"),
            "z3_rejected": sum(1 for s in verdicts.values() if s == "rejected"),
            "float_rejected": tot("float_rejected"),
            "pruned_common_subgraph": tot("common_subgraph"),
            "pruned_common_final_op": tot("common_final_op"),
            "not_a_rule": tot("not_a_rule"),
            "renaming_duplicates_and_reorderings": len(candidates) - len(unique),
            "sent_to_z3": len(unique),
            "reduction_factor": round(stats["candidate_pairs"] / max(1, len(rules)), 1),
            "properties_taso": sum(1 for p in PROPERTIES if p.origin == "taso"),
            "properties_ours": sum(1 for p in PROPERTIES if p.origin == "ours"),
            "seconds_enumerate": round(t_enum, 1),
            "seconds_prune": round(t_prune, 1),
            "seconds_verify": round(seconds - t_enum - t_prune, 1),
            "z3_timeout_ms": timeout_ms,
            "jobs": jobs,
            "per_domain": per_domain,
        },
        "unproved": [unique[i].render() for i in sorted(verdicts) if verdicts[i] != "verified"],
        "cache_key": cache_key(max_ops, timeout_ms),
    }
    return rules, meta


def _name(k: int, r: Rule) -> str:
    ops = lambda p: "+".join(n.op for n in p.nodes) or "id"  # noqa: E731
    return f"r{k:04d}:{ops(r.src)}->{ops(r.dst)}"


def generate_cached(output: Path, max_ops: int, jobs: int, timeout_ms: int, force: bool = False,
                    progress: bool = True) -> tuple[dict[str, Any], bool]:
    """Generate into ``output`` unless it (or the cache) already holds this exact build; returns (meta, hit)."""
    key = cache_key(max_ops, timeout_ms)
    if not force and output.exists():
        try:
            if load_meta(output).get("cache_key") == key:
                return load_meta(output), True
        except (ValueError, KeyError):
            pass
    cached = rules_cache_dir() / f"rules-{key}.json"
    if not force and cached.exists():
        write_bytes_atomic(output, cached.read_bytes())
        return load_meta(output), True
    rules, meta = generate(max_ops, jobs, timeout_ms, progress)
    save_rules(rules, output, meta)
    try:
        write_bytes_atomic(cached, output.read_bytes())
    except OSError:
        pass  # a read-only home only costs the cross-path cache
    return meta, False


# ---- CLI ---------------------------------------------------------------------------------------------------

def add_rules_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``graphopt rules {generate,stats,show,check-properties}``."""
    p = sub.add_parser("rules", help="build and inspect the verified substitution library")
    rs = p.add_subparsers(dest="rules_command", required=True)
    g = rs.add_parser("generate", help="enumerate, prune and Z3-verify the rule library")
    g.add_argument("--max-ops", type=int, default=3, help="operators per graph (default 3)")
    g.add_argument("-o", "--output", default=str(LIBRARY_PATH), help="library file (default: the shipped one)")
    g.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    g.add_argument("--timeout-ms", type=int, default=1500, help="Z3 time limit per rule")
    g.add_argument("--force", action="store_true", help="rebuild even if the cache is up to date")
    g.set_defaults(run=_run_generate)
    s = rs.add_parser("stats", help="statistics of a library")
    s.add_argument("--library", default=str(LIBRARY_PATH))
    s.add_argument("--json", help="also write the statistics to this file")
    s.set_defaults(run=_run_stats)
    sh = rs.add_parser("show", help="print rules readably")
    sh.add_argument("--library", default=str(LIBRARY_PATH))
    sh.add_argument("--grep", help="only rules whose name or text contains this")
    sh.set_defaults(run=_run_show)
    c = rs.add_parser("check-properties", help="prove every operator property on small concrete shapes")
    c.add_argument("--per-params", type=int, default=2, help="shape instances per parameter combination")
    c.add_argument("--no-redundancy", action="store_true", help="skip the redundancy check")
    c.add_argument("--json", help="also write the results to this file")
    c.set_defaults(run=_run_check)


def _library(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise UserError(f"rule library {p} does not exist: run `graphopt rules generate -o {p}`")
    return p


def _run_generate(args: argparse.Namespace) -> int:
    if args.max_ops < 1 or args.jobs < 1:
        raise UserError("--max-ops and --jobs must be at least 1")
    check_output_file(args.output, "-o")
    meta, hit = generate_cached(Path(args.output), args.max_ops, args.jobs, args.timeout_ms, args.force)
    if hit:
        log.warning("note: %s is up to date (cache key %s)", args.output, meta["cache_key"])
    print(json.dumps(meta["stats"]))
    return 0


def _run_stats(args: argparse.Namespace) -> int:
    if args.json:
        check_output_file(args.json, "--json")
    path = _library(args.library)
    meta = load_meta(path)
    rules = load_rules(path, verified_only=False)
    stats = dict(meta.get("stats", {}))
    # what the optimizer actually loads, recounted from the file rather than trusted from meta
    stats["after_pruning"] = sum(1 for r in rules if r.verified)
    stats["unverified"] = sum(1 for r in rules if not r.verified)
    stats = {k: stats.get(k) for k in STATS_KEYS}
    text = json.dumps(stats)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    return 0


def _run_show(args: argparse.Namespace) -> int:
    for r in load_rules(_library(args.library), verified_only=False):
        line = f"{r.name}: {r.render()}" + ("" if r.verified else "   [UNVERIFIED]")
        if not args.grep or args.grep in line:
            print(line)
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from graphopt.properties import PROPERTIES, check_property
    from graphopt.verifier import redundant_properties
    if args.json:
        check_output_file(args.json, "--json")
    results = []
    for p in PROPERTIES:
        r = check_property(p, per_params=args.per_params)
        results.append({"name": p.name, "origin": p.origin, "ok": r.ok, "instances": r.instances,
                        "counterexample": r.counterexample})
        print(f"{'ok  ' if r.ok else 'FAIL'} {p.name:32s} {r.instances:3d} instances {r.counterexample}")
    redundant = [] if args.no_redundancy else redundant_properties(PROPERTIES)
    if redundant:
        print("redundant (provable from the others): " + ", ".join(redundant))
    failed = [r["name"] for r in results if not r["ok"]]
    summary = {"properties": len(results), "validated": len(results) - len(failed), "failed": failed,
               "redundant": redundant}
    print(json.dumps(summary))
    if args.json:
        write_text_atomic(args.json, json.dumps({**summary, "results": results}, indent=1) + "\n")
    return 0 if not failed else 1
