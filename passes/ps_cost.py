"""α-β cost of a parameter-server step's communication, next to all-reduce's (passes/collectives.py).

In a step every worker pushes each shard's gradient to its server and pulls the shard's weights back. A
server's link carries its shard W times in and W times out, so with few servers the servers' links are the
bottleneck; a worker's link carries the whole model once each way, in one message per server. The step's
communication takes as long as the busier of the two (pushes and pulls are different phases of a step, so
their times add). Compression divides the bytes by its ratio.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .collectives import cost
from .machine import Link


def ps_step_seconds(link: Link, shard_bytes: Sequence[int], workers: int, push_ratio: float = 1.0,
                    pull_ratio: float = 1.0) -> float:
    """Seconds of one step's pushes and pulls: `shard_bytes` per server (float32), `workers` workers, the bytes
    of pushes and pulls divided by their compression ratios."""
    per_byte = 1.0 / push_ratio + 1.0 / pull_ratio
    server = max(workers * (2 * link.alpha + link.beta * size * per_byte) for size in shard_bytes)
    worker = 2 * len(shard_bytes) * link.alpha + link.beta * sum(shard_bytes) * per_byte
    return max(server, worker)


@dataclass(frozen=True)
class ExchangePlan:
    """One way to exchange a step's gradients, and its predicted seconds (an α-β estimate)."""

    kind: str          # "allreduce" or "ps"
    servers: int       # ps: how many servers
    algorithm: str     # allreduce: the collective's algorithm; ps: "sharded"
    seconds: float


def exchange_plans(link: Link, parameter_bytes: Sequence[int], workers: int, max_servers: int | None = None,
                   ratio: float = 1.0) -> list[ExchangePlan]:
    """Every way to exchange the gradients of parameters of `parameter_bytes`, cheapest first: all-reduce with
    its cheapest algorithm, and parameter servers from 1 to `max_servers` (default `workers`), the parameters
    shared out largest first to the lightest server; `ratio` divides the bytes of both (compression)."""
    total = sum(parameter_bytes)
    seconds, algorithm = cost("allreduce", link, workers, round(total / ratio))
    plans = [ExchangePlan("allreduce", 0, algorithm, seconds)]
    for servers in range(1, min(max_servers or workers, len(parameter_bytes)) + 1):
        loads = [0] * servers
        for size in sorted(parameter_bytes, reverse=True):
            loads[loads.index(min(loads))] += size
        plans.append(ExchangePlan("ps", servers, "sharded", ps_step_seconds(link, loads, workers, ratio, ratio)))
    return sorted(plans, key=lambda plan: plan.seconds)
