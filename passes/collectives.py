"""α-β cost of collective operations among p devices (Thakur, Rabenseifner and Gropp, 2005).

A message of m bytes between two devices costs α + β·m. `n` is the total
payload: the whole tensor being scattered, gathered, all-gathered or reduced.
Each collective has the algorithms MPI libraries choose between; `cost` names
the cheapest, and a runtime that implements only one (gloo's scatter and
gather are linear: the root talks to each peer in turn) asks for that one.
"""
from __future__ import annotations

import math

from .machine import Link


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def scatter_linear(link: Link, p: int, n: int) -> float:
    """The root sends each of the p − 1 others its n/p bytes, one after another."""
    return (p - 1) * (link.alpha + link.beta * n / p) if p > 1 and n else 0.0


def scatter_binomial(link: Link, p: int, n: int) -> float:
    """Binomial tree: ⌈log₂ p⌉ rounds, halving the data each round."""
    return _log2(p) * link.alpha + link.beta * n * (p - 1) / p if p > 1 and n else 0.0


# Gather is scatter reversed: the same costs.
gather_linear = scatter_linear
gather_binomial = scatter_binomial


def allgather_ring(link: Link, p: int, n: int) -> float:
    """Ring: p − 1 steps, each passing one n/p block to the next device."""
    return (p - 1) * (link.alpha + link.beta * n / p) if p > 1 and n else 0.0


def allgather_recursive_doubling(link: Link, p: int, n: int) -> float:
    """Recursive doubling: ⌈log₂ p⌉ exchanges of doubling size."""
    return _log2(p) * link.alpha + link.beta * n * (p - 1) / p if p > 1 and n else 0.0


def allreduce_ring(link: Link, p: int, n: int) -> float:
    """Ring reduce-scatter then ring all-gather: 2(p − 1) steps of n/p bytes (reduction arithmetic not counted)."""
    return 2 * (p - 1) * (link.alpha + link.beta * n / p) if p > 1 and n else 0.0


def allreduce_halving_doubling(link: Link, p: int, n: int) -> float:
    """Rabenseifner: recursive-halving reduce-scatter, recursive-doubling all-gather."""
    return 2 * _log2(p) * link.alpha + 2 * link.beta * n * (p - 1) / p if p > 1 and n else 0.0


def allreduce_gloo(link: Link, p: int, n: int) -> float:
    """gloo's own all-reduce of CPU tensors: its ring (reduce-scatter, then all-gather, each of p − 1 steps of n/p
    bytes, chunked so that sending and reducing overlap), so the ring's α-β cost."""
    return allreduce_ring(link, p, n)


ALGORITHMS = {
    "scatter": {"linear": scatter_linear, "binomial": scatter_binomial},
    "gather": {"linear": gather_linear, "binomial": gather_binomial},
    "allgather": {"ring": allgather_ring, "recursive_doubling": allgather_recursive_doubling},
    "allreduce": {"ring": allreduce_ring, "halving_doubling": allreduce_halving_doubling, "gloo": allreduce_gloo},
}


def cost(collective: str, link: Link, p: int, n: int, algorithm: str | None = None) -> tuple[float, str]:
    """(seconds, algorithm) of a collective: the named algorithm, or the cheapest."""
    options = ALGORITHMS[collective]
    if algorithm is not None:
        return options[algorithm](link, p, n), algorithm
    return min((fn(link, p, n), name) for name, fn in options.items())
