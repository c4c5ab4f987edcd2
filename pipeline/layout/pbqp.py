"""A PBQP solver: pick one option per node minimising the sum of node costs and pairwise edge costs.

Partitioned Boolean Quadratic Programming is how NeoCPU searches layouts on graphs that are not chains
(Liu et al., "Optimizing CNN Model Inference on CPUs", USENIX ATC'19, section 3.3; the reduction solver of
Scholz and Eckstein, "Register allocation for irregular architectures", LCTES'02, and Hames and Scholz,
"Nearly optimal register allocation with PBQP", JMLC'06).  Nodes are reduced one at a time:

* R0: a node without edges picks its cheapest option later, when the graph is rebuilt;
* R1: a node with one neighbour folds ``min_i (c_x[i] + C_xy[i, j])`` into the neighbour's costs;
* R2: a node with two neighbours becomes an edge between them, ``min_i (c_x[i] + C_xy[i, j] + C_xz[i, k])``;
* RN (only when every node has three or more neighbours): the node of highest degree takes the option that
  looks cheapest with its neighbours at their best, and its choice is folded into them.

R0-R2 are exact, so chains and series-parallel graphs (a ResNet's residual blocks reduce this way) are
solved optimally; only RN is a heuristic.  Everything is deterministic: nodes are reduced in index order
among equals and ties between options go to the lower index.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Problem:
    """Cost vectors per node and cost matrices per edge ``(i, j)`` with ``i < j``, shaped ``(n_i, n_j)``."""

    costs: list[np.ndarray] = field(default_factory=list)
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def add_node(self, costs) -> int:
        self.costs.append(np.asarray(costs, dtype=np.float64).copy())
        return len(self.costs) - 1

    def add_edge(self, i: int, j: int, matrix) -> None:
        """Adds ``matrix[option of i, option of j]`` (summed with an existing edge); i == j adds its diagonal."""
        m = np.asarray(matrix, dtype=np.float64)
        if m.shape != (len(self.costs[i]), len(self.costs[j])):
            raise ValueError(f"edge ({i}, {j}) matrix {m.shape} does not match the nodes' options")
        if i == j:
            self.costs[i] = self.costs[i] + np.diag(m)
            return
        if i > j:
            i, j, m = j, i, m.T
        self.edges[(i, j)] = self.edges.get((i, j), 0) + m

    def total(self, selection: list[int]) -> float:
        """The objective of a full selection (one option index per node)."""
        out = sum(float(c[s]) for c, s in zip(self.costs, selection))
        return out + sum(float(m[selection[i], selection[j]]) for (i, j), m in self.edges.items())


def solve(problem: Problem) -> list[int]:
    """One option index per node (see the module docstring)."""
    n = len(problem.costs)
    costs = [c.copy() for c in problem.costs]
    adj: dict[int, dict[int, np.ndarray]] = {i: {} for i in range(n)}  # adj[x][y]: matrix [option x, option y]
    for (i, j), m in problem.edges.items():
        adj[i][j] = m.copy()
        adj[j][i] = m.T.copy()
    alive = set(range(n))
    stack: list[tuple] = []
    choice: dict[int, int] = {}

    def remove(x: int) -> None:
        for y in adj[x]:
            del adj[y][x]
        adj[x] = {}
        alive.discard(x)

    def link(y: int, z: int, m: np.ndarray) -> None:
        if z in adj[y]:
            adj[y][z] = adj[y][z] + m
        else:
            adj[y][z] = m
        adj[z][y] = adj[y][z].T

    while alive:
        x = min(alive, key=lambda v: (len(adj[v]), v))
        deg = len(adj[x])
        nbrs = sorted(adj[x])
        if deg == 0:
            stack.append(("R0", x, costs[x].copy()))
        elif deg == 1:
            (y,) = nbrs
            m = adj[x][y]
            stack.append(("R1", x, costs[x].copy(), y, m.copy()))
            costs[y] = costs[y] + (costs[x][:, None] + m).min(axis=0)
        elif deg == 2:
            y, z = nbrs
            my, mz = adj[x][y], adj[x][z]
            stack.append(("R2", x, costs[x].copy(), y, my.copy(), z, mz.copy()))
            link(y, z, (costs[x][:, None, None] + my[:, :, None] + mz[:, None, :]).min(axis=0))
        else:  # RN: the most connected node decides greedily
            x = max(alive, key=lambda v: (len(adj[v]), -v))
            look = costs[x] + sum((adj[x][y] + costs[y][None, :]).min(axis=1) for y in sorted(adj[x]))
            pick = int(np.argmin(look))
            choice[x] = pick
            for y in sorted(adj[x]):
                costs[y] = costs[y] + adj[x][y][pick]
        remove(x)

    for entry in reversed(stack):
        kind, x, cx = entry[0], entry[1], entry[2]
        if kind == "R0":
            choice[x] = int(np.argmin(cx))
        elif kind == "R1":
            y, m = entry[3], entry[4]
            choice[x] = int(np.argmin(cx + m[:, choice[y]]))
        else:
            y, my, z, mz = entry[3:]
            choice[x] = int(np.argmin(cx + my[:, choice[y]] + mz[:, choice[z]]))
    return [choice[i] for i in range(n)]
