"""The layout stage: which convolutions run in NCHW[x]c with which blocks, decided for the whole graph.

``--layout`` (optimize-model, bench-model, tune-kernels MODEL --list):

* ``auto`` (default): the cost-based search below;
* ``nchwc``: every conv blocked by :func:`pipeline.layout.nchwc.heuristic_plans` (no measurement);
* ``nchw``: the model as imported.

Only ``llvm`` targets have the blocked kernels; other targets and models without convolutions are left alone.

The search is NeoCPU's global layout search (Liu et al., "Optimizing CNN Model Inference on CPUs", USENIX
ATC'19, section 3.3).  The variables are the model's *layout classes* (:func:`pipeline.layout.nchwc.analyze`: the
activations elementwise ops, pools and concats tie together, e.g. a ResNet stage's residual stream), each
with candidate layouts: NCHW and the blocks that divide its channels (the vector width, half of it, the
channels' own block, the group width of a grouped conv it feeds).  The costs, all measured
(:mod:`pipeline.layout.cost`, cached per CPU):

* per conv, between its input and output classes: for each pair of class layouts, the cheapest way to run
  it - a blocked kernel in those blocks, or another kernel (NCHW, other blocks, merged groups) plus the
  transforms to and from it;
* per class: the transforms at its edges (model inputs and outputs, ops that keep NCHW such as a
  classifier's flatten) when it is blocked.

That is a PBQP (:mod:`pipeline.layout.pbqp`): exact on chains and on series-parallel graphs such as ResNet's
residual blocks, a greedy step elsewhere.  Close calls are not left to timing noise: each kernel's cost is
scaled by ``1 + MARGIN * rank`` (rank 0 for the blocks the heuristic would pick, 1 for other blocks, 2 for the
NCHW kernel and merged groups), so an alternative must win by more than the margin, and ties go to the
lower rank.  Transforms are priced as measured.  Where the solution still runs a conv outside its preferred
blocks, that conv's chosen and preferred kernels are timed a second time and the problem solved again with
the means, so no departure rests on one cold timing.

Prices of single convs timed alone do not add up to the model: a departure from the heuristic blocks is kept
only if the whole model, built both ways with default schedules, runs faster by :data:`E2E_MARGIN` in
interleaved blocks (:func:`check_against_heuristic`), as the graph stage checks its rewrites; otherwise the
heuristic blocks ship.  The verdict's blocks are kept in the verdict store (:mod:`graphopt.verdicts`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi

from graphopt import timing
from graphopt.errors import UserError
from kerneltune.targets.host import vector_lanes
from kerneltune.targets.registry import TargetSpec
from pipeline.compile import CompiledModel, build, model_runner, schedule
from pipeline.layout import nchwc, pbqp
from pipeline.layout.cost import ConvOption, Pricer
from pipeline.layout.modes import LAYOUTS
from pipeline.passes import provenance
from pipeline.passes.relax_rewrite import is_op
from pipeline.partition import Partition, partition

log = logging.getLogger(__name__)

MARGIN = 0.05
# The searched layouts are kept only when the whole model runs this much faster than in the heuristic blocks
# (:func:`check_against_heuristic`), the graph stage's end-to-end margin; timed calls per model per block.
E2E_MARGIN = 0.02
E2E_RUNS = 10
MAX_MERGE = 4  # merged groups cost ``merge``x the FLOPs: beyond 4x not worth pricing


def candidates(cls: nchwc.TensorClass, lanes: int, touched: bool) -> list[int | None]:
    """A class's candidate layouts, preferred first: blocks that divide its channels (vector width, half of
    it, its own :func:`~pipeline.layout.nchwc.channel_block`, the group widths of grouped convs at it), then NCHW.
    A class no conv reads or writes stays NCHW (ConvertLayout only starts from convs).

    Half a vector is offered only to narrow classes (at most two vectors of channels) and to those a grouped
    or depthwise conv touches.  Of 111 dense convs with more than two vectors of output channels priced on an
    Intel Xeon (AVX-512, 2 threads; the CNN corpus), an 8-channel output ran a median 1.25x slower than a
    16-channel one; it won on 7, by at most 10%: MobileNet's expands into depthwise convs (which keep the
    choice), and MobileNet-v3's 200->80 and 184->80 1x1 convs at 14x14 (8% and 5%).  Those half-vector
    kernels were 3 of the 5 each conv was measured as, the bulk of a cold layout stage."""
    if not touched or cls.channels <= 0:
        return [None]
    out: list[int | None] = []
    half = (lanes // 2,) if cls.channels <= 2 * lanes or cls.grouped else ()
    for b in (nchwc.channel_block(cls.channels, lanes), lanes, *half, *sorted(cls.group_widths, reverse=True)):
        if 2 <= b <= lanes and cls.channels % b == 0 and b not in out:
            out.append(b)
    return out + [None]


def conv_options(site: nchwc.ConvSite, a_cands, d_cands) -> list[ConvOption]:
    """Every kernel the conv can run as: NCHW, and each pair of candidate blocks its compute accepts."""
    opts = [ConvOption(None, None)]
    spec = site.spec
    if spec is None:
        return opts
    for a in a_cands:
        for d in d_cands:
            if a is None or d is None:
                continue
            p = nchwc.plan(spec.c, spec.f, spec.groups, a, d, "merge")
            if isinstance(p, nchwc.ConvPlan) and p.merge <= MAX_MERGE:
                opts.append(ConvOption(a, d, p.merge))
    return opts


@dataclass
class _Edge:
    """One conv's cost matrix over (input class layout, output class layout) and the option behind each."""

    site: nchwc.ConvSite
    matrix: np.ndarray
    best: list[list[ConvOption]]


def _rank(opt: ConvOption, preferred: tuple) -> int:
    if opt.nchw or opt.merge > 1:
        return 2
    return 0 if (opt.a, opt.d) == preferred else 1


def realizable(opt: ConvOption, lp: int | None, lq: int | None) -> bool:
    """Whether ConvertLayout can run the conv as ``opt`` between classes held in ``lp`` and ``lq``: it
    transforms between NCHW and a block but not between two blocks (TVM 0.27: "Invalid layout axis 8b"),
    and the output must be the class's own layout (a class written in two blocks cannot be joined by its
    residual add).  So a blocked kernel writes exactly ``lq`` and reads ``lp`` (or any block of an NCHW
    input); the NCHW kernel fits everywhere, with transforms."""
    if opt.nchw:
        return True
    return lq is not None and opt.d == lq and (lp is None or opt.a == lp)


def _conv_edge(site: nchwc.ConvSite, cin, cout, lanes: int, graph: nchwc.LayoutGraph, pricer: Pricer) -> _Edge:
    spec = site.spec
    opts = conv_options(site, cin, cout)
    preferred = (nchwc.channel_block(graph.classes[site.inp].channels, lanes),
                 nchwc.channel_block(graph.classes[site.out].channels, lanes))
    kernel = {o: (pricer.conv(spec, o) if spec is not None else 0.0) * (1 + MARGIN * _rank(o, preferred))
              for o in opts}
    m = np.zeros((len(cin), len(cout)))
    best = [[opts[0]] * len(cout) for _ in cin]
    for i, lp in enumerate(cin):
        for j, lq in enumerate(cout):
            priced = [(pricer.transform(site.in_shape, lp, o.a) + kernel[o] + pricer.transform(site.out_shape, o.d, lq),
                       k, o) for k, o in enumerate(opts) if realizable(o, lp, lq)]
            cost, _, o = min(priced, key=lambda t: (t[0], t[1]))
            m[i, j], best[i][j] = cost, o
    return _Edge(site, m, best)


@dataclass
class Decision:
    plans: nchwc._Plans
    summary: dict


def _confirm_departures(edges: list[_Edge], pick: list[int], graph: nchwc.LayoutGraph, lanes: int,
                        pricer: Pricer) -> bool:
    """Re-time the kernels of every conv the solution runs other than in its preferred blocks: the chosen one
    and the preferred one (:meth:`Pricer.confirm_conv`).  On a cold cache one noisy timing had put 3 of
    GoogLeNet's convs in NCHW with 20 transforms (1.13x onnxruntime; another cold run: all 57 blocked, 2
    transforms, 1.08x).  True when a price changed."""
    changed = False
    for e in edges:
        spec = e.site.spec
        if spec is None:
            continue
        o = e.best[pick[e.site.inp]][pick[e.site.out]]
        preferred = ConvOption(nchwc.channel_block(graph.classes[e.site.inp].channels, lanes),
                               nchwc.channel_block(graph.classes[e.site.out].channels, lanes))
        if o != preferred and preferred in conv_options(e.site, [preferred.a], [preferred.d]):
            changed |= pricer.confirm_conv(spec, o)
            changed |= pricer.confirm_conv(spec, preferred)
    return changed


def _solve(graph: nchwc.LayoutGraph, lanes: int, pricer: Pricer, cands: list[list[int | None]]):
    """The PBQP of the module docstring, priced, and its solution: (problem, edges, pick)."""
    problem = pbqp.Problem()
    for i, cls in enumerate(graph.classes):
        problem.add_node([sum(pricer.transform(s, None, L) for s in cls.entries)
                          + sum(pricer.transform(s, L, None) for s in cls.exits) for L in cands[i]])
    edges = []
    for site in graph.convs:
        e = _conv_edge(site, cands[site.inp], cands[site.out], lanes, graph, pricer)
        problem.add_edge(site.inp, site.out, e.matrix)
        edges.append(e)
    pricer.flush()
    return problem, edges, pbqp.solve(problem)


def search(graph: nchwc.LayoutGraph, lanes: int, pricer: Pricer) -> Decision:
    """Each conv's layout (see the module docstring), and a summary for report.json.  The prices that make a
    conv depart from its preferred blocks are timed a second time, and the problem solved again with them."""
    t0, looked_up, measured = time.perf_counter(), pricer.looked_up, pricer.measured
    touched = {s.inp for s in graph.convs} | {s.out for s in graph.convs}
    cands = [candidates(c, lanes, i in touched) for i, c in enumerate(graph.classes)]
    with pricer.batch():  # every price the problem needs, measured together (built side by side)
        _solve(graph, lanes, pricer, cands)
    problem, edges, pick = _solve(graph, lanes, pricer, cands)
    if _confirm_departures(edges, pick, graph, lanes, pricer):
        problem, edges, pick = _solve(graph, lanes, pricer, cands)
    plans = nchwc._Plans()
    for e in edges:
        o = e.best[pick[e.site.inp]][pick[e.site.out]]
        if e.site.spec is None:
            plans.set(e.site.weight, e.site.why)
        elif o.nchw:
            plans.set(e.site.weight, "the NCHW kernel (with its transforms) priced cheaper")
        else:
            plans.set(e.site.weight, nchwc.ConvPlan(o.a, o.d, o.merge))

    def select(layout_of) -> list[int]:
        return [c.index(layout_of(i)) if layout_of(i) in c else len(c) - 1 for i, c in enumerate(cands)]

    heuristic = select(lambda i: nchwc.channel_block(graph.classes[i].channels, lanes) if i in touched else None)
    blocks: dict[str, int] = {}
    for i in sorted(touched):
        name = "nchw" if cands[i][pick[i]] is None else f"{cands[i][pick[i]]}c"
        blocks[name] = blocks.get(name, 0) + 1
    summary = {
        "classes": len(touched), "class_layouts": dict(sorted(blocks.items())),
        "priced": pricer.looked_up - looked_up, "measured_now": pricer.measured - measured,
        "seconds": round(time.perf_counter() - t0, 2),
        # the cost model's sum of kernel + transform time (ms per run, margins included) for three plans
        "model_ms": round(problem.total(pick) * 1e3, 3),
        "model_ms_heuristic": round(problem.total(heuristic) * 1e3, 3),
        "model_ms_nchw": round(problem.total(select(lambda i: None)) * 1e3, 3),
    }
    return Decision(plans, summary)


def has_convs(mod: tvm.IRModule) -> bool:
    return any(is_op(b.value, nchwc.CONV) for blk in mod["main"].body.blocks for b in blk.bindings)


def convert(mod: tvm.IRModule, spec: TargetSpec, mode: str = "auto", pricer: Pricer | None = None,
            e2e: bool = True) -> tuple[tvm.IRModule, nchwc.LayoutReport]:
    """The module in the layouts ``mode`` asks for (see the module docstring), and what was done.  ``e2e``:
    in ``auto``, a decision other than the heuristic blocks is kept only if the whole model runs faster
    (:func:`check_against_heuristic`); off, the search's decision stands (tests of the search on made-up
    prices)."""
    if mode not in LAYOUTS:
        raise UserError(f"--layout {mode}: use one of {', '.join(LAYOUTS)}")
    if mode == "nchw" or spec.kind != "llvm" or "main" not in mod or not has_convs(mod):
        return mod, nchwc.LayoutReport(mode="nchw")
    lanes = vector_lanes(spec.target, "float32")
    if mode == "nchwc" or (pricer is None and not spec.can_run):
        # a target built here but run elsewhere (a cross build) cannot be priced: the heuristic blocks
        out, report = nchwc.to_nchwc(mod, lanes)
        if mode == "auto":
            report.search = {"skipped": "the target does not run here: heuristic blocks, no prices"}
        return out, report
    pricer = pricer or Pricer(spec)
    decisions: list[Decision] = []
    graphs: list[nchwc.LayoutGraph] = []

    def planner(graph: nchwc.LayoutGraph) -> nchwc._Plans:
        decisions.append(search(graph, lanes, pricer))
        graphs.append(graph)
        return decisions[-1].plans

    out, report = nchwc.to_nchwc(mod, lanes, planner=planner)
    report.mode = "auto"
    report.search = decisions[0].summary
    if not e2e:
        return out, report
    if not departs(graphs[0], decisions[0].plans, lanes):
        report.search["e2e"] = {"status": "skipped: the search chose the heuristic blocks"}
        return out, report
    heuristic, heuristic_report = nchwc.to_nchwc(mod, lanes)
    try:
        verdict = check_against_heuristic(out, heuristic, spec, pricer)
    except Exception as exc:  # noqa: BLE001 - a check that cannot build both must not cost the model its layout
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        verdict = {"kept": "auto", "status": f"failed: {type(exc).__name__}: {first}"}
    report.search["e2e"] = verdict
    if verdict["kept"] == "auto":
        return out, report
    heuristic_report.mode, heuristic_report.search = "auto", report.search
    return heuristic, heuristic_report


def departs(graph: nchwc.LayoutGraph, plans: nchwc._Plans, lanes: int) -> bool:
    """Whether ``plans`` runs any conv otherwise than :func:`~pipeline.layout.nchwc.heuristic_plans` does
    (a conv the heuristic keeps NCHW, for whatever reason, matches any NCHW plan)."""
    heuristic = nchwc.heuristic_plans(graph, lanes)
    for site in graph.convs:
        a, b = plans.get(site.weight), heuristic.get(site.weight)
        if (isinstance(a, nchwc.ConvPlan) or isinstance(b, nchwc.ConvPlan)) and a != b:
            return True
    return False


def _runner(mod: tvm.IRModule, spec: TargetSpec):
    """One call of the whole module, built with default schedules as the pipeline builds it, on seeded
    random inputs (floats in [-1, 1], integers 0: a valid index anywhere)."""
    scheduled, _ = schedule(partition(mod), spec)
    rng = np.random.default_rng(0)
    feeds = {}  # keyed by position: the runner passes them in the order of the names given
    for i, p in enumerate(mod["main"].params):
        shape, dtype = [int(d) for d in p.ty.shape], str(p.ty.dtype)
        feeds[str(i)] = rng.uniform(-1, 1, shape).astype(dtype) if dtype.startswith("float") else np.zeros(shape, dtype)
    return model_runner(CompiledModel(build(scheduled, spec), spec, list(feeds)), feeds)


def check_against_heuristic(auto: tvm.IRModule, heuristic: tvm.IRModule, spec: TargetSpec,
                            pricer: Pricer) -> dict:
    """Whether the searched layouts run the whole model faster than the heuristic blocks: both built and
    timed in interleaved blocks until a sign test decides (:func:`graphopt.timing.compare`, margin
    :data:`E2E_MARGIN`); the heuristic is kept unless the search's is faster.  The prices the search solved
    with are single convs timed cold and alone; this is the model as it ships (issue 24: on an Intel Xeon
    an ``auto`` ResNet-50 with 18 of 53 convs blocked ran 1.89x onnxruntime, its heuristic blocks 1.29x).
    The blocks are recorded in the pricer's verdict store (:mod:`graphopt.verdicts`), keyed by both modules,
    and a rerun replays them: the same command decides the same."""
    builds = tuple(f"{tvm_ffi.structural_hash(m) & 0xFFFFFFFFFFFFFFFF:x}" for m in (heuristic, auto))
    recorded = pricer.verdicts.recall(*builds)
    if recorded is not None:
        faster, why = recorded.judge(E2E_MARGIN)
        return {"kept": "auto" if faster else "heuristic", "status": "recorded",
                "ms_heuristic": round(recorded.baseline_ms, 3), "ms_auto": round(recorded.candidate_ms, 3),
                "decision": f"recorded blocks: {why}"}
    t0 = time.perf_counter()
    runners = _runner(heuristic, spec), _runner(auto, spec)
    verdict = timing.compare(*runners, E2E_MARGIN, runs=E2E_RUNS, gap_s=0.0)
    comp = verdict.comparison
    pricer.verdicts.record(*builds, verdict)
    return {"kept": "auto" if verdict.faster else "heuristic", "status": "measured",
            "ms_heuristic": round(comp.baseline_ms, 3), "ms_auto": round(comp.candidate_ms, 3),
            "decision": verdict.reason, "seconds": round(time.perf_counter() - t0, 1)}


def partition_model(mod: tvm.IRModule, spec: TargetSpec, mode: str = "auto") -> Partition:
    """:func:`convert` then :func:`pipeline.partition.partition`; the partition carries the layout report.

    The blocked layout is an optimization: where TVM's ``ConvertLayout`` rejects a plan (an internal check
    in its layout inference, or a ValueError from type-checking the IR its layout inference wrote, as its
    ``split`` did), the convs whose blocked layout it cannot carry stay NCHW (:func:`nchwc.realize_locally`);
    only when even that fails (or any other step of the stage) does the model run as imported, in NCHW, and
    the report says why, rather than the user getting no model at all."""
    try:
        converted, report = convert(mod, spec, mode)
    except (tvm.error.InternalError, ValueError) as exc:
        first = next((ln for ln in str(exc).splitlines() if "Check failed" in ln), str(exc).splitlines()[0])
        log.warning("warning: the NCHWc layout pass failed (%s); the model runs in NCHW", first.strip()[:200])
        converted, report = mod, nchwc.LayoutReport(mode="nchw", failed=f"{mode}: {first.strip()[:200]}")
    part = partition(converted, known=provenance.binding_nodes(mod["main"]))  # the stage drops spans
    part.layout = report.to_json()
    return part
