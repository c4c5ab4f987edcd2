"""MetaFlow/TASO cost-based backtracking search over rule applications.

A priority queue holds candidate graphs ordered by cost.  The cheapest is dequeued, every rule is applied at
every match, and each result whose cost is below ``alpha`` times the best cost seen so far is enqueued
(``alpha`` = 1.05 as in the paper: a slightly worse graph may lead to a much better one, e.g. merging two of
BERT's three projections before the third joins; 1.0 is greedy).  Graphs are deduplicated by structural
hash; the search stops after ``budget`` dequeued graphs, ``time_limit`` seconds, an empty queue, or
``patience`` dequeued graphs in a row that found nothing cheaper ("converged": a count, not a clock, so
the same input stops at the same place).

Two things make it fast enough for BERT-base (~1000 nodes, hundreds of matches per graph):

* *lazy children*: a queue entry is (parent graph, match) with the child's cost known exactly from the
  parent's cost plus the rewrite's cost delta (the target pattern priced by the cost model from the shapes
  the rewriter infers, :meth:`graphopt.cost.base.CostModel.pattern_cost`, minus the matched nodes' costs) -
  only dequeued entries are built, copied and hashed;
* *incremental matching*: a child inherits its parent's matches except those touching what the rewrite
  changed, and re-matches only around the changed nodes (:meth:`RuleIndex.matches_around`); costs are
  re-priced only for the changed nodes and the readers of values whose producer or readers changed;
* matches whose target would read a value computed from the matched nodes (a cycle) are dropped when they
  are priced, by a backward walk over the few nodes after the match, instead of being built and sorted.

Beyond TASO: verified rules are also applied right to left (an equivalence holds both ways; see
:func:`graphopt.match.with_reverses`), and the cost model prices element-wise epilogues as fused into their
producer (:func:`graphopt.cost.analysis.fused_epilogue`), which is what both backends do and what decides whether a
merge that puts a ``Split`` between a kernel and its epilogue pays.
"""
from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from graphopt.console import progress_bar, show_progress
from graphopt.cost.analysis import constant_tensors, foldable
from graphopt.cost.base import CostModel
from graphopt.ir import Graph
from graphopt.match import GraphIndex, Match, RuleIndex, ViewCache, with_reverses
from graphopt.rewrite import Rewrite, RewriteError, apply_match, creates_cycle, target_plan
from graphopt.rules import Rule


class SearchStop(enum.Enum):
    """Why the search stopped; the value is what report.json's ``stopped_by`` records."""

    QUEUE_EMPTY = "queue empty"  # every graph within alpha of the best was expanded
    BUDGET = "budget"  # ``budget`` graphs dequeued
    CONVERGED = "converged"  # ``patience`` dequeued graphs in a row found nothing cheaper
    TIME_LIMIT = "time limit"  # ``time_limit`` seconds passed


@dataclass(frozen=True)
class SearchLimits:
    """How wide the search looks and when it stops (one set of knobs: the stage and ``graphopt optimize``
    set them together, see :class:`graphopt.stage.GraphStageOptions`)."""

    alpha: float = 1.05  # keep graphs up to alpha x the best cost in the queue (1.0 = greedy; TASO: 1.05)
    budget: int = 1000  # most graphs to dequeue
    time_limit: float = 60.0  # seconds
    patience: int | None = None  # stop after this many dequeued graphs without a better one (None: never)


@dataclass
class State:
    """One graph the search has built, with what is needed to expand it cheaply."""

    graph: Graph
    index: GraphIndex
    cost: float
    node_cost: dict[str, float]
    constants: set[str]
    matches: list[tuple[Match, float]]  # each with the cost change applying it would make
    path: tuple[str, ...] = ()


@dataclass
class SearchResult:
    graph: Graph
    cost_before: float
    cost_after: float
    applied: dict[str, int]
    path: list[str]
    graphs_explored: int
    dequeued: int
    seconds: float
    stopped_by: SearchStop
    trace: list[float] = field(default_factory=list)  # best cost after each dequeue
    # the cheapest way to apply each rule on the input graph and what it would change the cost by: the
    # record of why a substitution (e.g. BERT's Q/K/V merge) was not taken on this target
    root_candidates: list[dict] = field(default_factory=list)


class Searcher:
    def __init__(self, rules: list[Rule], cost: CostModel, limits: SearchLimits = SearchLimits(),
                 progress: bool = False, max_queue: int = 20000, reverse: bool = True):
        self.rules = RuleIndex(with_reverses(rules) if reverse else rules)
        self.cost = cost
        self.limits = limits
        self.progress = progress
        self.max_queue = max_queue
        self.views = ViewCache()

    # ---- states ------------------------------------------------------------------------------------------
    def _delta(self, match: Match, state_index: GraphIndex, node_cost: dict[str, float],
               constants: set[str]) -> float | None:
        try:
            plan = target_plan(match, state_index)
        except RewriteError:
            return None
        if creates_cycle(match, state_index):
            return None
        weights = {x for x, t in match.binding().items() if t in constants}
        new = self.cost.pattern_cost(match.rule.dst, [(t.op, t.params, t.in_shapes) for t in plan.nodes], plan.dtype,
                                     weights)
        return new - sum(node_cost[n] for n in match.nodes)

    def _priced(self, matches: list[Match], index: GraphIndex, node_cost: dict[str, float],
                constants: set[str]) -> list[tuple[Match, float]]:
        out = []
        for m in matches:
            d = self._delta(m, index, node_cost, constants)
            if d is not None:
                out.append((m, d))
        return out

    def root(self, graph: Graph) -> State:
        index = GraphIndex(graph, self.views)
        constants = constant_tensors(graph)
        node_cost = {n.name: self.cost.node_cost(n, graph, constants, index) for n in graph.nodes}
        matches = self._priced(self.rules.all_matches(index), index, node_cost, constants)
        return State(graph, index, sum(node_cost.values()), node_cost, constants, matches)

    def child(self, parent: State, match: Match) -> State:
        rw = apply_match(match, parent.index)
        g = rw.graph
        index = GraphIndex.derive(parent.index, g, set(rw.removed) | set(rw.rewired),
                                  set(rw.added) | set(rw.rewired))
        constants = _derive_constants(parent, rw, index)
        node_cost = dict(parent.node_cost)
        cost = parent.cost
        for n in rw.removed:
            cost -= node_cost.pop(n)
        # What the rewrite touched: new and rewired nodes, and every tensor they read or that lost a reader.
        changed = set(rw.added) | set(rw.rewired)
        read = {t for n in changed for t in index.nodes[n].inputs if t} | set(match.binding().values())
        # Re-price the changed nodes and the readers of every value whose producer or readers changed
        # (whether an element-wise reader is fused into its producer depends on both).
        src_outputs = [match.tensor(o, parent.index) for o in match.rule.src.outputs]
        reprice = changed | {c for t in read.union(src_outputs) for c in index.consumers.get(t, ())}
        for n in sorted(reprice):  # a fixed order: float sums differ in the last bit with the set's hash order
            cost -= node_cost.pop(n, 0.0)
            c = self.cost.node_cost(index.nodes[n], g, constants, index)
            node_cost[n] = c
            cost += c
        near = {index.producer[t][0] for t in read if t in index.producer}
        anchors = changed | near
        drop = set(rw.removed) | anchors
        inherited = [(m, d) for m, d in parent.matches if not drop.intersection(m.nodes)]
        fresh = self._priced(self.rules.matches_around(index, anchors), index, node_cost, constants)
        return State(g, index, cost, node_cost, constants, inherited + fresh, parent.path + (match.rule.name,))

    # ---- search ------------------------------------------------------------------------------------------
    def run(self, graph: Graph) -> SearchResult:
        start = time.perf_counter()
        root = self.root(graph)
        best = root
        seen = {graph.structural_hash()}
        counter = itertools.count()
        heap: list[tuple[float, int, State, Match | None]] = []
        explored = dequeued = 0
        trace: list[float] = []
        stopped_by = SearchStop.QUEUE_EMPTY
        bar = None
        if show_progress(self.progress):
            bar = progress_bar(total=self.limits.budget, desc="graph search", unit="graph", leave=False)

        # Matches that failed to apply (a cycle through the rest of the graph) fail again in every
        # descendant that inherits them: remember them instead of rebuilding and re-sorting each time.
        failed: set[tuple] = set()

        def expand(state: State) -> None:
            limit = self.limits.alpha * best.cost
            for m, d in state.matches:
                c = state.cost + d
                if c < limit and (m.key, m.bindings) not in failed:
                    heapq.heappush(heap, (c, next(counter), state, m))

        expand(root)
        dequeued = 1
        last_better = 1  # the dequeue that found the best graph so far
        while heap:
            stop = self._stop(dequeued, last_better, time.perf_counter() - start)
            if stop is not None:
                stopped_by = stop
                break
            est, _, parent, match = heapq.heappop(heap)
            if est >= self.limits.alpha * best.cost:
                continue
            try:
                state = self.child(parent, match)
            except RewriteError:
                failed.add((match.key, match.bindings))
                continue
            h = state.graph.structural_hash()
            if h in seen:
                continue
            seen.add(h)
            explored += 1
            dequeued += 1
            if state.cost < best.cost:
                best = state
                last_better = dequeued
            trace.append(best.cost)
            if state.cost < self.limits.alpha * best.cost:  # the estimate that queued it can be off (fusion)
                expand(state)
            if len(heap) > 2 * self.max_queue:
                heap = heapq.nsmallest(self.max_queue, heap)
                heapq.heapify(heap)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(best=f"{best.cost * 1e3:.3f}ms", queue=len(heap))
        if bar is not None:
            bar.close()
        self.cost.flush()
        return SearchResult(
            graph=best.graph, cost_before=root.cost, cost_after=best.cost, applied=dict(Counter(best.path)),
            path=list(best.path), graphs_explored=explored + 1, dequeued=dequeued,
            seconds=time.perf_counter() - start, stopped_by=stopped_by, trace=trace,
            root_candidates=_best_per_rule(root))

    def _stop(self, dequeued: int, last_better: int, elapsed: float) -> SearchStop | None:
        """Whether a limit stops the search before its next dequeue (checked in this order)."""
        limits = self.limits
        if dequeued >= limits.budget:
            return SearchStop.BUDGET
        if limits.patience is not None and dequeued - last_better >= limits.patience:
            return SearchStop.CONVERGED
        if elapsed > limits.time_limit:
            return SearchStop.TIME_LIMIT
        return None


def _best_per_rule(state: State, limit: int = 8) -> list[dict]:
    best: dict[str, tuple[float, Match]] = {}
    for m, d in state.matches:
        if m.rule.name not in best or d < best[m.rule.name][0]:
            best[m.rule.name] = (d, m)
    ranked = sorted(best.items(), key=lambda kv: kv[1][0])[:limit]
    return [{"rule": name, "delta_s": d, "rendered": m.rule.render(), "nodes": list(m.nodes)}
            for name, (d, m) in ranked]


def _derive_constants(parent: State, rw: Rewrite, index: GraphIndex) -> set[str]:
    """Weight-only tensors of the child: the parent's, less what removed nodes computed, plus what the new
    and rewired nodes compute from weights (constness is not propagated further downstream: that only
    makes a cost estimate slightly high, and folding before export recomputes it exactly)."""
    constants = set(parent.constants)
    for name in rw.removed:
        constants.difference_update(parent.index.nodes[name].outputs)
    for name in sorted(set(rw.added) | set(rw.rewired), key=index.pos.__getitem__):
        n = index.nodes[name]
        if foldable(n, index.graph, constants):
            constants.update(o for o in n.outputs if o)
    return constants


def search(graph: Graph, rules: list[Rule], cost: CostModel, alpha: float = 1.05, budget: int = 1000,
           time_limit: float = 60.0, progress: bool = False, patience: int | None = None) -> SearchResult:
    """Best graph found for ``graph`` under ``cost`` using ``rules`` (see module docstring)."""
    limits = SearchLimits(alpha=alpha, budget=budget, time_limit=time_limit, patience=patience)
    return Searcher(rules, cost, limits, progress).run(graph)

