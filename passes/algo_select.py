"""Micro-batch and algorithm selection (μ-cuDNN, Oyama et al.), as pure functions.

A layer (a conv or matmul kernel) runs its mini-batch of B samples as a
sequence of micro-batches, each with one of its algorithms. Every algorithm
has, per micro-batch size b, a time T_a(b) and a workspace W_a(b) (memory it
needs beyond its inputs and outputs). Micro-batches run one after another and
reuse one workspace, so a configuration costs the sum of its times and the
maximum of its workspaces.

- `layer_pareto` (per-layer DP): T(b) = min{ min_a T_a(b), min_b' T(b') + T(b − b') }
  over the micro-batch sizes a policy allows, keeping for every b the Pareto
  set of (time, workspace) under a workspace limit.
- `select_ilp` (cross-layer ILP, μ-cuDNN's "workspace division"): one
  configuration per layer from its Pareto set, total workspace ≤ budget,
  minimum total time — solved with scipy's HiGHS MILP, and reported against
  its LP relaxation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

POLICIES = ("undivided", "powers-of-two", "all")


class AlgoSelectError(ValueError):
    """No configuration satisfies the workspace limit or budget."""


@dataclass(frozen=True)
class Candidate:
    """One algorithm of a layer at one micro-batch size: its time and workspace."""

    algorithm: str
    batch: int
    seconds: float
    workspace: int
    measured: bool = True


@dataclass(frozen=True)
class Config:
    """One way to run a layer's whole batch: (algorithm, micro-batch size) pieces in order."""

    pieces: tuple[tuple[str, int], ...]
    seconds: float
    workspace: int
    measured: bool = True

    @property
    def undivided(self) -> bool:
        """True when the batch runs in one piece."""
        return len(self.pieces) == 1

    def describe(self) -> str:
        """E.g. 'nchwc 4+4+8' or 'direct 16, nchwc 4' (pieces grouped by algorithm)."""
        groups: list[tuple[str, list[int]]] = []
        for algorithm, size in self.pieces:
            if groups and groups[-1][0] == algorithm:
                groups[-1][1].append(size)
            else:
                groups.append((algorithm, [size]))
        return ", ".join(f"{a} {'+'.join(map(str, sizes))}" for a, sizes in groups)


def micro_batch_sizes(batch: int, policy: str) -> list[int]:
    """The micro-batch sizes `policy` allows for a mini-batch of `batch` (the whole batch always)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown batch-size policy {policy!r}; use one of {', '.join(POLICIES)}")
    if policy == "undivided":
        return [batch]
    if policy == "all":
        return list(range(1, batch + 1))
    sizes = {batch}
    size = 1
    while size < batch:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def pareto(configs: Iterable[Config]) -> list[Config]:
    """The configurations no other one beats in both time and workspace, fastest first."""
    front: list[Config] = []
    for config in sorted(configs, key=lambda c: (c.seconds, c.workspace, len(c.pieces))):
        if not front or config.workspace < front[-1].workspace:
            front.append(config)
    return front


def _combine(first: Config, second: Config) -> Config:
    return Config(first.pieces + second.pieces, first.seconds + second.seconds,
                  max(first.workspace, second.workspace), first.measured and second.measured)


def layer_pareto(batch: int, candidates: Sequence[Candidate], limit: int | None = None,
                 policy: str = "powers-of-two") -> list[Config]:
    """The Pareto set of (time, workspace) configurations of one layer at `batch` (per-layer DP).

    `candidates` are the measured (or estimated) algorithms per micro-batch size;
    configurations whose workspace exceeds `limit` are dropped. Empty when nothing fits.
    """
    sizes = set(micro_batch_sizes(batch, policy))
    leaves: dict[int, list[Config]] = {}
    for c in candidates:
        if c.batch in sizes and (limit is None or c.workspace <= limit):
            leaves.setdefault(c.batch, []).append(Config(((c.algorithm, c.batch),), c.seconds, c.workspace, c.measured))
    fronts: dict[int, list[Config]] = {}
    for b in range(1, batch + 1):
        options = list(leaves.get(b, ()))
        # Splits are symmetric: the first part no larger than the second covers every pair.
        for first in range(1, b // 2 + 1):
            for left in fronts[first]:
                for right in fronts[b - first]:
                    options.append(_combine(left, right))
        fronts[b] = pareto(options)
    return fronts[batch]


def best_single(batch: int, candidates: Sequence[Candidate], limit: int | None = None) -> Config | None:
    """The fastest algorithm running the whole batch at once within `limit` (the baseline), or None."""
    front = layer_pareto(batch, candidates, limit, "undivided")
    return front[0] if front else None


@dataclass(frozen=True)
class ILPResult:
    """The chosen configuration index per layer, and the solver's account of it."""

    choice: tuple[int, ...]
    objective: float
    lp_bound: float
    seconds_to_solve: float
    workspace: int

    @property
    def gap(self) -> float:
        """(objective − LP bound) / objective: how far the answer can be from the optimum, at most."""
        return (self.objective - self.lp_bound) / self.objective if self.objective > 0 else 0.0

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return {"objective_s": self.objective, "lp_bound_s": self.lp_bound, "gap": self.gap,
                "solve_seconds": self.seconds_to_solve, "workspace_bytes": self.workspace}


def select_ilp(layers: Sequence[Sequence[Config]], budget: int) -> ILPResult:
    """One configuration per layer with total workspace ≤ `budget` and minimum total time (HiGHS MILP).

    Variables x[k, c] ∈ {0, 1}: layer k runs configuration c. As in μ-cuDNN:
      minimize    Σ_k Σ_c T_k(c) · x[k, c]
      subject to  one_configuration_per_layer:  Σ_c x[k, c] = 1   for every layer k
                  total_workspace:              Σ_k Σ_c W_k(c) · x[k, c] ≤ budget
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    if any(not configs for configs in layers):
        raise AlgoSelectError("a layer has no configuration within the workspace limit")
    smallest = sum(min(c.workspace for c in configs) for configs in layers)
    if smallest > budget:
        raise AlgoSelectError(f"the layers need at least {smallest} bytes of workspace together; the budget is {budget}")
    offsets = np.cumsum([0] + [len(configs) for configs in layers])
    count = int(offsets[-1])
    time_cost = np.array([c.seconds for configs in layers for c in configs])
    workspace = np.array([c.workspace for configs in layers for c in configs], dtype=float)
    one_configuration_per_layer = np.zeros((len(layers), count))
    for k in range(len(layers)):
        one_configuration_per_layer[k, offsets[k]:offsets[k + 1]] = 1.0
    constraints = [LinearConstraint(one_configuration_per_layer, 1.0, 1.0),
                   LinearConstraint(workspace[None, :], -np.inf, float(budget))]
    started = time.perf_counter()
    solved = milp(time_cost, constraints=constraints, integrality=np.ones(count), bounds=Bounds(0, 1))
    elapsed = time.perf_counter() - started
    if not solved.success:
        raise AlgoSelectError(f"the ILP found no solution ({solved.message})")
    relaxed = milp(time_cost, constraints=constraints, integrality=np.zeros(count), bounds=Bounds(0, 1))
    x = np.round(solved.x).astype(int)
    choice = tuple(int(np.argmax(x[offsets[k]:offsets[k + 1]])) for k in range(len(layers)))
    chosen_workspace = sum(layers[k][c].workspace for k, c in enumerate(choice))
    objective = float(sum(layers[k][c].seconds for k, c in enumerate(choice)))
    return ILPResult(choice, objective, float(relaxed.fun), elapsed, chosen_workspace)
