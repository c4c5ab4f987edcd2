"""The tuning stage of ``optimize-model`` and ``bench-model``: the model's fused tasks handed to kerneltune's
multi-task tuner (:func:`kerneltune.tune_tasks.tune_tasks`), the end-to-end check that decides which build
ships, and the plot of how the tuning went.

Which build ships (:func:`pick_build`).  Tuning judges kernels one by one; the model is judged whole (cold
weights, epilogues, every kernel in sequence - a kernel sum once said 66 ms of a model that ran in 125 ms).
So after compiling, the tuned build is timed against the default-schedule build (what ``--skip-tune``
gives) with :func:`graphopt.timing.compare`: the timer bench-model uses (alternating blocks of runs, the
order swapped between blocks) and the rule the graph stage keeps a rewrite by (:func:`graphopt.timing.decide`:
faster by :data:`E2E_MARGIN` in enough of 3 to 7 blocks for a sign test: 3 of 3 ... 6 of 7).  The tuned build ships only when it is
faster so; otherwise the default build ships and the report says tuning lost (slower
beyond the margin) or was undecided (within it).  Undecided keeps the default because the default is the
reference a tuned build has to beat, the same rule as a task's default config at the kernel level, and
because a 2% difference is inside what this shared machine's noise can fake either way.  A build serving a
range of sizes is tuned at its representative size; its tuned build must also not be slower than the default
at the other sizes it is checked at (:func:`pick_build`'s ``others``), or the default ships.

The same command must give the same artifact, and a timing is never exactly repeatable: the blocks are
recorded in the verdict store (:mod:`graphopt.verdicts`, beside the graph stage's and the layout search's
verdicts), keyed by the target and a fingerprint of the tuned configs and the model, and a rerun whose
tuning ends with the same configs judges those recorded blocks again (:func:`graphopt.timing.replay`)
instead of timing again: deterministic, and a changed keep rule reaches recorded runs too.  So rerunning or
resuming a finished run on this machine ships the same build; only a run whose tuning found other configs
measures anew.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from graphopt.dims import sizes_text
from graphopt.errors import UserError
from graphopt.feeds import random_inputs
from graphopt.fileio import save_figure
from graphopt.ir import Graph
from graphopt.timing import compare
from graphopt.verdicts import Verdicts, default_store
from kerneltune.opkinds import KINDS as OP_KINDS
from kerneltune.stopping import StopReason
from kerneltune.tune_tasks import TuningResult, TuningRun, TuningTask, tune_tasks
from pipeline.compile import CompiledModel, model_runner

log = logging.getLogger(__name__)
from pipeline.context import BuildContext
from pipeline.partition import FusedTask
from pipeline.stages import Lowered, build

E2E_MARGIN = 0.02  # the tuned build must be this much faster end to end to ship (graphopt's stage uses 2% too)
E2E_RUNS = 10  # timed runs per build per block


def tuning_run(ctx: BuildContext) -> TuningRun:
    """The context's tuning options as kerneltune's :class:`~kerneltune.tune_tasks.TuningRun` (its records file
    the context's); made before any long work, it refuses a target that cannot be tuned here without ``--rpc``."""
    opts = ctx.tuning
    return TuningRun(spec=ctx.spec, trials=opts.trials, records=ctx.records, scheduler=opts.scheduler,
                     searcher=opts.searcher, seed=ctx.seed, rpc=opts.rpc, progress=opts.progress, stop=opts.stop_rule)


def tune_model(tasks: list[FusedTask], run: TuningRun, measure_factory: Callable | None = None) -> TuningResult:
    """Tune ``tasks`` (those with a template) with ``run.trials`` measurements in total; see
    :func:`kerneltune.tune_tasks.tune_tasks` for the loop and ``measure_factory``."""
    # a served build's kernels are measured as they ship: the symbolic kernel, scheduled by each config and run
    # at the representative size (its instance's inputs).  Measuring the instance instead tuned tiles that the
    # symbolic kernel does not run (its row loop follows the length): MiniLM and BERT-base served 2..512,
    # 500 trials, cut their kernel sums 24% and 15% and ran 1.2-1.5x slower end to end
    tunable = [TuningTask(t.scheduled_task, t.weight, t.index) for t in tasks if t.task is not None]
    if not tunable:
        raise UserError(f"no selected task has a kernel template ({', '.join(OP_KINDS)}): nothing to tune; pick "
                        "tasks marked tunable in `tune-kernels MODEL --list` with --kernels")
    warning = budget_warning(run.trials, len(tunable))
    if warning:
        log.warning("%s", warning)
    result = tune_tasks(tunable, run, measure_factory)
    if result.stop_reason is StopReason.TIMEOUT:
        log.warning("note: %s", timeout_note(result))
    return result


def timeout_note(result: TuningResult) -> str:
    """The one line saying that ``--timeout`` ended tuning, and what is used instead of the full budget."""
    return (f"tuning stopped at the --timeout of {result.stop.timeout_s:g} s after {result.trials} trials; the "
            "best configs measured so far are used (rerun with the same --records to go on)")


def stop_fields(result: TuningResult) -> dict[str, Any]:
    """report.json's (and ``tune-kernels MODEL --json``'s) account of how tuning ended: why it stopped, the
    limits it ran under, and which tasks stopped improving."""
    return {"stop_reason": result.stop_reason.value, "timeout_s": result.stop.timeout_s,
            "early_stop": result.stop.early_stop,
            "early_stopped": [t.index for t in result.tasks if t.early_stopped]}


# Trials per task below which a search has nothing to work with: round 0 measures each task's default, and
# OpEvo's first generation needs a few more before it can select.
MIN_TRIALS_PER_TASK = 8


def budget_warning(trials: int, tasks: int) -> str | None:
    """One line when ``trials`` spread over ``tasks`` leave each task too few to search (the defaults are
    all most of them would get), else None."""
    if trials >= MIN_TRIALS_PER_TASK * tasks:
        return None
    if tasks > 1:
        over = f"over {tasks} tasks is about {trials / tasks:.1f} trials each, the first of them each task's default"
    else:
        over = "for 1 task (the first of them its default) is too few to search"
    fewer = ", or pick fewer tasks with --kernels" if tasks > 1 else ""
    return f"warning: --trials {trials} {over}: give --trials {MIN_TRIALS_PER_TASK * tasks} or more{fewer}"


@dataclass
class SizeVerdict:
    """A served build's tuned and default builds timed at one size other than the representative one
    (report.json's ``tune.e2e.sizes``): tuning there may have slowed what it sped up at the representative."""

    sizes: dict[str, int]
    status: str  # "measured" or "recorded"
    default_ms: float
    tuned_ms: float
    ratios: list[float]  # default / tuned, per block (the default is the candidate here)
    default_faster: bool  # beyond the margin: the tuned build loses at this size


@dataclass
class BuildChoice:
    """Which build ships after tuning, and the end-to-end evidence (report.json's ``tune.e2e``)."""

    kept: str  # "tuned" or "default"
    status: str  # "measured", "recorded" (a rerun: the stored verdict), or "skipped: <why>"
    default_ms: float | None = None
    tuned_ms: float | None = None
    ratios: list[float] = field(default_factory=list)  # tuned / default, per round
    margin: float = E2E_MARGIN
    sizes: list[SizeVerdict] = field(default_factory=list)  # a served build's other sizes, in the order timed

    @property
    def lost_at(self) -> SizeVerdict | None:
        """The size at which the tuned build, faster at the representative size, was slower; None if none."""
        return next((v for v in self.sizes if v.default_faster), None)

    @property
    def note(self) -> str | None:
        """One line for the user when tuning did not earn its place, else None."""
        if self.kept != "default" or self.tuned_ms is None or self.default_ms is None:
            return None
        lost = self.lost_at
        if lost is not None:
            return (f"tuning lost at {sizes_text(lost.sizes)}: the tuned build was slower there ({lost.tuned_ms:.3f} "
                    f"ms vs {lost.default_ms:.3f} ms with default schedules, margin {self.margin:.0%}) though faster "
                    f"at the representative size ({self.tuned_ms:.3f} vs {self.default_ms:.3f} ms); shipped the "
                    "default build")
        how = "slower" if self.tuned_ms > self.default_ms * (1 + self.margin) else "not faster beyond noise"
        return (f"tuning lost: the tuned build was {how} end to end ({self.tuned_ms:.3f} ms vs "
                f"{self.default_ms:.3f} ms with default schedules, margin {self.margin:.0%}); shipped the "
                "default build")

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"note": self.note}


def shipped_title(choice: BuildChoice) -> str:
    """The tuning plot's title: which build shipped and the end-to-end times that decided it."""
    if choice.tuned_ms is None or choice.default_ms is None:
        return f"shipped: the {choice.kept} build ({choice.status})"
    return (f"shipped: the {choice.kept} build (end to end {choice.tuned_ms:.3f} ms tuned vs {choice.default_ms:.3f} "
            f"ms default, margin {choice.margin:.0%}; {choice.status})")


def fingerprint(tuned: dict[str, Any], model_bytes: bytes) -> str:
    """The tuned build in the end-to-end check's verdict key: its tuned configs and the model compiled (the
    target and threads are the key's scope)."""
    blob = json.dumps({"tuned": sorted((k, repr(v)) for k, v in tuned.items()),
                       "model": hashlib.sha256(model_bytes).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def pick_build(tuned_build: CompiledModel, lowered: Lowered, ctx: BuildContext, tuned: dict[str, Any],
               model_bytes: bytes, timer: Callable | None = None,
               others: Sequence[tuple[Mapping[str, int], Callable[[], Graph]]] = ()
               ) -> tuple[CompiledModel, BuildChoice]:
    """The build to ship (the tuned one, or the default-schedule one) and why; see the module docstring.
    The blocks are kept in this machine's verdict store (:func:`graphopt.verdicts.default_store`).

    ``others``: a served build's other sizes (:meth:`pipeline.symbolic.Served.check_sizes`, each with a
    function giving the model's graph there: imported only when that size is timed, not on a rerun that
    replays recorded verdicts).  Tuning measures each kernel at the representative size only, and a tile that wins
    there can lose at 2 tokens or 512; so a tuned build faster at the representative size is timed again at
    each of these, and the default ships if it is faster beyond the margin at any (the same sign test, the
    two builds' roles swapped).  ``timer`` replaces :func:`graphopt.timing.time_blocks` (tests)."""
    spec = ctx.spec
    if not tuned:
        return tuned_build, BuildChoice("default", "skipped: no tuned config beat its default schedule")
    if ctx.tuning.rpc:
        return tuned_build, BuildChoice("tuned", "skipped: the kernels were measured on the --rpc device; the "
                                                 "model cannot be timed there")
    if not spec.can_run:
        return tuned_build, BuildChoice("tuned", f"skipped: cannot run {spec.kind} here ({spec.note})")
    verdicts = Verdicts(default_store(), f"tuning|{spec.target}|t{spec.threads}")
    key = fingerprint(tuned, model_bytes)
    built: list[CompiledModel] = []

    def default_build() -> CompiledModel:  # compiled once, and only when a block needs it or it ships
        if not built:
            built.append(build(lowered, spec, {}))
        return built[0]

    def judged(baseline: tuple[str, Callable], candidate: tuple[str, Callable], graph: Callable[[], Graph]):
        """(candidate faster, "recorded"/"measured", Comparison-like evidence) for two builds on ``graph()``'s
        seeded inputs: the stored verdict of a rerun, else timed now and stored."""
        stored = verdicts.recall(baseline[0], candidate[0])
        if stored is not None:  # a rerun of a finished run: today's rule on the recorded blocks, the same artifact
            return stored.judge(E2E_MARGIN)[0], "recorded", stored
        feeds = random_inputs(graph(), ctx.seed)
        verdict = compare(model_runner(baseline[1](), feeds), model_runner(candidate[1](), feeds), E2E_MARGIN,
                          E2E_RUNS, timer=timer, gap_s=0.0)  # two TVM builds: one engine
        verdicts.record(baseline[0], candidate[0], verdict)
        return verdict.faster, "measured", verdict.comparison

    faster, status, ev = judged(("default", default_build), (key, lambda: tuned_build),
                                lambda: lowered.imported.graph)
    choice = BuildChoice("tuned" if faster else "default", status, round(ev.baseline_ms, 4),
                         round(ev.candidate_ms, 4), [round(r, 4) for r in ev.ratios], E2E_MARGIN)
    for sizes, graph in others if faster else ():
        lost, status, ev = judged((key, lambda: tuned_build), (f"default at {sizes_text(sizes)}", default_build),
                                  graph)
        choice.sizes.append(SizeVerdict(dict(sizes), status, round(ev.candidate_ms, 4), round(ev.baseline_ms, 4),
                                        [round(r, 4) for r in ev.ratios], lost))
        if lost:
            choice.kept = "default"
            break
    return (tuned_build if choice.kept == "tuned" else default_build()), choice


LABEL_CHARS = 48  # task names longer than this are shortened in the plot (report.json has them whole)


def task_label(index: int, name: str) -> str:
    """A task's axis label: its index and name, shortened to :data:`LABEL_CHARS`."""
    short = name if len(name) <= LABEL_CHARS else name[:LABEL_CHARS - 3] + "..."
    return f"{index}: {short}"


NO_TEMPLATE, NOT_SELECTED = "no template", "not selected by --kernels"


def tuning_figure(result: TuningResult, untuned: Sequence[tuple[int, str, str]] = (), shipped: str | None = None):
    """The tuning plot as a matplotlib figure (tests inspect it before it is saved).

    Left, one row per task, named on the axis: its share of a model run (weight x latency per call) with
    the default schedule and after tuning; a task that got no trial beyond its default is a marker at its
    default latency, and the model's other tasks (``untuned``: (index, name, why), why
    :data:`NO_TEMPLATE` or :data:`NOT_SELECTED`) are listed as not tuned and why, so every kernel of the model
    appears.  Right, the objective (sum of weight x best latency) over the trials spent; ``shipped``, which
    build the end-to-end check shipped, is the figure's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    why = {i: w for i, _, w in untuned}
    entries = [(t.index, t.name, t) for t in result.tasks] + [(i, n, None) for i, n, _ in untuned]
    rows: list[tuple[str, Any]] = [(task_label(i, n), t if t is not None else why[i])
                                   for i, n, t in sorted(entries, key=lambda e: e[0])]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, max(4.0, 1.5 + 0.34 * len(rows))),
                                   gridspec_kw={"width_ratios": [3, 2]})
    share = [t.weight * t.default_ms for _, t in rows if not isinstance(t, str) and t.default_ms]
    note_x = min(share) if share else 1e-3  # where the text of rows without a bar starts (log axis)
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        """The legend label the first time, None after (one legend entry per kind of mark)."""
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for y, (_, t) in enumerate(rows):
        if isinstance(t, str):
            ax1.text(note_x, y, f"not tuned ({t})", va="center", fontsize=9,
                     color="0.4" if t == NO_TEMPLATE else "tab:purple")
            continue
        if t.default_ms is None and t.best_ms is None:
            ax1.text(note_x, y, "not measured (budget spent before it)", va="center", fontsize=9, color="0.4")
            continue
        default, final = t.default_ms, t.final_ms
        if t.trials <= 1 or final is None or default is None or final >= default:
            value = t.weight * (default if default is not None else final)
            kept = t.trials > 1  # tuned, but no config beat the default; else only the default was measured
            ax1.plot([value], [y], marker="D" if kept else "o", color="tab:gray", linestyle="none",
                     markerfacecolor="tab:gray" if kept else "none",
                     label=once("default kept (no faster config)" if kept else "default only (no trial beyond it)"))
            continue
        ax1.barh(y, t.weight * default, height=0.7, color="tab:gray", alpha=0.45, label=once("default schedule"))
        ax1.barh(y, t.weight * final, height=0.4, color="tab:blue", label=once("tuned"))
    ax1.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
    ax1.set_ylim(len(rows) - 0.5, -0.5)  # the first task on top
    ax1.set_xscale("log")
    ax1.set_xlabel("ms per model run (calls x latency per call)", fontsize=10)
    ax1.set_title("tasks: default schedule vs tuned", fontsize=11)
    ax1.tick_params(axis="x", labelsize=9)
    if labelled:
        ax1.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 1.2 / fig.get_figheight() / 4),
                   ncol=2, frameon=False)
    ax2.plot([x for x, _ in result.objective], [y for _, y in result.objective], marker=".")
    ax2.set_xlabel("trials (all tasks)", fontsize=10)
    ax2.set_ylabel("sum of calls x best latency, ms", fontsize=10)
    ax2.set_title(f"objective ({result.scheduler}, {result.searcher})", fontsize=11)
    ax2.tick_params(labelsize=9)
    if shipped:
        fig.suptitle(shipped, fontsize=11)
    fig.tight_layout()
    return fig


def plot_tuning(result: TuningResult, path: str | Path, untuned: Sequence[tuple[int, str, str]] = (),
                shipped: str | None = None) -> None:
    """Write :func:`tuning_figure` to ``path`` (atomically, labels never cut: :func:`save_figure`)."""
    import matplotlib.pyplot as plt

    fig = tuning_figure(result, untuned, shipped)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
