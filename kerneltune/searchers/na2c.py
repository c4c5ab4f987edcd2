"""N-A2C (Zhang et al., "Compiler-Level Matrix Multiplication Optimization for Deep Learning", Alg. 2).

An advantage actor-critic explores a T-step neighbourhood of the best config found so far.  State = the
config as features (log of each tile factor over log of its product); actions = "move prime p of knob k
from level i to level j" (the same moves OpEvo's factor topology uses; the paper only moves 2s).  Each
round rolls out from the best config until ``collect`` unvisited configs are found (epsilon-greedy: random
valid action with probability epsilon, otherwise a sample of the policy), those are measured, and every
rollout step whose next state has a known fitness becomes a transition ``(s, a, r, s')`` in a replay
memory that trains the two MLPs.

The loss is the textbook A2C loss — NNI's version forgot the minus sign of the policy term, so it
*minimised* the probability of good actions:
    advantage  A = r + gamma * V(s') - V(s)          (V(s') and A are constants for the gradients)
    policy     L_pi = mean(-log pi(a|s) * A)
    value      L_v  = mean((r + gamma * V(s') - V(s))^2)
The reward is GFLOPS divided by the best GFLOPS seen so far, so rewards sit in [0, 1] whatever the
operator's scale (the ranking of actions is unchanged; Adam's step sizes stay meaningful).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kerneltune.searchers.base import Searcher, require_factor_only, untiled
from kerneltune.space import Config, FactorKnob, SearchSpace, prime_factors

MASKED_LOGIT = -1e9   # logit of an invalid action: probability exactly 0 after softmax, no NaNs


# --------------------------------------------------------------------------- numpy actor-critic
@dataclass
class MLP:
    """One hidden tanh layer: ``y = W2 tanh(W1 x + b1) + b2``."""

    W1: np.ndarray
    b1: np.ndarray
    W2: np.ndarray
    b2: np.ndarray

    @classmethod
    def init(cls, rng: np.random.Generator, n_in: int, hidden: int, n_out: int) -> "MLP":
        return cls(rng.normal(0, 1 / np.sqrt(n_in), (n_in, hidden)), np.zeros(hidden),
                   rng.normal(0, 1 / np.sqrt(hidden), (hidden, n_out)) * 0.1, np.zeros(n_out))

    def params(self) -> dict[str, np.ndarray]:
        return {"W1": self.W1, "b1": self.b1, "W2": self.W2, "b2": self.b2}

    def forward(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        H = np.tanh(X @ self.W1 + self.b1)
        return H, H @ self.W2 + self.b2

    def backward(self, X: np.ndarray, H: np.ndarray, dY: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of a loss w.r.t. the parameters given dLoss/dY."""
        dH = (dY @ self.W2.T) * (1 - H * H)
        return {"W1": X.T @ dH, "b1": dH.sum(0), "W2": H.T @ dY, "b2": dY.sum(0)}


def masked_log_softmax(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    z = np.where(mask, logits, MASKED_LOGIT)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def policy_loss_and_grads(actor: MLP, X: np.ndarray, actions: np.ndarray, masks: np.ndarray,
                          adv: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """L = mean(-log pi(a|s) * A) with A constant; dL/dlogits = (pi - onehot(a)) * A / B."""
    H, logits = actor.forward(X)
    logp = masked_log_softmax(logits, masks)
    B = len(X)
    loss = float(-(logp[np.arange(B), actions] * adv).mean())
    pi = np.exp(logp)
    d = pi.copy()
    d[np.arange(B), actions] -= 1.0
    d *= (adv / B)[:, None]
    return loss, actor.backward(X, H, d)


def value_loss_and_grads(critic: MLP, X: np.ndarray, targets: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """L = mean((target - V(s))^2) with target = r + gamma V(s') constant; dL/dV = -2 (target - V) / B."""
    H, V = critic.forward(X)
    A = targets - V[:, 0]
    loss = float((A * A).mean())
    return loss, critic.backward(X, H, (-2.0 * A / len(X))[:, None])


class Adam:
    def __init__(self, net: MLP, lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
        self.net, self.lr, self.b1, self.b2, self.eps, self.t = net, lr, b1, b2, eps, 0
        self.m = {k: np.zeros_like(v) for k, v in net.params().items()}
        self.v = {k: np.zeros_like(v) for k, v in net.params().items()}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        for k, p in self.net.params().items():
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * grads[k]
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * grads[k] ** 2
            mh = self.m[k] / (1 - self.b1 ** self.t)
            vh = self.v[k] / (1 - self.b2 ** self.t)
            p -= self.lr * mh / (np.sqrt(vh) + self.eps)   # in place: the MLP sees the update


# --------------------------------------------------------------------------- the searcher
@dataclass(frozen=True)
class Move:
    """Move prime ``p`` of knob ``knob`` from tile level ``src`` to level ``dst``."""

    knob: int
    src: int
    dst: int
    p: int


@dataclass(frozen=True)
class NA2CConfig:
    """N-A2C's hyperparameters."""

    steps: int = 3  # moves per rollout
    epsilon: float = 0.1  # exploration: a random move's probability
    collect: int = 6  # rollouts (configs) per batch
    hidden: int = 128  # hidden units of the actor's and the critic's MLPs
    lr: float = 1e-3  # Adam's learning rate
    gamma: float = 0.9  # discount
    memory: int = 512  # distinct transitions the replay memory keeps
    train_batch: int = 64  # transitions per training step


class NA2C(Searcher):
    name = "na2c"

    def __init__(self, space: SearchSpace, seed: int = 0, config: NA2CConfig = NA2CConfig()):
        require_factor_only(space, self.name)
        super().__init__(space, seed)
        c = config
        steps, epsilon, collect, hidden, lr, gamma, memory, train_batch = (
            c.steps, c.epsilon, c.collect, c.hidden, c.lr, c.gamma, c.memory, c.train_batch)
        self.T, self.epsilon, self.gamma, self.train_batch = steps, epsilon, gamma, train_batch
        self.batch_size = collect
        self.knobs: list[FactorKnob] = list(space.knobs)  # type: ignore[arg-type]
        self.moves = [Move(k, i, j, p) for k, kn in enumerate(self.knobs) for p in sorted(set(prime_factors(kn.product)))
                      for i in range(kn.n) for j in range(kn.n) if i != j]
        if not self.moves:
            raise ValueError("na2c: every factor knob has product 1; there is nothing to search")
        n_in = sum(k.n for k in self.knobs)
        self.np_rng = np.random.default_rng(seed)
        self.actor = MLP.init(self.np_rng, n_in, hidden, len(self.moves))
        self.critic = MLP.init(self.np_rng, n_in, hidden, 1)
        self.actor_opt, self.critic_opt = Adam(self.actor, lr), Adam(self.critic, lr)
        # Replay memory of distinct transitions, oldest first (a dict keeps insertion order and dedupes).
        self.memory: dict[tuple[Config, int, Config], None] = {}
        self.memory_size = memory
        self._pending: list[tuple[Config, int, Config]] = []   # rollout steps awaiting measurements
        self.start = untiled(space)

    # -- MDP
    def features(self, configs: list[Config]) -> np.ndarray:
        rows = []
        for c in configs:
            row = []
            for kn, v in zip(self.knobs, c):
                scale = np.log(kn.product) if kn.product > 1 else 1.0
                row.extend(np.log(x) / scale for x in v)
            rows.append(row)
        return np.asarray(rows, dtype=np.float64)

    def valid(self, c: Config) -> np.ndarray:
        """The moves ``c`` allows: the source slot holds the prime, and the config moved to meets the space's
        constraints (a register tile's accumulators, a served tile's row repeat)."""
        ok = [c[m.knob][m.src] % m.p == 0 for m in self.moves]
        if self.space.constraints:
            ok = [v and self.space.valid(self.step(c, a)) for a, v in enumerate(ok)]
        return np.array(ok)

    def step(self, c: Config, a: int) -> Config:
        m = self.moves[a]
        v = list(c[m.knob])
        v[m.src] //= m.p
        v[m.dst] *= m.p
        return c[:m.knob] + (tuple(v),) + c[m.knob + 1:]

    def act(self, c: Config) -> int:
        mask = self.valid(c)
        idx = np.flatnonzero(mask)
        if self.rng.random() < self.epsilon:
            return int(idx[self.rng.randrange(len(idx))])
        _, logits = self.actor.forward(self.features([c]))
        pi = np.exp(masked_log_softmax(logits, mask[None])[0])
        return int(self.rng.choices(range(len(pi)), weights=pi.tolist())[0])

    # -- searcher interface
    def _propose(self, n: int) -> list[Config]:
        out: list[Config] = []
        if not self.fitness and self.start not in self.sampled:
            out.append(self.start)  # the paper's start; with a warm start, rollouts begin at the best observed
        s0 = self.best[0] or self.start
        rollouts = 0
        while len(out) < n and rollouts < 50 * n:
            rollouts += 1
            s = s0
            for _ in range(self.T):
                a = self.act(s)
                s2 = self.step(s, a)
                self._pending.append((s, a, s2))
                if s2 not in self.sampled and s2 not in out:
                    out.append(s2)
                    if len(out) == n:
                        break
                s = s2
        if len(out) < n:   # the T-step neighbourhood of the best config is exhausted
            out.extend(self.random_unsampled(n - len(out), exclude=set(out)))
        return out

    def _observe(self, configs: list[Config], results: list[float]) -> None:
        for t in self._pending:
            if t[2] in self.fitness and t not in self.memory:
                self.memory[t] = None
                if len(self.memory) > self.memory_size:
                    del self.memory[next(iter(self.memory))]
        self._pending = []
        for _ in configs:   # one training step per measured config, as in Alg. 2 line 26
            if self.memory:
                self.train_step()

    def train_step(self) -> tuple[float, float]:
        """One Adam step of actor and critic on a minibatch of the replay memory."""
        best = self.best[1]
        if best <= 0:
            return 0.0, 0.0
        idx = self.np_rng.choice(len(self.memory), size=min(self.train_batch, len(self.memory)), replace=False)
        transitions = list(self.memory)
        batch = [transitions[i] for i in idx]
        X = self.features([s for s, _, _ in batch])
        X2 = self.features([s2 for _, _, s2 in batch])
        actions = np.array([a for _, a, _ in batch])
        masks = np.stack([self.valid(s) for s, _, _ in batch])
        r = np.array([self.fitness[s2] for _, _, s2 in batch]) / best
        targets = r + self.gamma * self.critic.forward(X2)[1][:, 0]
        adv = targets - self.critic.forward(X)[1][:, 0]
        lp, gp = policy_loss_and_grads(self.actor, X, actions, masks, adv)
        lv, gv = value_loss_and_grads(self.critic, X, targets)
        self.actor_opt.step(gp)
        self.critic_opt.step(gv)
        return lp, lv
