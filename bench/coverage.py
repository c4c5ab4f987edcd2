"""Coverage of real exporter output: every corpus model x exporter through ``optimize-model --skip-tune`` and
``bench-model``, as a user would run them, with a table of what passes where.

    python bench/coverage.py                       # full size, every model and exporter (hours on 2 cores)
    python bench/coverage.py --models resnet,bert --exporters dynamo --size small --skip-bench
    python bench/coverage.py --resume              # skip the rows already in the JSON (it is rewritten per row)
    python bench/isa_mask.py python bench/coverage.py --target "llvm -mcpu=x86-64-v3"   # peers held to AVX2

For each model (:mod:`models.exported`, built and exported by ``python -m models export`` in a subprocess) the
commands run as subprocesses with a timeout; ``optimize-model`` runs with ``--debug`` so a failure leaves a
traceback, from which the failing step is read (the user-visible one-line message is reconstructed from it:
``error: MSG`` for a UserError, ``error: internal TYPE: MSG`` otherwise).  A run killed by the timeout gets
SIGABRT first, so Python's faulthandler (``PYTHONFAULTHANDLER``) prints where it was stuck.

Steps, in pipeline order: ``export`` (torch), ``import`` (input validation, ONNX -> graph IR, lowering of what
TVM lacks), ``graph`` (substitution search), ``relax`` (Relax import), ``partition``, ``compile``, ``check`` (vs
onnxruntime).  For a model that went through, the written ``model.so`` is run again here on the same seeded
inputs as the product's check (or the model's sample inputs) and compared with onnxruntime by the product's
one comparison (:mod:`graphopt.compare`: abs and scale-relative error, NaN/Inf by position, top-1 agreement
for classifier-like outputs).

Writes ``OUT.json`` (one object per row), ``OUT.md`` (the table: onnxruntime, OpenVINO where the ``[bench]``
extra is installed, our untuned build, the graph stage's decision and seconds, the layout report) and
``OUT.png`` (the latency ratios to onnxruntime), atomically after every row.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphopt.cost.cache import cache_dir  # noqa: E402
from graphopt.fileio import save_figure, write_text_atomic  # noqa: E402
from isa_mask import held_isa  # noqa: E402 - this folder's (a script's folder is first on sys.path)

STEPS = ("export", "import", "graph", "relax", "partition", "compile", "check")
# Function names in a traceback, innermost first wins, and the step they belong to.  Resolved from the frame
# below pipeline/optimize_model.py:optimize_model when possible (see _step_from_traceback).
_STAGE_FUNCS = {"check_model": "import", "load_model": "import", "import_onnx": "import",
                "legalize_for_tvm": "import", "graph_stage": "graph", "import_model": "relax",
                "to_relax": "relax", "partition": "partition", "compile_partition": "compile", "build": "compile",
                "schedule": "compile", "check_outputs": "check"}


@dataclass
class Row:
    model: str
    exporter: str
    size: str
    opset: int | None = None
    passed: list[str] = field(default_factory=list)  # steps that went through, in order
    failed_step: str | None = None
    error: str | None = None  # the one line a user sees
    export_s: float | None = None
    graph_s: float | None = None
    graph_kept: str | None = None  # original | optimized | merged (graph stage's end-to-end decision)
    graph_applied: dict | None = None
    graph_stopped_by: str | None = None  # budget | time limit | queue empty
    graph_e2e_ms: list | None = None  # the graph stage's whole-model timings [before, after] when it made them
    run_s: float | None = None  # whole optimize-model --skip-tune run, wall clock
    timed_out: bool = False
    tasks: int | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None  # max |ours - ref| / max |ref| (graphopt.compare)
    nonfinite_mismatch: int | None = None  # NaN/Inf in only one result
    top1_agreement: float | None = None  # classifier-like outputs
    layout: str | None = None  # the layout stage's report: mode, convs blocked, transforms, convs kept NCHW
    layout_s: float | None = None  # the layout stage and the partition (report.json's partition stage)
    ort_ms: float | None = None
    openvino_ms: float | None = None  # bench-model's OpenVINO engine (f32, latency hint), when installed
    tvm_ms: float | None = None
    bench_error: str | None = None
    notes: list[str] = field(default_factory=list)
    stderr_tail: str = ""


# ---------------------------------------------------------------------------------------------- subprocesses

def _script(name: str) -> list[str]:
    """The console script next to this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"error: console script {name!r} not found: pip install -e . in this environment")
    return [found]


@dataclass
class Proc:
    rc: int | None
    seconds: float
    stdout: str
    stderr: str
    timed_out: bool


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Proc:
    """Run ``cmd``; on timeout send SIGABRT (faulthandler dumps the Python stack), then SIGKILL."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True)
        timed_out = False
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            p.send_signal(signal.SIGABRT)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = None
        out.seek(0)
        err.seek(0)
        return Proc(rc, time.perf_counter() - t0, out.read(), err.read(), timed_out)


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONFAULTHANDLER"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


# ---------------------------------------------------------------------------------------------- tracebacks

_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')


def _frames(text: str) -> list[tuple[str, int, str]]:
    return [(f, int(n), fn) for f, n, fn in _FRAME.findall(text)]


def _step_from_traceback(text: str, message: str) -> str | None:
    """The pipeline step a traceback (or a faulthandler dump) was in."""
    if "differs from onnxruntime" in message:
        return "check"
    frames = _frames(text)
    # the frame called from optimize_model names the stage; within graph_stage, import_onnx is the import step
    for i, (f, _, fn) in enumerate(frames):
        if fn == "optimize_model" and f.endswith(os.path.join("pipeline", "optimize_model.py")) and i + 1 < len(frames):
            callee = frames[i + 1][2]
            if callee == "graph_stage":
                deeper = {g for _, _, g in frames[i + 2:]}
                return "import" if deeper & {"import_onnx", "legalize_for_tvm"} and "optimize_graph" not in deeper \
                    else "graph"
            if callee in _STAGE_FUNCS:
                return _STAGE_FUNCS[callee]
    for _, _, fn in reversed(frames):
        if fn in _STAGE_FUNCS:
            return _STAGE_FUNCS[fn]
    return None


def _exception(stderr: str) -> tuple[str, str] | None:
    """(type, first message line) of the last traceback in ``stderr``: the first unindented line after its
    frames."""
    lines = stderr.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    for ln in lines[starts[-1] + 1:]:
        if ln and not ln[0].isspace():
            typ, _, msg = ln.partition(": ")
            return typ.strip(), msg.strip()
    return None


def _user_line(stderr: str, rc: int | None = 1) -> str:
    """What the user would see without --debug (cli_entry's one line), rebuilt from the traceback; for a
    process killed by a signal, the signal and Python's fatal-error line (there is no message at all)."""
    if rc is not None and rc < 0:
        fatal = re.search(r"Fatal Python error: (.*)", stderr)
        return f"killed by {signal.Signals(-rc).name}" + (f" ({fatal.group(1).strip()})" if fatal else "") + \
            " - no message"
    exc = _exception(stderr)
    if exc is not None:
        typ, msg = exc
        if typ.endswith("UserError"):
            return f"error: {msg}"
        return f"error: internal {typ.rsplit('.', 1)[-1]}: {msg[:300]}"
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    return (errors or lines or [""])[-1][:300]


# ---------------------------------------------------------------------------------------------- the checks

def verify(out_dir: Path, original: Path, shapes: dict[str, list[int]], inputs: Path | None, threads: int,
           seed: int = 0) -> dict[str, Any]:
    """Run DIR/model.so and onnxruntime (on the original model) on the product's seeded check inputs, or on
    the model's sample inputs."""
    import numpy as np
    import onnx
    import tvm
    from tvm import relax

    from graphopt.compare import compare_outputs
    from graphopt.feeds import random_inputs, run_ort
    from graphopt.onnx_io import import_onnx
    from pipeline.compile import outputs_numpy

    optimized = onnx.load(str(out_dir / "optimized.onnx"))
    graph = import_onnx(optimized, {k: tuple(v) for k, v in shapes.items()} or None, require_static=True)
    feeds = dict(np.load(inputs)) if inputs else random_inputs(graph, seed)
    names = [i.name for i in graph.inputs if i.name not in graph.initializers]
    from kerneltune.native_log import quiet_native_stderr

    dev = tvm.cpu(0)
    with quiet_native_stderr():  # one 'Scope Loaded' warning per kernel otherwise
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(out_dir / "model.so")), dev)
        got = outputs_numpy(vm["main"](*[tvm.runtime.tensor(feeds[n], dev) for n in names]))
    ref_model = onnx.load(str(original))
    ref = run_ort(ref_model, feeds, threads)
    c = compare_outputs(ref, got)
    return {"max_abs_err": c.max_abs_err, "max_rel_err": c.max_rel_err,
            "nonfinite_mismatch": c.nan_mismatch + c.inf_mismatch, "top1_agreement": c.top1_agreement}


# ---------------------------------------------------------------------------------------------- one row

def run_row(model: str, exporter: str, size: str, work: Path, args: argparse.Namespace) -> Row:
    row = Row(model, exporter, size)
    env = _env(args.threads)
    if not args.warm_cache:  # a user's first run of this model: nothing priced yet (graph and layout prices)
        env["OPTIMIZE_MODEL_CACHE"] = str(work / f"{model}-{exporter}-{size}.cost-cache")
        shutil.rmtree(env["OPTIMIZE_MODEL_CACHE"], ignore_errors=True)
        # the CPU's calibration (kerneltune.calibrate: ~8 s once per machine, not per model) is kept
        Path(env["OPTIMIZE_MODEL_CACHE"]).mkdir(parents=True)
        for f in cache_dir().glob("calibration-*.json"):
            shutil.copy(f, env["OPTIMIZE_MODEL_CACHE"])
    path = work / f"{model}-{exporter}-{size}.onnx"
    meta_path = path.with_name(path.name + ".json")
    if not (path.exists() and meta_path.exists()):
        p = _run([sys.executable, "-m", "models", "export", model, "--exporter", exporter, "--size", size,
                  "-o", str(path)], args.timeout, env)
        if p.rc != 0:
            row.failed_step, row.error = "export", _user_line(p.stderr, p.rc) or f"exit {p.rc}"
            row.timed_out, row.stderr_tail = p.timed_out, p.stderr[-3000:]
            return row
    meta = json.loads(meta_path.read_text())
    row.opset, row.export_s = meta["opset"], meta["export_s"]
    row.passed.append("export")
    npz = path.with_name(meta["inputs"]) if meta.get("inputs") else None
    out_dir = work / f"{model}-{exporter}-{size}.out"
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = _script("optimize-model") + [str(path), "--skip-tune", "--no-progress", "--debug", "-o", str(out_dir),
                                       "--threads", str(args.threads), "--target", args.target] + meta["shape_args"]
    if args.skip_graph:
        cmd.append("--skip-graph")
    if npz is not None:
        cmd += ["--inputs", str(npz)]
    p = _run(cmd, args.timeout, env)
    row.run_s, row.timed_out, row.stderr_tail = round(p.seconds, 1), p.timed_out, p.stderr[-3000:]
    report_path = out_dir / "report.json"
    if p.rc == 0 and report_path.exists():
        report = json.loads(report_path.read_text())
        stages = report["stages"]
        graph = stages.get("graph", {})
        row.graph_s = graph.get("time_s")
        row.graph_kept = "skipped" if graph.get("skipped") else graph.get("kept")
        row.graph_applied = graph.get("applied")
        row.graph_stopped_by = graph.get("stopped_by")
        if graph.get("e2e_ms_before") is not None:
            row.graph_e2e_ms = [graph.get("e2e_ms_before"), graph.get("e2e_ms_after")]
        row.tasks = stages.get("partition", {}).get("tasks")
        row.layout = _layout_line(stages.get("partition", {}).get("layout"))
        row.layout_s = stages.get("partition", {}).get("time_s")
        row.passed += [s for s in STEPS[1:] if not (s == "graph" and args.skip_graph)]
        try:
            row.__dict__.update(verify(out_dir, path, meta["input_shapes"], npz, args.threads))
        except Exception as exc:  # noqa: BLE001 - a re-check failure is reported in the row, not fatal
            row.notes.append(f"re-check failed: {type(exc).__name__}: {str(exc).strip()[:200]}")
            row.max_abs_err = stages.get("compile", {}).get("max_abs_err")
    else:
        row.error = _user_line(p.stderr, p.rc) if not p.timed_out else f"timed out after {args.timeout:.0f} s"
        step = _step_from_traceback(p.stderr, row.error or "")
        row.failed_step = step or "unknown"
        if step in STEPS:
            row.passed += [s for s in STEPS[1:STEPS.index(step)] if not (s == "graph" and args.skip_graph)]
        m = re.search(r"max abs err ([0-9.eE+-]+|inf|nan)", row.error or "")
        if m:
            row.max_abs_err = float(m.group(1))
    if not args.skip_bench and row.failed_step is None:
        bench_json = work / f"{model}-{exporter}-{size}.bench.json"
        bench_json.unlink(missing_ok=True)
        bcmd = _script("bench-model") + [str(path), "--skip-graph", "--skip-metaschedule", "--no-progress",
                                         "--threads", str(args.threads), "--runs", str(args.runs), "--json",
                                         str(bench_json), "--target", args.target] + meta["shape_args"]
        if npz is not None:
            bcmd += ["--inputs", str(npz)]
        b = _run(bcmd, args.timeout, env)
        if b.rc == 0 and bench_json.exists():
            res = json.loads(bench_json.read_text())
            row.ort_ms, row.openvino_ms, row.tvm_ms = res.get("ort_ms"), res.get("openvino_ms"), res.get("tvm_ms")
        else:
            row.bench_error = (_user_line(b.stderr, b.rc) if not b.timed_out else f"timed out after {args.timeout:.0f} s")
    if not args.keep_outputs:
        shutil.rmtree(out_dir, ignore_errors=True)
    if not args.warm_cache:
        shutil.rmtree(env["OPTIMIZE_MODEL_CACHE"], ignore_errors=True)
    return row


def _layout_line(layout: Any) -> str | None:
    """report.json's layout stage in one cell: ``auto: 94/94 blocked, 2 transforms`` (+ the convs kept NCHW)."""
    if not isinstance(layout, dict):
        return None
    line = f"{layout.get('mode')}: {layout.get('blocked')}/{layout.get('convs')} blocked, " \
           f"{layout.get('transforms')} transforms"
    kept = sum((layout.get("kept_nchw") or {}).values())  # reason -> convs
    line += f", {kept} kept NCHW" if kept else ""
    e2e = (layout.get("search") or {}).get("e2e") or {}
    if e2e.get("ms_auto") is not None:  # a departure from the heuristic blocks, timed against them
        line += f", searched {e2e['ms_auto']:.2f} vs heuristic {e2e['ms_heuristic']:.2f} ms: {e2e['kept']} kept"
    return line + (f", failed: {str(layout['failed'])[:80]}" if layout.get("failed") else "")


# ---------------------------------------------------------------------------------------------- writing

def _finite(v: Any) -> Any:
    """JSON without NaN/Inf (not JSON): non-finite floats become their string names."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def markdown(rows: list[Row], header: dict[str, Any]) -> str:
    lines = ["# optimize-model coverage on real exporter output", "",
             f"{header['cpu']}, {header['threads']} threads, load average at start {header['load']}; "
             f"`optimize-model --skip-tune`{' --skip-graph' if header['skip_graph'] else ''}, timeout "
             f"{header['timeout']} s, {header['cost_cache']} cost cache; steps: {', '.join(STEPS)}.  rel err = "
             f"max |ours-ref| / max |ref| (graphopt.compare); top-1 = arg-max agreement on classifier-like outputs.",
             "", "| model | exporter | size | opset | passed | failed step | graph s | kept | layout | layout s | "
             "run s | abs err | rel err | top-1 | ORT ms | OpenVINO ms | TVM ms | TVM / ORT | error |", "|" + "---|" * 19]
    for r in rows:
        passed = f"{len(r.passed)}/{len(STEPS)}"
        err = (r.error or r.bench_error or "; ".join(r.notes) or "").replace("|", "\\|")
        lines.append(f"| {r.model} | {r.exporter} | {r.size} | {_fmt(r.opset)} | {passed} | {_fmt(r.failed_step)} | "
                     f"{_fmt(r.graph_s, '.1f')} | {_fmt(r.graph_kept)} | {_fmt(r.layout)} | "
                     f"{_fmt(r.layout_s, '.1f')} | {_fmt(r.run_s, '.1f')} | "
                     f"{_fmt(r.max_abs_err, '.2g')} | {_fmt(r.max_rel_err, '.2g')} | {_fmt(r.top1_agreement, '.0%')} | "
                     f"{_fmt(r.ort_ms, '.2f')} | {_fmt(r.openvino_ms, '.2f')} | {_fmt(r.tvm_ms, '.2f')} | "
                     f"{_fmt(_ratio(r.tvm_ms, r.ort_ms), '.2f')} | {err[:160]} |")
    ok = sum(r.failed_step is None for r in rows)
    lines += ["", f"{ok} of {len(rows)} went through."]
    return "\n".join(lines) + "\n"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def plot(rows: list[Row], path: Path, header: dict[str, Any]) -> None:
    """Bars of our untuned build's and OpenVINO's latency over onnxruntime's, one group per benchmarked row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.ort_ms and r.tvm_ms]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(2.0 + 0.7 * len(rows), 3.8))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [_ratio(r.tvm_ms, r.ort_ms) for r in rows], 0.4, label="ours, untuned")
    ax.bar([x + 0.2 for x in xs], [_ratio(r.openvino_ms, r.ort_ms) or 0 for r in rows], 0.4, label="OpenVINO")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(xs), [f"{r.model}\n{r.exporter}" for r in rows], fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("latency / onnxruntime's")
    ax.set_title(f"{header['cpu']}, {header['threads']} threads, {header['size']} size", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def write(rows: list[Row], out: Path, header: dict[str, Any]) -> None:
    data = {"header": header, "rows": [_finite(asdict(r)) for r in rows]}
    write_text_atomic(out.with_suffix(".json"), json.dumps(data, indent=1, allow_nan=False) + "\n")
    write_text_atomic(out.with_suffix(".md"), markdown(rows, header))
    plot(rows, out.with_suffix(".png"), header)


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    from models.exported import CORPUS, EXPORTERS, SIZES, get_spec
    from kerneltune.targets.host import host_model_name

    p = argparse.ArgumentParser(prog="bench/coverage.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help=f"comma-separated corpus models (default all: {','.join(CORPUS)})")
    p.add_argument("--exporters", help=f"comma-separated exporters (default all of each model's: {','.join(EXPORTERS)})")
    p.add_argument("--size", default="full", choices=SIZES, help="model size (default full)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per command (default 1800)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="--threads for both commands")
    p.add_argument("--target", default="llvm", help="--target for both commands, e.g. 'llvm -mcpu=x86-64-v3' (under "
                   "bench/isa_mask.py: onnxruntime and OpenVINO held to AVX2 beside it)")
    p.add_argument("--runs", type=int, default=30, help="bench-model --runs (default 30)")
    p.add_argument("--skip-bench", action="store_true", help="no bench-model run")
    p.add_argument("--skip-graph", action="store_true", help="optimize-model --skip-graph (no graph stage)")
    p.add_argument("--warm-cache", action="store_true",
                   help="use the user's per-op cost cache (default: an empty one per model, as on a first run)")
    p.add_argument("-o", "--out", default=str(ROOT / "bench" / "results" / "coverage"),
                   help="output path without suffix: writes OUT.json, OUT.md and OUT.png (default bench/results/coverage)")
    p.add_argument("--work-dir", help="keep the exported models here (reused when present) instead of a temp dir")
    p.add_argument("--keep-outputs", action="store_true", help="keep each optimize-model output directory")
    p.add_argument("--resume", action="store_true", help="keep the rows already in OUT.json and skip them")
    args = p.parse_args(argv)

    names = args.models.split(",") if args.models else list(CORPUS)
    wanted = set(args.exporters.split(",")) if args.exporters else set(EXPORTERS)
    for e in wanted - set(EXPORTERS):
        p.error(f"unknown exporter {e!r}: use {', '.join(EXPORTERS)}")
    pairs = [(n, e) for n in names for e in get_spec(n).exporters if e in wanted]
    out = Path(args.out)
    rows: list[Row] = []
    if args.resume and out.with_suffix(".json").exists():
        for d in json.loads(out.with_suffix(".json").read_text())["rows"]:
            rows.append(Row(**{k: v for k, v in d.items() if k in Row.__dataclass_fields__}))
    done = {(r.model, r.exporter, r.size) for r in rows}
    header = {"cpu": host_model_name(), "held_to": held_isa(), "target": args.target, "threads": args.threads,
              "load": os.getloadavg()[0], "size": args.size,
              "timeout": args.timeout, "skip_graph": args.skip_graph, "skip_bench": args.skip_bench,
              "cost_cache": ("warm (the user's)" if args.warm_cache
                             else "cold (empty per model, the CPU's calibration kept)"),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="coverage-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for model, exporter in pairs:
            if (model, exporter, args.size) in done:
                continue
            print(f"{model} / {exporter} / {args.size} ...", end=" ", flush=True)
            row = run_row(model, exporter, args.size, work, args)
            rows.append(row)
            write(rows, out, header)
            print(f"{'ok' if row.failed_step is None else 'FAILED at ' + row.failed_step} "
                  f"({_fmt(row.run_s, '.0f')} s){': ' + row.error if row.error else ''}", flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}: "
          f"{sum(r.failed_step is None for r in rows)} of {len(rows)} went through")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
