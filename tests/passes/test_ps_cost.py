"""The α-β cost of parameter-server steps (passes/ps_cost.py)."""
from __future__ import annotations

import pytest

from tessel.passes.machine import Link
from tessel.passes.ps_cost import exchange_plans, ps_step_seconds

GBIT = Link(alpha=50e-6, beta=8 / 1e9)  # 1 Gbit/s, 50 us per message


def test_one_server_is_bound_by_its_link_carrying_every_workers_push_and_pull():
    # 4 workers, 40 MB on one server: the server moves 4 x 2 x 40 MB.
    assert ps_step_seconds(GBIT, [40e6], 4) == pytest.approx(4 * (2 * 50e-6 + 8 / 1e9 * 80e6))


def test_enough_servers_leave_the_workers_links_as_the_bound():
    shards = [10e6] * 4
    worker = 2 * 4 * 50e-6 + 8 / 1e9 * 40e6 * 2
    assert ps_step_seconds(GBIT, shards, 4) == pytest.approx(max(worker, 4 * (2 * 50e-6 + 8 / 1e9 * 20e6)))


def test_compression_divides_the_bytes():
    assert ps_step_seconds(Link(0.0, 1e-9), [1e6], 2, 32, 32) == pytest.approx(ps_step_seconds(Link(0.0, 1e-9), [1e6], 2) / 32)


def test_plans_are_cheapest_first_and_more_servers_relieve_the_server_links():
    one = exchange_plans(GBIT, [40_000_000], workers=4)
    assert one[0].kind == "allreduce" and [p.servers for p in one if p.kind == "ps"] == [1]
    spread = exchange_plans(GBIT, [10_000_000] * 8, workers=4, max_servers=8)
    assert [p.seconds for p in spread] == sorted(p.seconds for p in spread)
    servers = [p.servers for p in spread if p.kind == "ps"]
    assert servers[0] >= 4 and servers[-1] == 1
    # Standalone servers move 2N per worker, a ring 2N(p-1)/p: all-reduce stays ahead on bandwidth alone.
    assert spread[0].kind == "allreduce"
