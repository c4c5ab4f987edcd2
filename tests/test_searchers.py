"""Searcher behaviour on synthetic objectives (no TVM): sample efficiency, determinism, no repeats,
G-BFS's start, N-A2C's gradients and the sign of its policy update."""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from graphopt.errors import UserError
from kerneltune.searchers import SEARCHERS, make_searcher
from kerneltune.searchers.na2c import (MLP, NA2C, NA2CConfig, masked_log_softmax, policy_loss_and_grads,
                                       value_loss_and_grads)
from kerneltune.searchers.opevo import OpEvo
from kerneltune.space import ChoiceKnob, DiscreteKnob, FactorKnob, ProductLimit, SearchSpace

MM_SPACE = SearchSpace([FactorKnob("i", 128, 4), FactorKnob("j", 768, 4), FactorKnob("k", 768, 2)])
OPTIMUM = {"i": (2, 2, 4, 8), "j": (4, 3, 8, 8), "k": (96, 8)}


def rugged(config) -> float:
    """A GEMM-like landscape: a smooth peak in log-tile space times a +-15% per-config hash 'noise'."""
    d = sum((math.log2(a) - math.log2(b)) ** 2
            for knob, v in zip(MM_SPACE.knobs, config) for a, b in zip(v, OPTIMUM[knob.name]))
    h = int(hashlib.md5(repr(config).encode()).hexdigest()[:8], 16) / 2 ** 32
    return 100 * math.exp(-d / 8) * (0.7 + 0.3 * h)


def run(searcher, objective, trials):
    seen = []
    while len(seen) < trials:
        configs = searcher.propose(min(searcher.batch_size, trials - len(seen)))
        if not configs:
            break
        searcher.observe(configs, [objective(c) for c in configs])
        seen.extend(configs)
    return seen


def test_opevo_beats_random_on_average():
    def mean_best(name):
        return np.mean([max(map(rugged, run(make_searcher(name, MM_SPACE, seed), rugged, 96)))
                        for seed in range(8)])
    assert mean_best("opevo") > 1.2 * mean_best("random")


@pytest.mark.parametrize("name", sorted(SEARCHERS))
def test_deterministic_under_seed(name):
    a = run(make_searcher(name, MM_SPACE, 3), rugged, 40)
    b = run(make_searcher(name, MM_SPACE, 3), rugged, 40)
    c = run(make_searcher(name, MM_SPACE, 4), rugged, 40)
    assert a == b and a != c


@pytest.mark.parametrize("name", sorted(SEARCHERS))
def test_never_repeats_and_exhausts_small_space(name):
    space = SearchSpace([FactorKnob("a", 12, 3), FactorKnob("b", 8, 2)])   # 18 * 4 = 72 configs
    seen = run(make_searcher(name, space, 0), lambda c: float(c[0][-1] * c[1][-1]), 500)
    assert len(seen) == len(set(seen)) == space.size()
    assert all(space.contains(c) for c in seen)


@pytest.mark.parametrize("name", sorted(SEARCHERS))
def test_every_searcher_proposes_only_configs_meeting_the_constraints(name):
    """A served matmul's space holds its rows' S2 slot at 1 (``cpu.SERVED_ROW_REPEAT``): every searcher,
    N-A2C's moves included, proposes configs inside it."""
    space = SearchSpace(MM_SPACE.knobs, (ProductLimit((("i", 2),), 1),))
    seen = run(make_searcher(name, space, 0), rugged, 96)
    assert seen and all(space.contains(c) for c in seen), [c for c in seen if not space.contains(c)][:3]


def test_opevo_never_repeats_with_mixed_knobs():
    space = SearchSpace([FactorKnob("a", 64, 3), DiscreteKnob("u", (0, 16, 64, 512)),
                         ChoiceKnob("v", ("x", "y", "z"))])
    f = lambda c: c[0][-1] * (1 + c[1]) * (2 if c[2] == "y" else 1)  # noqa: E731
    seen = run(OpEvo(space, seed=1), f, space.size())
    assert len(seen) == len(set(seen)) == space.size()


def test_opevo_random_until_parents_then_evolves():
    s = OpEvo(MM_SPACE, seed=0, parents_size=8, offspring_size=8)
    first = s.propose(8)
    s.observe(first, [0.0] * 8)          # nothing built: best < 1e-3 keeps it random
    assert s.propose(8) and s.ranked[0][1] == 0.0
    s2 = OpEvo(MM_SPACE, seed=0, q=0.0)  # q = 0: children are pure recombinations of the parents
    parents = s2.propose(8)
    s2.observe(parents, [float(i + 1) for i in range(8)])
    children = s2.propose(8)
    assert not set(children) & set(parents)
    # duplicates cannot be re-mutated with q = 0, so a few children are random bail-outs; the rest recombine
    mixes = [c for c in children if all(any(c[k] == p[k] for p in parents) for k in range(3))]
    assert len(mixes) >= 4


def test_recombination_is_fitness_proportional():
    s = OpEvo(MM_SPACE, seed=0)
    a, b = MM_SPACE.sample(s.rng), MM_SPACE.sample(s.rng)
    assert all(x != y for x, y in zip(a, b))
    kids = [s.recombine([a, b], [3.0, 1.0]) for _ in range(4000)]
    frac = np.mean([kid[k] == a[k] for kid in kids for k in range(3)])
    assert abs(frac - 0.75) < 0.02


def test_q_random_walk_steps():
    """q = 0.5: a knob keeps its value with probability 1/2 (or returns to it), else walks to neighbours."""
    s = OpEvo(MM_SPACE, seed=0, q=0.5)
    start = ((2, 2, 4, 8), (4, 3, 8, 8), (96, 8))
    outs = [s.mutate(start) for _ in range(3000)]
    unchanged = np.mean([o[2] == start[2] for o in outs])
    assert 0.5 <= unchanged < 0.65         # 1/2 stop at once, plus walks that come back
    one_step = [o[2] for o in outs if o[2] != start[2]]
    assert all(MM_SPACE.contains(o) for o in outs)
    assert set(MM_SPACE.knobs[2].neighbours(start[2])) <= set(one_step)
    assert OpEvo(MM_SPACE, seed=0, q=0.0).mutate(start) == start


def test_gbfs_starts_untiled_and_expands_neighbours():
    s = make_searcher("gbfs", MM_SPACE, 0)
    first = s.propose(5)
    assert first == [((128, 1, 1, 1), (768, 1, 1, 1), (768, 1))]
    s.observe(first, [1.0])
    second = s.propose(5)
    assert len(second) == 5 and len(set(second)) == 5
    for c in second:
        diff = [i for i in range(3) if c[i] != first[0][i]]
        assert len(diff) == 1 and c[diff[0]] in MM_SPACE.knobs[diff[0]].neighbours(first[0][diff[0]])


def test_gbfs_expands_best_first():
    s = make_searcher("gbfs", MM_SPACE, 0)
    s0 = s.propose(5)
    s.observe(s0, [1.0])
    batch = s.propose(5)
    s.observe(batch, [2.0, 9.0, 3.0, 0.0, 1.0])
    nxt = s.propose(5)
    best = batch[1]
    assert all(sum(c[i] != best[i] for i in range(3)) == 1 for c in nxt)


WARM = ((4, 2, 2, 8), (2, 4, 12, 8), (48, 16))   # a decent config, as a template default would be


def knob_moves(a, b) -> int:
    return sum(x != y for x, y in zip(a, b))


@pytest.mark.parametrize("name", sorted(SEARCHERS))
def test_warm_start_is_where_every_searcher_begins(name):
    """A config observed before the first proposal (the template default) is where the search starts:
    never proposed again; OpEvo's first children are mutations of it (no random generation first), G-BFS
    expands it instead of measuring the untiled config, N-A2C rolls out from it; random just skips it."""
    s = make_searcher(name, MM_SPACE, 0)
    s.observe([WARM], [rugged(WARM)])
    batch = s.propose(8 if name != "gbfs" else 5)
    assert WARM not in batch and len(batch) == len(set(batch))
    near = [knob_moves(c, WARM) for c in batch]
    if name == "random":
        assert sum(near) > 2 * len(batch)  # unrelated configs differ in (nearly) every knob
    elif name == "gbfs":
        assert near == [1] * 5 and ((128, 1, 1, 1), (768, 1, 1, 1), (768, 1)) not in batch
    else:  # opevo, na2c: a few knobs moved from the warm start, the rest kept
        assert all(1 <= n <= 3 for n in near) and sum(n < 3 for n in near) >= len(batch) // 2


def test_opevo_warm_started_beats_cold_on_a_small_budget():
    """The point of the warm start: with 24 trials, evolving from a good default finds better configs than
    a first random generation does."""
    def best(warm: bool, seed: int) -> float:
        s = make_searcher("opevo", MM_SPACE, seed)
        if warm:
            s.observe([WARM], [rugged(WARM)])
        return max(rugged(c) for c in run(s, rugged, 24))
    assert np.mean([best(True, k) for k in range(6)]) > 1.2 * np.mean([best(False, k) for k in range(6)])


def test_factor_only_searchers_refuse_other_knobs_and_can_fix_them():
    space = SearchSpace([FactorKnob("a", 64, 3), DiscreteKnob("u", (0, 16, 64))])
    for name in ("gbfs", "na2c"):
        with pytest.raises(UserError, match="factor knobs only"):
            make_searcher(name, space, 0)
        s = make_searcher(name, space, 0, fixed=((64, 1, 1), 16))
        seen = run(s, lambda c: float(c[0][-1]), 10)
        assert len(seen) == 10 and all(c[1] == 16 for c in seen)
    with pytest.raises(UserError, match="unknown searcher"):
        make_searcher("anneal", space, 0)


# ----------------------------------------------------------------------------------------- N-A2C maths
def _fd_check(net, loss_fn, grads):
    rng = np.random.default_rng(0)
    for name, p in net.params().items():
        for _ in range(6):
            idx = tuple(rng.integers(0, s) for s in p.shape)
            old = p[idx]
            p[idx] = old + 1e-6
            up = loss_fn()
            p[idx] = old - 1e-6
            down = loss_fn()
            p[idx] = old
            num = (up - down) / 2e-6
            assert abs(num - grads[name][idx]) <= 1e-5 + 1e-4 * abs(num), (name, idx, num, grads[name][idx])


def test_na2c_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(7, 5))
    actions = rng.integers(0, 6, size=7)
    masks = rng.random((7, 6)) < 0.7
    masks[np.arange(7), actions] = True
    adv = rng.normal(size=7)
    actor = MLP.init(rng, 5, 16, 6)
    actor.W2 *= 10   # make the softmax non-trivial
    _, g = policy_loss_and_grads(actor, X, actions, masks, adv)
    _fd_check(actor, lambda: policy_loss_and_grads(actor, X, actions, masks, adv)[0], g)
    critic = MLP.init(rng, 5, 16, 1)
    targets = rng.normal(size=7)
    _, g = value_loss_and_grads(critic, X, targets)
    _fd_check(critic, lambda: value_loss_and_grads(critic, X, targets)[0], g)


def test_na2c_policy_step_raises_probability_of_advantaged_action():
    """The sign NNI got wrong: a positive advantage must make the taken action more likely."""
    s = NA2C(MM_SPACE, seed=0, config=NA2CConfig(lr=1e-2))
    c = ((128, 1, 1, 1), (768, 1, 1, 1), (768, 1))
    X, mask = s.features([c]), s.valid(c)[None]
    a = int(np.flatnonzero(mask[0])[0])
    before = np.exp(masked_log_softmax(s.actor.forward(X)[1], mask))[0, a]
    for _ in range(20):
        _, g = policy_loss_and_grads(s.actor, X, np.array([a]), mask, np.array([1.0]))
        s.actor_opt.step(g)
    after = np.exp(masked_log_softmax(s.actor.forward(X)[1], mask))[0, a]
    assert after > 2 * before


def test_na2c_explores_near_best_and_trains():
    s = NA2C(MM_SPACE, seed=0)
    seen = run(s, rugged, 60)
    assert seen[0] == ((128, 1, 1, 1), (768, 1, 1, 1), (768, 1))
    assert len(s.memory) > 0 and s.actor_opt.t > 0
    # each new round starts from the best config so far: its configs are <= T moves from it
    best = s.best[0]
    batch = s.propose(6)
    assert all(sum(x != y for x, y in zip(c, best)) <= 3 for c in batch)
