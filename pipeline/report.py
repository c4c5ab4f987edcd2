"""report.json's opening facts (schema version, creation time, versions, CPU), report.md, the human-readable
summary of an optimize-model build's report.json, and the lines the CLI prints from it.  Apart from
:func:`build_facts`, which reads the machine, pure formatting of the report's dict: no TVM.

report.json's layout is published as a JSON Schema beside this module (``report_schema.json``); a change of
what a field means, or its removal, raises :data:`SCHEMA_VERSION`."""
from __future__ import annotations

import platform
from datetime import datetime, timezone
from typing import Any

import numpy as np

from graphopt.console import engine_versions, version
from graphopt.dims import sizes_text
from kerneltune.targets.caches import host_caches
from kerneltune.targets.host import host_model_name

SCHEMA_VERSION = 2

# What a latency ratio means, said once beside one: every output gives ours / the baseline's as a time ratio.
RATIO_MEANING = "lower is faster"


def time_ratio(ours_ms: float, baseline_ms: float | None, baseline: str = "onnxruntime") -> str:
    """A latency ratio in the one wording every output uses (report.md, optimize-model's last line,
    bench-model): "0.56x onnxruntime's time", our time over the baseline's, so below 1x is faster.  (report.md
    said "speed-up 1.78x" and bench-model "vs ORT 0.53x" for the same build: two conventions, one number
    read both ways.)  "-" when the baseline has no time."""
    return f"{ours_ms / baseline_ms:.2f}x {baseline}'s time" if baseline_ms else "-"


def build_facts() -> dict[str, Any]:
    """What a reader comparing two report.json files needs before any figure: the schema, when the build ran,
    the tool's and its engines' versions and the CPU it was timed on (a latency means little without them)."""
    return {"schema_version": SCHEMA_VERSION,
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "versions": {"optimize_model": version(), **engine_versions(), "numpy": np.__version__,
                         "python": platform.python_version()},
            "cpu": {"model": host_model_name(), "caches": host_caches()}}


def slower_warning(latency: dict[str, Any], tuned: bool, layout: str | None = None, convs: bool = True) -> str | None:
    """The one line optimize-model prints when the build it ships is slower than onnxruntime end to end
    (never silently slower), with what to try (``layout``: the ``--layout`` the build used; the other
    conv layouts are what it suggests, where the model has convolutions: ``convs``)."""
    if not latency.get("slower_than_onnxruntime"):
        return None
    other = "auto" if layout == "nchwc" else "nchwc"
    if not convs:  # a transformer: the layout stage changes nothing in it
        hint = "tune longer (more --trials)" if tuned else "tune it (--trials 500 is a start)"
    else:
        hint = (f"tune longer (more --trials) or try --layout {other}" if tuned else
                f"tune it (--trials 500 is a start) or try --layout {other}")
    return (f"warning: this build runs {latency['compiled_ms']} ms per inference, onnxruntime "
            f"{latency['onnxruntime_ms']} ms: slower than onnxruntime on this CPU; {hint}")


def latency_phrase(latency: dict[str, Any]) -> str:
    """The end-to-end latency in a few words, ours first and the ratio as a time ratio (lower is better), the
    one convention of every output; or why it was not measured."""
    if not latency.get("measured"):
        return f"latency not measured ({latency.get('reason') or 'unknown reason'})"
    ours, ort = latency["compiled_ms"], latency["onnxruntime_ms"]
    ratio = f": {time_ratio(ours, ort)} ({RATIO_MEANING})" if ort else ""
    return f"{_ms(ours)} per inference, onnxruntime {_ms(ort)}{ratio}"


def served_phrase(served: dict[str, Any] | None) -> str:
    """The sizes a build serving a range runs (``report.json``'s ``served``), and where it was measured; ""
    for a build of fixed sizes."""
    if not served:
        return ""
    ranges = ", ".join(f"{name} {lo}..{hi}" for name, (lo, hi) in served["ranges"].items())
    at = ", ".join(f"{name}={size}" for name, size in served["representative"].items())
    return f"serves {ranges} (measured at {at})"


def result_line(report: dict[str, Any], out_dir: str, check: str) -> str:
    """optimize-model's last line: what was written, the check, the latency (and the range a build serves)
    and where the summary is."""
    served = served_phrase(report.get("served"))
    return (f"wrote {out_dir}/optimized.onnx, model.so, report.json ({len(report['tasks'])} kernels; {check}); "
            f"{latency_phrase(report['latency'])}{'; ' + served if served else ''}; summary: {out_dir}/report.md")


def _ms(value: float | None) -> str:
    """Milliseconds to 4 significant digits (a 2 us kernel and a 120 ms model alike)."""
    return "-" if value is None else f"{value:.4g} ms"


def _flop(value: float) -> str:
    """A FLOP count in the unit that leaves a readable number (a reshape's 0 and a matmul's 16.8 MFLOP)."""
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} FLOP"


def _n(count: int, noun: str) -> str:
    """``3 input sets``, ``1 output``."""
    return f"{count} {noun}{'s' * (count != 1)}"


def _counts(counts: dict[str, int]) -> str:
    """``{"LSTM": 2, "GRU": 1}`` as "2 LSTM, 1 GRU"; "none" when empty."""
    return ", ".join(f"{n} {k}" for k, n in counts.items()) or "none"


_SECONDS_FACTS = ("cost_before", "cost_after")  # the graph stage's cost model prices in seconds


def _plain(key: str, value: Any) -> str | None:
    """A fact no stage phrase covers, in words: the key's words, the value with its unit; None when empty."""
    if value is None or value == {} or value == [] or value == "":
        return None
    words = key.replace("_", " ")
    if isinstance(value, bool):
        return f"{words}: {'yes' if value else 'no'}"
    if isinstance(value, (int, float)) and "ms" in key.split("_"):
        return f"{words.replace(' ms', '')}: {_ms(value)}"
    if isinstance(value, (int, float)) and key in _SECONDS_FACTS:
        return f"{words}: {_ms(value * 1e3)}"
    if isinstance(value, (int, float)) and key.split("_")[-1] in ("s", "seconds"):
        return f"{words.rsplit(' ', 1)[0]}: {value:.2f} s"
    if isinstance(value, dict):
        return f"{words}: " + ", ".join(f"{k} {v}" for k, v in value.items())
    if isinstance(value, list):
        return f"{words}: {len(value)}"
    return f"{words}: {value}"


def _graph(st: dict[str, Any]) -> list[str]:
    if st.get("skipped"):
        return [f"skipped (--skip-graph), {st['nodes']} nodes"]
    facts = [f"{st['nodes_before']} -> {st['nodes_after']} nodes",
             f"rewrites applied: {_counts(st.get('applied') or {})}",
             f"priced {_ms(st['cost_before'] * 1e3)} -> {_ms(st['cost_after'] * 1e3)} (sum of measured kernels)"]
    if st.get("e2e_ms_before") is not None:
        facts.append(f"whole model {_ms(st['e2e_ms_before'])} -> {_ms(st.get('e2e_ms_after'))}")
    facts.append(f"kept the {st['kept']} graph (end-to-end check {st['e2e_check']}"
                 + (f": {st['e2e_decision']})" if st.get("e2e_decision") else ")"))
    facts.append(f"search {st['stopped_by']}" + ("" if st.get("stop_reason") == "complete"
                                                  else f", {st.get('stop_reason')}"))
    return facts + [p for p in (_plain(k, st.get(k)) for k in ("pricing_failures", "estimated_prices",
                                                               "frozen_weights")) if p and not p.endswith(": 0")]


def _partition(st: dict[str, Any]) -> list[str]:
    facts = [f"{_n(st['tasks'], 'fused kernel')}, {st['tunable']} with a tuning template",
             f"{_flop(st['gflop'] * 1e9)} per inference"]
    lay = st.get("layout") or {}
    if lay.get("convs"):
        kept = _counts(lay.get("kept_nchw") or {})
        facts.append(f"conv layout {lay['mode']}: {lay['blocked']} of {lay['convs']} convs in NCHWc blocks, "
                     f"{lay['transforms']} layout transforms left" + ("" if kept == "none" else f", NCHW kept: {kept}"))
    elif lay:
        facts.append("no convs (no layout stage)")
    return facts


def _tune(st: dict[str, Any]) -> list[str]:
    if st.get("skipped"):
        return [f"skipped ({st.get('reason')})"]
    return [f"{st['trials']} trials ({st['measured_now']} measured in this run) by {st['searcher']}, "
            f"spread by {st['scheduler']}", *_stopped(st),
            f"tuned kernels {_ms(st['kernel_ms_before'])} -> {_ms(st['kernel_ms_after'])} per inference "
            "(alone, times calls)", f"records in {st['records']}"]


def _stopped(st: dict[str, Any]) -> list[str]:
    """Why tuning stopped, when not simply at the end of its budget (reports from before it was recorded say
    nothing)."""
    reason = st.get("stop_reason")
    early = st.get("early_stopped") or []
    if reason in (None, "budget") and not early:
        return []
    words = {"budget": "budget spent", "timeout": f"stopped at the --timeout of {st.get('timeout_s') or 0:g} s",
             "early_stop": "stopped early: every task stopped improving",
             "exhausted": "stopped early: every search space measured whole"}.get(reason, str(reason))
    return [words + (f" ({len(early)} tasks early-stopped after {st.get('early_stop')} trials without a gain)"
                     if early else "")]


def _sanity(st: dict[str, Any]) -> list[str]:
    if not st.get("checked"):
        return ["not checked"]
    return [f"{st['kernels']} template kernels held to {st['floor']:.0%} of this CPU's roofline "
            f"({st['peak_gflops']:g} GFLOP/s peak, {st['bandwidth_gbs']:g} GB/s)",
            f"{len(st.get('flagged') or [])} under it, {st['replaced']} replaced"]


def _compile(st: dict[str, Any]) -> list[str]:
    verdict = "matches" if st.get("ok") else "differs"
    facts = [f"{st['checked']}: {verdict} on {_n(st['input_sets'], 'input set')}, {_n(st['outputs'], 'output')}",
             f"max abs err {st['max_abs_err']:.3g}, max rel err {st['max_rel_err']:.3g} "
             f"(tolerance {st['atol']:g} abs, {st['rtol']:g} rel)"]
    if st.get("top1_agreement") is not None:
        facts.append(f"top-1 agreement {st['top1_agreement']:.1%}")
    if st.get("not_run"):
        facts.append(f"kernels not run here: {st['not_run']}")
    return facts


def _latency(st: dict[str, Any]) -> list[str]:
    return [f"ours {_ms(st['compiled_ms'])}, onnxruntime {_ms(st['onnxruntime_ms'])}"]


def _dynamic(st: dict[str, Any]) -> list[str]:
    return [f"optimized.onnx: {st['optimized_onnx']}", f"{st['restored_nodes']} shape nodes restored"]


def _legalize(st: dict[str, Any]) -> list[str]:
    return [f"lowered for TVM: {_counts(st.get('lowered') or {})}",
            f"{st.get('shape_nodes_folded', 0)} shape nodes folded", f"{st['nodes']} nodes"]


_STAGES = {"legalize": _legalize, "graph": _graph, "partition": _partition, "tune": _tune, "sanity": _sanity,
           "compile": _compile, "latency": _latency, "dynamic_shapes": _dynamic}
# per-item detail (tasks, kernels, Winograd's layer prices) stays in report.json
_HIDDEN = ("time_s", "tasks", "schedules", "e2e", "flagged", "winograd")


def stage_summary(name: str, st: dict[str, Any]) -> str:
    """One stage's facts in words with units; a stage (or a fact) this module does not know, key by key."""
    try:
        facts = _STAGES[name](st)
    except KeyError:  # a stage without a phrase, or a phrase whose facts this report lacks
        facts = [p for p in (_plain(k, v) for k, v in st.items() if k not in _HIDDEN) if p]
    return "; ".join(facts)


def _first_nodes(report: dict[str, Any]) -> dict[str, str]:
    """Kernel name -> the ONNX nodes of its first call, shortened (report.json ``call_sites``)."""
    out: dict[str, str] = {}
    for site in report.get("call_sites") or []:
        nodes = site.get("nodes") or []
        if nodes and site["kernel"] not in out:
            out[site["kernel"]] = f"`{nodes[0]}`" + (f" +{len(nodes) - 1}" if len(nodes) > 1 else "")
    return out


def _kernels(report: dict[str, Any]) -> list[str]:
    timed = any(t.get("ms") is not None for t in report["tasks"])
    total = sum(t.get("ms") or 0.0 for t in report["tasks"]) or 1.0
    nodes = _first_nodes(report)
    head = ("| idx | kind | calls | work per call | schedule |" + (" ms per inference | share |" if timed else "")
            + " ONNX nodes (first call) | name |")
    lines = ["## Kernels", "", "calls: times one inference runs the kernel; schedule: `template` (our tiling "
             "template's default), `tuned` (a tuned config), `sanity` (a config replacing a default far under this "
             "CPU's roofline), `cpu-rule` (TVM's rules and ours)"
             + ("; ms per inference: all its calls, timed one by one inside the shipped build" if timed else "")
             + "; ONNX nodes: of optimized.onnx (`run-model DIR --profile` shows every call, beside onnxruntime's "
               "profile of the same nodes).", "", head, "|---" * head.count(" |") + "|"]
    for t in report["tasks"]:
        ms = t.get("ms")
        time = (f" {_ms(ms)} | {ms / total:.1%} |" if ms is not None else " - | - |") if timed else ""
        names = t.get("names") or [t["name"]]
        where = next((nodes[n] for n in names if n in nodes), "-")
        lines.append(f"| {t['index']} | {t['kind']} | {t['weight']} | {_flop(t['flops'])} | {t['schedule']} |"
                     f"{time} {where} | {t['name']} |")
    return lines


def _plots(report: dict[str, Any]) -> list[str]:
    plot = (report.get("files") or {}).get("tuning_plot")
    return ["## Plots", "", f"- tuning: best kernel time per task against trials: [{plot}]({plot})", ""] \
        if plot else []


def report_markdown(report: dict[str, Any]) -> str:
    """A human-readable summary of report.json: every time with its unit, the end-to-end latency first."""
    lines = [f"# optimize-model: {report['model']} on {report['target']}", ""]
    lat = report.get("latency") or {}
    if lat.get("measured"):
        threads = f"{lat['threads']} thread{'s' * (lat['threads'] != 1)}"
        lines += ["## End-to-end latency", "",
                  f"- compiled model (model.so): **{_ms(lat['compiled_ms'])}** per inference "
                  f"(best {_ms(lat['compiled_min_ms'])})",
                  f"- onnxruntime on the input model: {_ms(lat['onnxruntime_ms'])} "
                  f"(best {_ms(lat['onnxruntime_min_ms'])})",
                  f"- ours: {time_ratio(lat['compiled_ms'], lat['onnxruntime_ms'])} ({RATIO_MEANING}; "
                  f"{threads}; {lat['runs']} runs each, median of alternating blocks; `bench-model DIR` times "
                  "this build longer)", ""]
    elif lat:
        lines += ["## End-to-end latency", "", f"Not measured: {lat.get('reason')}.", ""]
    served = report.get("served")
    if served:  # pipeline.symbolic
        checked = ", ".join(sizes_text(c["sizes"]) for c in served.get("checked") or [])
        lines += ["## Sizes served", "",
                  f"One model.so {served_phrase(served)}; also checked against onnxruntime at "
                  f"{checked or 'no other size (the target does not run here)'}. Another size is refused in one "
                  "line.", ""]
    prec = report.get("precision") or {}
    if prec.get("precision") == "int8":  # pipeline.quantize
        acc = prec["accuracy_vs_fp32"]
        top1 = f", top-1 agreement {acc['top1_agreement']:.1%}" if acc.get("top1_agreement") is not None else ""
        cos = f", cosine {acc['cosine_similarity']:.6f}" if acc.get("cosine_similarity") is not None else ""
        lines += ["## Precision", "",
                  f"int8 by onnxruntime {prec['onnxruntime_version']} ({prec['method']}: {prec['why']}); vs the fp32 "
                  f"model on {prec['measured_on']} inputs: max abs err {float(acc['max_abs_err']):.3g}{cos}{top1}.",
                  ""]
    lines += _plots(report)
    lines += ["## Stages", "", "| stage | time | what it did |", "|---|---|---|"]
    for name, st in report["stages"].items():
        lines.append(f"| {name} | {st['time_s']:.2f} s | {stage_summary(name, st)} |")
    tune = report["stages"].get("tune", {})
    if tune.get("e2e"):
        e2e = tune["e2e"]
        ms = (f"; default build {_ms(e2e['default_ms'])}, tuned build {_ms(e2e['tuned_ms'])}"
              if e2e.get("tuned_ms") is not None else "")
        lines += ["", f"Shipped build: **{e2e['kept']}** (end-to-end check {e2e['status']}{ms})."]
        for size in e2e.get("sizes", []):
            lines.append(f"- at {sizes_text(size['sizes'])}: default build {_ms(size['default_ms'])}, tuned build "
                         f"{_ms(size['tuned_ms'])}"
                         + (" (the default faster: tuning lost there)" if size["default_faster"] else ""))
    if tune.get("tasks"):
        lines += ["", "## Tuned tasks", "", "| idx | task | calls | trials | default | best |",
                  "|---|---|---|---|---|---|"]
        for t in tune["tasks"]:
            lines.append(f"| {t['index']} | {t['name']} | {t['weight']} | {t['trials']} | {_ms(t['default_ms'])} "
                         f"| {_ms(t['best_ms'])} |")
    flagged = report["stages"].get("sanity", {}).get("flagged")
    if flagged:
        lines += ["", "## Kernels under the sanity floor", "",
                  "| idx | kernel | GFLOP/s in the model | roofline | default alone | replacement alone |",
                  "|---|---|---|---|---|---|"]
        for k in flagged:
            lines.append(f"| {k['index']} | {k['name']} | {k['gflops']:.1f} | {k['roofline_gflops']:.1f} | "
                         f"{_ms(k['default_ms'])} | {_ms(k['replacement_ms']) if k['replaced'] else 'kept'} |")
    lines += [""] + _kernels(report)
    return "\n".join(lines) + "\n"
