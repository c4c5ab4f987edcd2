"""The graph stage: substitution search -> finish -> whole-model check -> merge-everything alternative ->
Winograd alternative.

One function, :func:`optimize_graph`, is the stage; the ``graphopt optimize`` command, the pipeline
(``optimize-model``, ``bench-model``) and ``bench/graphopt_models.py`` all run it, so a benchmark measures
what the product ships.  :func:`optimize_onnx` is its ONNX-in, ONNX-out form with the output check.

Convolution biases are split off before the search (``Conv(x,w,b)`` -> ``Conv(x,w)`` + bias add, the form the
rules are written in) and fused back afterwards, so the exported model keeps ONNX's usual spelling.

Only the verified rule library (:func:`graphopt.rules.verified_library`) is used by default; the ONNX form
checks every result by running the input and the output model in onnxruntime on the same seeded random
inputs, so a wrong rewrite shows up as ``outputs_equal: false`` rather than as a silently different model.

The search adds up per-operator timings, which cannot see how the backend fuses and schedules the merged
kernels (an Inception block whose 1x1 convs were merged is cheaper by that sum but slower end to end in both
onnxruntime and TVM).  So when a substitution was applied and the cost model measures (``time_models``),
the whole input and the whole candidate are timed with the same engine, interleaved, and the candidate is
kept only if it is at least ``e2e_margin`` faster; otherwise the input graph is handed back unchanged
(:func:`check_end_to_end`).

The same blindness cuts the other way for merges: when the search keeps nothing, the graph with every
parallel matmul/conv group merged (:func:`merged_alternative`) is timed against the input too, and kept if it
is faster by the same margin (NASRNN, all 70 merges: priced +64% per operator, 1.04x faster end to end in TVM);
not when the search's result was merges alone and its kernels priced slower (:func:`merges_priced_slower`).

Last, the 3x3 convolutions that price cheaper as Winograd F(2x2,3x3) or F(4x4,3x3) (:mod:`graphopt.winograd`:
fewer multiplies, more memory traffic) are rewritten, layer by layer by price, and the result faces the same
end-to-end check (:func:`winograd_alternative`; VGG-19 at 224x224: 8 of its 16 convs, 1.30x end to end on
an Intel Xeon).

Timing two whole models costs two whole-model compiles first (13 s each for BERT-base on a 2-core Intel
Xeon), so a candidate is first priced the way the backend builds it, when the cost model's engine can
(:meth:`~graphopt.cost.base.CostModel.kernel_times`: the fused kernels the two graphs do not share, each
built alone, timed cold and cached by its structure, so a rewrite costs only the kernels it changed); only
a candidate whose kernels price cheaper by at least ``KERNEL_GATE`` x margin of the input's whole price is
timed end to end, and the input is kept otherwise ("priced").  A pass is confirmed first: those kernels are
timed once more, each at the faster of its two timings, since a pass on one slow cold timing of the input
costs two whole-model builds (BERT-base: 25-30 s).  The gate only ever keeps the input; keeping a
rewrite still takes the end-to-end verdict.  It also spares that verdict its false positives: ResNet-50's
merged downsample and first 1x1 conv, kept at 3% faster end to end in a cold run (3 of 3 blocks, sign test
p = 0.125), ran 0.99-1.02x the input in four more interleaved blocks, faster in two and slower in two
(Intel Xeon, 2 threads); its kernels price 0.4% slower.

Keep-or-reject is never decided on one noisy timing: the two whole models are timed in interleaved blocks,
the order swapped from block to block, until a sign test on the blocks says the candidate is faster by the
margin or it is clear it is not (:func:`graphopt.timing.decide`; undecided keeps the input).  The blocks are
recorded in the verdict store (:mod:`graphopt.verdicts`), keyed by both graphs, and a rerun replays them: the
same command on the same machine decides the same.

``time_limit`` bounds the whole stage, not just the search (issue 13: pricing, a second merge search and
the whole-model timings ran outside a 60 s search limit, 60-284 s per model): pricing and search get
``SEARCH_SHARE`` of it (operators not measured by then are priced by estimate, see
:meth:`~graphopt.cost.base.CostModel.set_deadline`), the end-to-end check and the merge alternative the rest,
each skipped - keeping the input, which is always correct - when no time is left.  ``stop_reason`` records
what the limit cut short.  (A TVM compile cannot be interrupted: one that starts before the deadline can end
after it, by at most one whole-model build.)

Initializers that the model also lists as graph inputs (the opset-9 model zoo's convention) are weights
unless ``weights_as_inputs`` is set (:meth:`graphopt.ir.Graph.freeze_weights`), and pricing goes through
:class:`~graphopt.cost.guard.GuardedCost`: an operator the cost model cannot run alone is priced by
estimate, logged once, and the stage goes on.
"""
from __future__ import annotations

import enum
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from graphopt.cost.base import CostModel
from graphopt.cost.guard import GuardedCost
from graphopt.cost.kernel_count import KernelCountCost
from graphopt.errors import UserError
from graphopt.compare import compare_runs
from graphopt.dynamic import INPUT_MODEL, DynamicShapes, dynamic_model, symbolic_inputs
from graphopt.feeds import feed_sets, run_ort_sets
from graphopt.ir import Graph
from graphopt.onnx_io import InputShapes, import_onnx, load_model
from graphopt.cleanup import eliminate_common_subexpressions, fold_constants, fuse_conv_bias, split_conv_bias
from graphopt.rules import Rule, merge_rules, verified_library
from graphopt.search import SearchResult, SearchStop, search
from graphopt.timing import MAX_BLOCKS, MIN_BLOCKS, decide

if TYPE_CHECKING:  # graphopt.winograd is loaded by the stage's last step only
    from graphopt.winograd import ConvSite

PATIENCE = 200  # dequeued graphs without a cheaper one before the search stops (see GraphStageOptions)
# The stage's default bound (--time-limit), seconds: a bound, not a budget to fill.  With the kernel-price
# gate and the patience, BERT-base and ResNet-50 finished on an empty price cache in 29 and 24 s (2-core Intel
# Xeon; 25 and 12 s since models are lowered without Relax's FoldConstant builds, pipeline.passes.fold).  Keeping
# Winograd on VGG-19 (1.30x end to end) takes about 85 s with its layers' prices cached: a
# 14 s search, two whole-model compiles of 18 and 25 s, the timing; under a 30 s bound it was never kept.  On
# an empty price cache it takes 116 s, past this bound: that run keeps the direct convs, the next Winograd.
# Inception-v3 took 66 s (27 pricing its 139 distinct operators); past the bound the rest is estimated or
# not tried.
TIME_LIMIT = 90.0
E2E_MARGIN = 0.02  # the candidate must be this much faster end to end, beyond timing noise, to be kept
E2E_RUNS = 20
# A block times each model about this long at most (never under MIN_E2E_RUNS runs): 20 runs of a 160 ms
# VGG-19 are 6.4 s a block, and the sign test counts blocks, not runs.  The first block takes its runs from
# the input's price when the gate priced it, the later ones from the block before.
E2E_BLOCK_S = 1.0
MIN_E2E_RUNS = 5
# The merge-everything search stops after this many graphs without fewer kernels.  Its price is a count that
# every merge lowers, so the best-first search reaches the fixpoint first and the rest of a PATIENCE of 200
# only reorders it: BERT-base's 24 Q/K/V merges came within the first 49 graphs, then 200 more took 7 of its
# 9 s (Intel Xeon, 2 cores).
MERGE_PATIENCE = 25
SEARCH_SHARE = 0.6  # of the stage's time limit, for pricing and search when whole models are timed after
MERGE_SHARE = 0.5  # of what is left after the end-to-end check, for the merge-everything search
# A candidate is timed end to end only if the fusion-aware price (its kernels, each timed alone) is lower than
# the input's by at least this share of the margin; otherwise the input is kept without timing either.
KERNEL_GATE = 0.5
# A convolution layer takes Winograd only where its kernels price at least this much below the direct conv's.
WINOGRAD_GAIN = 0.05
# Layers are priced for Winograd only when C*K/(C+K) reaches this: the batched matmul's work per transformed
# element (the transforms' traffic) grows with it, and below it the transforms cost more than the multiplies
# saved (one-layer models on a 2-core Intel Xeon, default schedules: VGG's 64-channel layer at 224x224 0.74x
# the direct conv, 128 channels at 112x112 0.79x; 256 at 56x56 1.24x, 512 at 28x28 1.49x).
WINOGRAD_MIN_WIDTH = 48
# The same bound where the engine has a Winograd kernel of its own (CostModel.blocked_winograd: kerneltune's
# NCHW[x]c kernel, its transforms inside the kernel's tiles, no layout copies): ResNet-50's 64-channel
# layer at 56x56 ran 1.2-2.0x faster as F(4x4) than direct alone (Intel Xeon, 2 threads), so thin layers
# are priced too.
KERNEL_MIN_WIDTH = 16
# A layer whose neighbours are no candidates (fed by and feeding direct convs) is not priced: it pays a layout
# transpose on each side, and none of the 16 such layers priced on a 2-core Intel Xeon paid (ResNet-50's,
# Inception-v3's 80->192 at 73x73 by 1%, VGG-19's 128->128 at 112x112, all 9 of GoogLeNet's: its 64->192 at
# 56x56 3.01 ms direct, 3.14 Winograd), while pricing GoogLeNet's took its graph stage from 38 s to its 90 s
# limit.  VGG-19's chained layers pay (1.3x the model).


@dataclass
class StageClock:
    """The stage's time limit, as deadlines on :func:`time.perf_counter`."""

    limit: float
    start: float = field(default_factory=time.perf_counter)

    def at(self, fraction: float) -> float:
        return self.start + fraction * self.limit

    @property
    def end(self) -> float:
        return self.at(1.0)

    def left(self, until: float | None = None) -> float:
        return max(0.0, (self.end if until is None else until) - time.perf_counter())


class StageStop(enum.Enum):
    """How the stage ended; the value opens report.json's ``stop_reason`` (a time limit's is followed by what
    it cut short, :class:`StageCut`)."""

    COMPLETE = "complete"
    TIME_LIMIT = "time limit"


class StageCut(enum.Enum):
    """A step the stage's time limit cut short, in stage order; the value is how report.json's
    ``stop_reason`` names it (pricing's with the number of operators estimated)."""

    PRICING = "pricing"
    SEARCH = "search"
    E2E_CHECK = "end-to-end check (input kept)"
    MERGE = "merge alternative"
    MERGE_NOT_TRIED = "merge alternative (not tried)"
    WINOGRAD = "winograd (layers not priced or not timed: kept direct)"

    def phrase(self, estimated: int) -> str:
        """The step in report.json's words; ``estimated``: the operators priced by estimate (pricing's)."""
        return f"pricing ({estimated} operators estimated, not measured)" if self is StageCut.PRICING else self.value


@dataclass(frozen=True)
class E2ESettings:
    """How a candidate is checked end to end (:func:`check_end_to_end`): whether at all, the margin it must
    beat, the interleaved runs per timing block.  The stage's come from :attr:`GraphStageOptions.e2e`."""

    enabled: bool = True
    margin: float = E2E_MARGIN
    runs: int = E2E_RUNS


@dataclass
class GraphStageOptions:
    """How the stage searches and checks (the cost model, a component, is passed beside it)."""

    alpha: float = 1.05  # keep graphs up to alpha x the best cost in the queue (1.0 = greedy; TASO: 1.05)
    budget: int = 1000  # most graphs to dequeue
    patience: int = PATIENCE  # stop after this many dequeued graphs without a cheaper one
    time_limit: float = TIME_LIMIT  # seconds for the whole stage: pricing, search, end-to-end checks, merge
    rules: list[Rule] | None = None  # None: the shipped verified library
    progress: bool = False
    e2e_check: bool = True  # time the whole input and candidate before keeping a rewrite
    e2e_margin: float = E2E_MARGIN
    e2e_runs: int = E2E_RUNS  # interleaved rounds per timing block (see graphopt.timing.decide)
    weights_as_inputs: bool = False  # keep initializers also listed as inputs overridable (not constants)
    winograd: bool = True  # offer Winograd for 3x3 convolutions (winograd_alternative; needs e2e_check)

    def validate(self) -> None:
        """One-line errors for values a user can pass on the command line."""
        if not self.alpha >= 1.0 or math.isinf(self.alpha):  # NaN fails every comparison: "not >=" catches it
            raise UserError(f"--alpha {self.alpha} must be a finite number of at least 1.0: use 1.0 (greedy) or "
                            "more (1.05 as in TASO)")
        if self.budget < 1:
            raise UserError(f"--budget {self.budget} must be at least 1")
        if self.patience < 1:
            raise UserError(f"--patience {self.patience} must be at least 1")
        if not self.time_limit > 0:
            raise UserError(f"--time-limit {self.time_limit} must be a positive number of seconds")
        if self.e2e_runs < 1:
            raise UserError(f"--e2e-runs {self.e2e_runs} must be at least 1")
        check_margin(self.e2e_margin)

    @property
    def e2e(self) -> E2ESettings:
        """The end-to-end check's settings (``e2e_check``, ``e2e_margin``, ``e2e_runs``)."""
        return E2ESettings(enabled=self.e2e_check, margin=self.e2e_margin, runs=self.e2e_runs)


@dataclass
class E2ECheck:
    """The end-to-end verdict on a search result: which graph is handed back, and why."""

    kept: str  # "optimized", "original", or "merged" (merged_alternative)
    status: str  # "measured", "recorded" (a verdict measured before), "disabled", "skipped: <reason>", "failed: ..."
    margin: float
    ms_before: float | None = None
    ms_after: float | None = None
    backend: str | None = None
    decision: str = ""  # why, in blocks (graphopt.timing.decide)
    ratios: tuple[float, ...] = ()
    # the fusion-aware prices (CostModel.kernel_times) of the kernels the two graphs do not share, when taken
    kernels_ms_before: float | None = None
    kernels_ms_after: float | None = None

    def report(self) -> dict[str, Any]:
        return {"kept": self.kept, "e2e_check": self.status, "e2e_ms_before": self.ms_before,
                "e2e_ms_after": self.ms_after, "e2e_backend": self.backend, "e2e_margin": self.margin,
                "e2e_decision": self.decision, "e2e_ratios": list(self.ratios),
                "kernels_ms_before": self.kernels_ms_before, "kernels_ms_after": self.kernels_ms_after}


def _timed_out(status: str, decision: str) -> bool:
    return status == "skipped: time limit" or "time limit" in decision


def _kept(check: E2ECheck | None) -> bool:
    """Whether an alternative's end-to-end check keeps it: a verdict measured now or recorded before."""
    return check is not None and check.status in ("measured", "recorded") and check.kept == "optimized"


@dataclass(frozen=True)
class _Alternative:
    """What an alternative to the search's graph (the merge-everything graph, the Winograd rewrites) did: why
    it was ``skipped``, or how its search stopped, what it rewrote and its end-to-end ``check``."""

    skipped: str = ""  # why it was not tried
    stopped_by: SearchStop | None = None  # its search's stop (TIME_LIMIT: the clock cut it); None: not searched
    applied: dict[str, int] = field(default_factory=dict)  # the rewrites of its graph
    check: E2ECheck | None = None  # its end-to-end check; None: it rewrote nothing

    @property
    def kept(self) -> bool:
        return _kept(self.check)

    @property
    def timed_out(self) -> bool:
        """Whether the time limit cut its search (or pricing) or its check short."""
        return self.stopped_by is SearchStop.TIME_LIMIT or (
            self.check is not None and _timed_out(self.check.status, self.check.decision))


@dataclass(frozen=True)
class MergeAlternative(_Alternative):
    """What :func:`merged_alternative` tried and measured (report.json ``merge_all``): nothing (not asked
    for), why it was ``skipped``, or its search's stop, what it merged and its end-to-end ``check``."""

    def to_json(self) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": self.skipped}
        if self.stopped_by is None:
            return {}
        if self.check is None:
            return {"stopped_by": self.stopped_by.value}
        check = {k: v for k, v in self.check.report().items() if k not in ("kept", "e2e_margin")}
        return {"applied": self.applied, "stopped_by": self.stopped_by.value, **check}


@dataclass(frozen=True)
class WinogradLayer:
    """One distinct 3x3 conv layer :func:`winograd_alternative` considered: its convs (by output tensor),
    shapes and tile, whether a neighbouring candidate spares each side a transpose, its prices and choice."""

    convs: tuple[str, ...]
    n: int
    c: int
    k: int
    h: int
    w: int
    tile: int
    neighbours: tuple[bool, bool]  # (fed by, feeding) another candidate layer
    decision: str = ""  # "direct", "F(mxm,3x3)" or why it was not priced
    direct_ms: float | None = None  # None: not priced
    winograd_ms: float | None = None

    @property
    def chosen_ms(self) -> float:
        """The price of what was chosen (its ms must be priced)."""
        return self.direct_ms if self.decision == "direct" else self.winograd_ms

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"convs": list(self.convs), "n": self.n, "c": self.c, "k": self.k, "h": self.h,
                               "w": self.w, "tile": self.tile, "neighbours": list(self.neighbours)}
        if self.direct_ms is not None:
            out.update(direct_ms=self.direct_ms, winograd_ms=self.winograd_ms)
        out["decision"] = self.decision
        return out


@dataclass(frozen=True)
class WinogradAlternative(_Alternative):
    """What :func:`winograd_alternative` priced and measured (report.json ``winograd``): nothing (no layer
    wide enough, or not asked for), why it was ``skipped``, or its layers (TIME_LIMIT: the clock left some
    unpriced), what it rewrote (by tile) and its check."""

    layers: tuple[WinogradLayer, ...] = ()

    def to_json(self) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": self.skipped}
        if not self.layers:
            return {}
        out: dict[str, Any] = {"layers": [layer.to_json() for layer in self.layers]}
        if self.stopped_by is not None:
            out["stopped_by"] = self.stopped_by.value
        if self.check is not None:
            out.update({"applied": self.applied, **self.check.report()})
            out["kept"] = self.kept  # in the check's "kept" place: whether the Winograd graph was kept
        return out


@dataclass
class GraphStageResult:
    """What the stage hands on, and the record of how it decided.

    ``graph`` is the search's graph (finished: folded, deduplicated, conv biases fused back), the
    merge-everything graph, or - when neither is measurably faster end to end - a copy of the input, with
    ``applied`` empty and ``cost_after == cost_before``; ``search`` still says what the search had found.
    """

    graph: Graph
    check: E2ECheck
    search: SearchResult
    cost_before: float  # priced as the search prices (conv biases split off)
    cost_after: float  # of ``graph``, priced the same way
    applied: dict[str, int]  # substitutions in ``graph``
    candidate_cost_after: float  # the search's best graph, finished, priced the same way
    folded_nodes: int
    deduplicated_nodes: int
    nodes_before: int
    rules: int
    cost_model: str
    merge_all: MergeAlternative = field(default_factory=MergeAlternative)  # what merged_alternative tried
    cut: tuple[StageCut, ...] = ()  # what the time limit cut short, in stage order
    seconds: float = 0.0  # the whole stage
    pricing_failures: dict[str, str] = field(default_factory=dict)  # op type -> why it was priced by estimate
    estimated_prices: int = 0  # operators priced by estimate because the pricing deadline had passed
    frozen_weights: int = 0  # initializers listed as inputs, made weights
    winograd: WinogradAlternative = field(default_factory=WinogradAlternative)  # what winograd_alternative did

    @property
    def kept(self) -> str:
        """``check.kept``, or "winograd" when the Winograd convolutions were kept on top of it."""
        return "winograd" if self.winograd.kept else self.check.kept

    @property
    def stopped(self) -> StageStop:
        return StageStop.TIME_LIMIT if self.cut else StageStop.COMPLETE

    @property
    def stop_reason(self) -> str:
        """report.json's ``stop_reason``: "complete", or "time limit: " and what it cut short."""
        if not self.cut:
            return self.stopped.value
        return f"{self.stopped.value}: " + "; ".join(c.phrase(self.estimated_prices) for c in self.cut)


def check_margin(margin: float) -> None:
    if not 0.0 <= margin < 1.0:
        raise UserError(f"--e2e-margin {margin} must be a fraction in [0, 1), e.g. 0.02 for 2%")


def check_end_to_end(original: Graph, candidate: Graph, cost_model: CostModel, applied: dict[str, int],
                     settings: E2ESettings = E2ESettings(), deadline: float | None = None,
                     priced: tuple[float, float] | None = None) -> E2ECheck:
    """Time both whole graphs with the cost model's engine, in blocks until decided
    (:func:`graphopt.timing.decide`, ``settings.runs`` runs a block), and keep ``candidate`` only if it is
    faster by ``settings.margin`` (a fraction of the original's time) by :func:`graphopt.timing.decide`'s sign
    test on the blocks.  Nothing is timed when the check is disabled (``settings.enabled``), when no substitution
    was applied (folding alone never slows a model down), or when the cost model measures nothing (analytic):
    then the candidate is kept, and ``status`` says the check was not made.  Past ``deadline``, or when the
    engine fails to run either graph, the original is kept.  The blocks are recorded in the cost model's verdict
    store (:attr:`~graphopt.cost.base.CostModel.verdicts`) under both graphs' hashes, and a rerun judges them
    again with today's margin instead of timing.
    ``priced``: the kernel prices (seconds) of the input and the candidate over the kernels that differ, when the
    caller has them (the gate then takes its share of the input's; default: :meth:`CostModel.kernel_times` of
    both graphs, and the share of the input's operator-sum price)."""
    margin, runs = settings.margin, settings.runs
    check_margin(margin)
    if not settings.enabled:
        return E2ECheck(kept="optimized", status="disabled", margin=margin)
    if not any(applied.values()):
        return E2ECheck(kept="optimized", status="skipped: no substitution applied", margin=margin)
    # whole models timed in the blocked conv layouts the product builds (GraphRunner.prepare_model)
    verdicts = cost_model.verdicts
    builds = (original.structural_hash(), candidate.structural_hash())
    recorded = verdicts.recall(*builds) if verdicts else None
    if recorded is not None:  # today's rule and margin on the blocks an earlier run timed
        faster, why = recorded.judge(margin)
        return E2ECheck(kept="optimized" if faster else "original", status="recorded", margin=margin,
                        ms_before=recorded.baseline_ms, ms_after=recorded.candidate_ms, backend=cost_model.name,
                        decision=f"recorded blocks: {why}", ratios=recorded.ratios)
    if deadline is not None and time.perf_counter() >= deadline:
        return E2ECheck(kept="original", status="skipped: time limit", margin=margin,
                        decision="no time left to time both models")
    prices = list(priced) if priced is not None else cost_model.kernel_times([original, candidate])
    if prices:
        # the prices cover the kernels the rewrite changed; the margin is a share of the whole input
        whole = searched_cost(original, cost_model) if priced is None else priced[0]
        gate = KERNEL_GATE * margin * whole
        if priced is None and prices[1] - prices[0] <= -gate:
            # a pass costs two whole-model builds: confirmed on those kernels timed once more
            prices = cost_model.kernel_times([original, candidate], confirm=True) or prices
    k_ms = {} if not prices else {"kernels_ms_before": prices[0] * 1e3, "kernels_ms_after": prices[1] * 1e3}
    if prices and prices[1] - prices[0] > -gate:
        return E2ECheck(kept="original", status="priced", margin=margin, decision=(
            f"the kernels it changes price at {prices[1] * 1e3:.3f} ms against the input's "
            f"{prices[0] * 1e3:.3f}: not {KERNEL_GATE * margin:.1%} of the input's {whole * 1e3:.1f} ms "
            "cheaper, so the whole models were not timed"), **k_ms)
    if deadline is not None and time.perf_counter() >= deadline:
        return E2ECheck(kept="original", status="skipped: time limit", margin=margin,
                        decision="no time left to time both models", **k_ms)
    backend: list[str] = []
    # the first block's runs from the input's price when there is one (a lower bound on neither model's
    # time, but of its order: VGG-19's priced layers 104 ms of its 155): 20 runs of VGG-19 were 6 s a block
    block_runs = [runs]
    if prices:
        block_runs = [max(min(runs, MIN_E2E_RUNS), min(runs, int(E2E_BLOCK_S / max(whole, 1e-9))))]

    def block(b: int) -> tuple[float, float]:
        pair = [original, candidate] if b % 2 == 0 else [candidate, original]
        times = cost_model.time_models(pair, block_runs[0])
        if times is None:
            raise LookupError
        backend[:] = [times.backend]
        block_runs[0] = max(min(runs, MIN_E2E_RUNS), min(runs, int(E2E_BLOCK_S / max(max(times.seconds), 1e-9))))
        first, second = (t * 1e3 for t in times.seconds)
        return (first, second) if b % 2 == 0 else (second, first)

    try:
        verdict = decide(block, margin, MIN_BLOCKS, MAX_BLOCKS, deadline)
    except LookupError:
        return E2ECheck(kept="optimized", status=f"skipped: the {cost_model.name} cost model measures nothing",
                        margin=margin)
    except Exception as exc:  # noqa: BLE001 - an engine that cannot run a whole model must not end the stage
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")[:160]
        return E2ECheck(kept="original", status=f"failed: {type(exc).__name__}: {first}", margin=margin,
                        decision="the whole models could not be timed: the input is kept")
    comp = verdict.comparison
    if verdicts:  # measured to a verdict: a rerun replays these blocks and decides the same
        verdicts.record(*builds, verdict)
    return E2ECheck(kept="optimized" if verdict.faster else "original", status="measured", margin=margin,
                    ms_before=comp.baseline_ms, ms_after=comp.candidate_ms, backend=backend[0] if backend else None,
                    decision=verdict.reason, ratios=comp.ratios, **k_ms)


def finish(graph: Graph) -> tuple[Graph, int, int]:
    """A copy of a search result made ready to export: weight-only subgraphs folded, duplicate nodes merged,
    conv biases fused back; with the numbers of folded and deduplicated nodes."""
    out = graph.copy()
    folded = fold_constants(out)
    deduplicated = eliminate_common_subexpressions(out)
    fuse_conv_bias(out)
    return out, folded, deduplicated


def searched_cost(graph: Graph, cost_model: CostModel) -> float:
    """``graph``'s cost in the form the search priced it (conv biases split off), so it compares with the
    search's ``cost_before`` whatever form the graph is in now."""
    canonical = graph.copy()
    split_conv_bias(canonical)
    return cost_model.graph_cost(canonical)


def merges_priced_slower(check: E2ECheck, applied: dict[str, int], rules: list[Rule]) -> str:
    """Why the merge-everything alternative is not tried ('' when it is): the search's own result was nothing
    but merges, and its kernels priced slower than the input's (fusion-aware, :meth:`CostModel.kernel_times`).
    Merging every group applies more of the same rewrites: on Inception-v3 (Intel Xeon, 2 threads) the
    search's 2 merges priced 5.1 ms against 1.5, and all 19 priced 24.6 against 11.8, which took 26 of the
    stage's 65 s to find out.  Where merges do pay somewhere in the model (NASRNN: 1.04x with all 70), the
    search's merges price cheaper, or the search applied none, and the alternative is still tried."""
    names = {r.name for r in merge_rules(rules)}
    used = [name for name, n in applied.items() if n]
    before, after = check.kernels_ms_before, check.kernels_ms_after
    if not used or any(name not in names for name in used) or before is None or after is None or after <= before:
        return ""
    return (f"the search's {sum(applied[n] for n in used)} merges priced {after:.3f} ms at the kernel level "
            f"against the input's {before:.3f}: merging every group was not tried")


def merged_alternative(original: Graph, searched: Graph, rules: list[Rule], cost_model: CostModel,
                       options: GraphStageOptions,
                       clock: StageClock | None = None) -> tuple[Graph | None, MergeAlternative]:
    """The graph with every parallel group the merge rules reach merged (searched under
    :class:`~graphopt.cost.kernel_count.KernelCountCost` from ``searched``, the search's input), if it runs
    faster than ``original`` end to end by the margin; else ``None``.  The :class:`MergeAlternative` says what
    was tried and measured.  With ``clock``, its search gets ``MERGE_SHARE`` of the time left and its check the
    rest."""
    limit = options.time_limit if clock is None else max(clock.left() * MERGE_SHARE, 1e-3)
    res = search(searched, merge_rules(rules), KernelCountCost(), options.alpha, options.budget, limit,
                 patience=min(options.patience, MERGE_PATIENCE))
    if not any(res.applied.values()):
        return None, MergeAlternative(stopped_by=res.stopped_by)
    merged = finish(res.graph)[0]
    check = check_end_to_end(original, merged, cost_model, res.applied, replace(options.e2e, enabled=True),
                             None if clock is None else clock.end)
    alternative = MergeAlternative(stopped_by=res.stopped_by, applied=res.applied, check=check)
    return (merged if alternative.kept else None), alternative


def winograd_alternative(graph: Graph, cost_model: CostModel, options: GraphStageOptions,
                         clock: StageClock | None = None) -> tuple[Graph | None, WinogradAlternative]:
    """``graph`` with the 3x3 convolutions that pay computed by Winograd (:mod:`graphopt.winograd`), if it
    runs faster end to end by the margin; else ``None``.  The :class:`WinogradAlternative` says what was
    priced and measured.

    Each distinct layer (shapes, padding, bias) wide enough (:data:`WINOGRAD_MIN_WIDTH`) and next to another
    such layer (a chain: no transposes between them) is priced alone, as
    a one-conv model, direct and rewritten, by the cost model's fusion-aware price (the kernels the backend
    builds for each: the direct conv in its blocked layout, the Winograd one with the layout transposes it
    makes, none towards a neighbouring candidate, :func:`graphopt.winograd.layer_graph`); a layer takes
    Winograd when that is :data:`WINOGRAD_GAIN` cheaper.  Layers are priced biggest first, while the clock
    allows; then the model with every chosen layer rewritten faces the same end-to-end check as a search
    result."""
    from graphopt import winograd

    kernel = cost_model.blocked_winograd()
    width = KERNEL_MIN_WIDTH if kernel else WINOGRAD_MIN_WIDTH
    sites = [s for s in winograd.conv_sites(graph, operators=not kernel) if s.c * s.k >= width * (s.c + s.k)]
    if not sites:
        return None, WinogradAlternative()
    context = winograd.neighbours(graph, sites)  # (fed by, feeding) another candidate: no transposes between
    groups: dict[tuple, list[winograd.ConvSite]] = {}
    for s in sites:
        groups.setdefault((s.signature, context[s.node]), []).append(s)
    order = sorted(groups.values(), key=lambda g: -sum(s.macs for s in g))
    layers: list[WinogradLayer] = []
    tiles: dict[str, int] = {}
    stopped_by = None
    for group in order:
        site = group[0]
        # "convs": the layer's convs by their output tensors (ConvSite.node)
        layer = WinogradLayer(convs=tuple(s.node for s in group), n=site.n, c=site.c, k=site.k, h=site.h,
                              w=site.w, tile=site.kernel_tile() if kernel else site.tile(),
                              neighbours=context[site.node])
        if not kernel and not any(layer.neighbours):
            layer = replace(layer, decision="not priced: isolated (no candidate layer next to it)")
        elif clock is not None and clock.left() <= 0:
            layer, stopped_by = replace(layer, decision="not priced: time limit"), SearchStop.TIME_LIMIT
        else:
            layer = _price_winograd(graph, site, layer, cost_model, kernel)
            if layer is None:
                return None, WinogradAlternative(skipped=f"the {cost_model.name} cost model does not price kernels")
            if layer.decision != "direct":
                tiles.update({s.node: layer.tile for s in group})
        layers.append(layer)
    if not tiles:
        return None, WinogradAlternative(layers=tuple(layers), stopped_by=stopped_by)
    candidate = winograd.mark(graph, tiles) if kernel else winograd.rewrite(graph, tiles)
    form = "kernel" if kernel else "operators"
    applied = dict(Counter(f"winograd F({m}x{m},3x3) {form}" for m in tiles.values()))
    # the layers' prices are the gate's (no second pricing of both whole models): the priced layers, direct
    # and as chosen (the operator-sum price, which times every conv alone in NCHW, says 1029 ms for a VGG-19
    # that runs in 156)
    priced = [layer for layer in layers if layer.direct_ms is not None]
    before = sum(layer.direct_ms * len(layer.convs) for layer in priced) / 1e3
    after = sum(layer.chosen_ms * len(layer.convs) for layer in priced) / 1e3
    check = check_end_to_end(graph, candidate, cost_model, applied, replace(options.e2e, enabled=True),
                             None if clock is None else clock.end, priced=(before, after))
    alternative = WinogradAlternative(layers=tuple(layers), stopped_by=stopped_by, applied=applied, check=check)
    return (candidate if alternative.kept else None), alternative


def _price_winograd(graph: Graph, site: ConvSite, layer: WinogradLayer, cost_model: CostModel,
                    kernel: bool) -> WinogradLayer | None:
    """``layer`` priced alone, direct and as Winograd (``kernel``: the engine's own kernel, marked; else the
    plain-operator rewrite, its neighbours' transposes cancelled), and its choice: Winograd where that is
    :data:`WINOGRAD_GAIN` cheaper; None when the cost model prices no kernels."""
    from graphopt import winograd

    m = layer.tile
    if kernel:
        wino = winograd.mark(winograd.layer_graph(graph, site), {site.node: m})
    else:
        wino = winograd.rewrite(winograd.layer_graph(graph, site, layer.neighbours), {site.node: m})
    prices = cost_model.kernel_times([winograd.layer_graph(graph, site), wino])
    if prices is None:
        return None
    pays = prices[1] < (1.0 - WINOGRAD_GAIN) * prices[0]  # strictly: a layer priced 0 (shared) stays direct
    return replace(layer, direct_ms=prices[0] * 1e3, winograd_ms=prices[1] * 1e3,
                   decision=f"F({m}x{m},3x3)" if pays else "direct")


def optimize_graph(graph: Graph, cost: CostModel, options: GraphStageOptions | None = None) -> GraphStageResult:
    """The graph stage (see module docstring), within ``options.time_limit``: ``graph`` is not modified."""
    options = options or GraphStageOptions()
    options.validate()
    clock = StageClock(options.time_limit)
    rules = verified_library() if options.rules is None else options.rules
    guarded = cost if isinstance(cost, GuardedCost) else GuardedCost(cost)
    original = graph.copy()
    frozen = [] if options.weights_as_inputs else original.freeze_weights()
    searched = original.copy()
    split_conv_bias(searched)
    search_end = clock.at(SEARCH_SHARE if options.e2e_check else 1.0)
    guarded.set_deadline(search_end)
    estimated_before = getattr(cost, "estimated", 0)
    try:
        guarded.prefetch(searched)
        result = search(searched, rules, guarded, options.alpha, options.budget, clock.left(search_end),
                        options.progress, options.patience)
        best, folded, deduplicated = finish(result.graph)
        cost_before = guarded.graph_cost(searched)
        candidate_cost = searched_cost(best, guarded)
    finally:
        guarded.set_deadline(None)
    estimated = getattr(cost, "estimated", 0) - estimated_before
    cut: list[StageCut] = []  # what the time limit cut short, in stage order
    if estimated:
        cut.append(StageCut.PRICING)
    if result.stopped_by is SearchStop.TIME_LIMIT:
        cut.append(StageCut.SEARCH)
    check = check_end_to_end(original, best, guarded, result.applied, options.e2e, clock.end)
    if _timed_out(check.status, check.decision):
        cut.append(StageCut.E2E_CHECK)
    merged, merge_all = None, MergeAlternative()
    if options.e2e_check and (check.kept == "original" or not any(result.applied.values())):
        merged, merge_all, merge_cut = _merge_step(original, searched, rules, guarded, options, clock, check,
                                                   result.applied)
        cut.extend(merge_cut)
    if merged is not None:
        check = replace(merge_all.check, kept="merged")
        out, cost_after, applied = merged, searched_cost(merged, guarded), merge_all.applied
    elif check.kept == "optimized":
        out, cost_after, applied = best, candidate_cost, result.applied
    else:
        out, cost_after, applied = original, cost_before, {}
    wino, wino_info = None, WinogradAlternative()
    if options.e2e_check and options.winograd:
        wino, wino_info = winograd_alternative(out, guarded, options, clock)
        if wino_info.timed_out:
            cut.append(StageCut.WINOGRAD)
    if wino is not None:
        # cost_after stays the operator-sum price of the graph before the rewrite: that price cannot see
        # Winograd (its transforms are priced as the kernels they fuse into: wino_info), and pricing each new
        # operator alone would cost seconds per layer
        out, applied = wino, {**applied, **wino_info.applied}
    return GraphStageResult(
        graph=out, check=check, search=result, cost_before=cost_before, cost_after=cost_after, applied=applied,
        candidate_cost_after=candidate_cost, folded_nodes=folded, deduplicated_nodes=deduplicated,
        nodes_before=len(graph.nodes), rules=len(rules), cost_model=cost.name, merge_all=merge_all, cut=tuple(cut),
        seconds=time.perf_counter() - clock.start, pricing_failures=dict(guarded.failures),
        estimated_prices=estimated, frozen_weights=len(frozen), winograd=wino_info)


def _merge_step(original: Graph, searched: Graph, rules: list[Rule], cost: CostModel, options: GraphStageOptions,
                clock: StageClock, check: E2ECheck,
                applied: dict[str, int]) -> tuple[Graph | None, MergeAlternative, tuple[StageCut, ...]]:
    """The merge-everything alternative where the search's result was not kept: skipped when the search's
    merges priced slower (:func:`merges_priced_slower`) or no time is left, else :func:`merged_alternative`;
    with what the time limit cut short of it."""
    lost = merges_priced_slower(check, applied, rules)
    if lost:
        return None, MergeAlternative(skipped=lost), ()
    if clock.left() <= 0:
        return None, MergeAlternative(skipped="time limit"), (StageCut.MERGE_NOT_TRIED,)
    merged, alternative = merged_alternative(original, searched, rules, cost, options, clock)
    return merged, alternative, (StageCut.MERGE,) if alternative.timed_out else ()


def optimize_onnx(model: onnx.ModelProto | str | os.PathLike, cost: CostModel,
                  options: GraphStageOptions | None = None, input_shapes: InputShapes | None = None,
                  seed: int = 0, samples: dict[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """:func:`optimize_graph` on an ONNX model: the optimized model and the stage report, whose
    ``outputs_equal`` compares both models in onnxruntime on the check inputs (the samples, or several seeded
    sets; :mod:`graphopt.compare`).  When the input is handed back, that is ``model`` itself (``applied``
    empty; ``candidate_applied`` and ``candidate_cost_after`` still say what the search had found)."""
    start = time.perf_counter()
    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    graph = import_onnx(proto, input_shapes)
    res = optimize_graph(graph, cost, options)
    if res.kept == "original":
        optimized, dynamic = proto, DynamicShapes(symbolic_inputs(proto), {}, INPUT_MODEL, reason="nothing applied")
    else:  # at the input's symbolic sizes where it has them, checked at a second size (graphopt.dynamic)
        optimized, dynamic = dynamic_model(proto, res.graph, graph, seed, samples)
    sets = feed_sets(graph, seed, samples)
    check = compare_runs(list(zip(run_ort_sets(proto, sets), run_ort_sets(optimized, sets))))
    report = {
        "cost_before": res.cost_before,
        "cost_after": res.cost_after,
        "applied": res.applied,
        **res.check.report(),
        "kept": res.kept,  # the search's verdict, or "winograd" on top of it
        "candidate_applied": res.search.applied,
        "candidate_cost_after": res.candidate_cost_after,
        "graphs_explored": res.search.graphs_explored,
        "seconds": time.perf_counter() - start,
        "search_seconds": res.search.seconds,
        "stopped_by": res.search.stopped_by.value,
        **check.to_dict(),
        "outputs_equal": check.ok,
        "check_failure": check.reason(),
        "nodes_before": res.nodes_before,
        "nodes_after": len(res.graph.nodes),
        "folded_nodes": res.folded_nodes,
        "deduplicated_nodes": res.deduplicated_nodes,
        "cost_model": res.cost_model,
        "root_candidates": res.search.root_candidates,
        "merge_all": res.merge_all.to_json(),
        "winograd": res.winograd.to_json(),
        "rules": res.rules,
        "stage_seconds": res.seconds,
        "stop_reason": res.stop_reason,
        "pricing_failures": res.pricing_failures,
        "estimated_prices": res.estimated_prices,
        "frozen_weights": res.frozen_weights,
        "dynamic_shapes": dynamic.to_json(),
    }
    return optimized, report
