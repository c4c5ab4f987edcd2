"""report.md, the human-readable summary of an optimize-model build's report.json, and the one line the CLI
prints when the shipped build is slower than onnxruntime.  Pure formatting of the report's dict: no TVM."""
from __future__ import annotations

from typing import Any


def slower_warning(latency: dict[str, Any], tuned: bool, layout: str | None = None) -> str | None:
    """The one line optimize-model prints when the build it ships is slower than onnxruntime end to end
    (never silently slower), with what to try (``layout``: the ``--layout`` the build used; the other
    conv layouts are what it suggests)."""
    if not latency.get("slower_than_onnxruntime"):
        return None
    other = "auto" if layout == "nchwc" else "nchwc"
    hint = (f"tune longer (more --trials) or try --layout {other}" if tuned else
            f"tune it (--trials 500 is a start) or try --layout {other} for a CNN")
    return (f"warning: this build runs {latency['compiled_ms']} ms per inference, onnxruntime "
            f"{latency['onnxruntime_ms']} ms: slower than onnxruntime on this CPU; {hint}")


# report.json facts that are times, by name: the unit report.md prints them in.
_SECONDS_FACTS = ("cost_before", "cost_after")  # the graph stage's cost model prices in seconds


def _fact(key: str, value: Any) -> str:
    """``key=value`` with the unit of a time: milliseconds for latencies, seconds for durations."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        words = key.split("_")
        if "ms" in words:  # kernel_ms_after, e2e_ms_before, onnxruntime_ms
            return f"{key}={_ms(value)}"
        if key in _SECONDS_FACTS:
            return f"{key}={_ms(value * 1e3)}"
        if "s" in words or "seconds" in words:
            return f"{key}={value:.2f} s"
    return f"{key}={value}"


def _ms(value: float | None) -> str:
    """Milliseconds to 4 significant digits (a 2 us kernel and a 120 ms model alike)."""
    return "-" if value is None else f"{value:.4g} ms"


def report_markdown(report: dict[str, Any]) -> str:
    """A human-readable summary of report.json: every time with its unit, the end-to-end latency first."""
    lines = [f"# optimize-model: {report['model']} on {report['target']}", ""]
    lat = report.get("latency") or {}
    if lat.get("measured"):
        speedup = f"{lat['speedup']:.2f}x" if lat.get("speedup") else "-"
        threads = f"{lat['threads']} thread{'s' * (lat['threads'] != 1)}"
        lines += ["## End-to-end latency", "",
                  f"- compiled model (model.so): **{_ms(lat['compiled_ms'])}** per inference "
                  f"(best {_ms(lat['compiled_min_ms'])})",
                  f"- onnxruntime on the input model: {_ms(lat['onnxruntime_ms'])} "
                  f"(best {_ms(lat['onnxruntime_min_ms'])})",
                  f"- speed-up over onnxruntime: {speedup} ({threads}; {lat['runs']} runs each, {lat['timer']}; "
                  "`bench-model` for a longer comparison)", ""]
    elif lat:
        lines += ["## End-to-end latency", "", f"Not measured: {lat.get('reason')}.", ""]
    prec = report.get("precision") or {}
    if prec.get("precision") == "int8":  # pipeline.quantize
        acc = prec["accuracy_vs_fp32"]
        top1 = f", top-1 agreement {acc['top1_agreement']:.1%}" if acc.get("top1_agreement") is not None else ""
        cos = f", cosine {acc['cosine_similarity']:.6f}" if acc.get("cosine_similarity") is not None else ""
        lines += ["## Precision", "",
                  f"int8 by onnxruntime {prec['onnxruntime_version']} ({prec['method']}: {prec['why']}); vs the fp32 "
                  f"model on {prec['measured_on']} inputs: max abs err {float(acc['max_abs_err']):.3g}{cos}{top1}.",
                  ""]
    lines += ["## Stages", "", "| stage | time | facts |", "|---|---|---|"]
    for name, st in report["stages"].items():
        # per-item detail (tasks, kernels, Winograd's layer prices) stays in report.json
        hidden = ("time_s", "tasks", "schedules", "e2e", "flagged", "winograd")
        facts = ", ".join(_fact(k, v) for k, v in st.items() if k not in hidden)
        lines.append(f"| {name} | {st['time_s']:.2f} s | {facts} |")
    tune = report["stages"].get("tune", {})
    if tune.get("e2e"):
        e2e = tune["e2e"]
        ms = (f"; default build {_ms(e2e['default_ms'])}, tuned build {_ms(e2e['tuned_ms'])}"
              if e2e.get("tuned_ms") is not None else "")
        lines += ["", f"Shipped build: **{e2e['kept']}** (end-to-end check {e2e['status']}{ms})."]
    if tune.get("tasks"):
        lines += ["", "## Tuned tasks", "", "| idx | task | weight | trials | default | best |",
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
    lines += ["", "## Kernels", "", "| idx | kind | weight | GFLOP | schedule | name |", "|---|---|---|---|---|---|"]
    for t in report["tasks"]:
        lines.append(f"| {t['index']} | {t['kind']} | {t['weight']} | {t['flops'] / 1e9:.4f} | {t['schedule']} "
                     f"| {t['name']} |")
    return "\n".join(lines) + "\n"
