"""α-β costs of collectives: the textbook formulas and which algorithm wins when."""
import pytest

from tessel.passes.collectives import (allgather_recursive_doubling, allgather_ring, allreduce_gloo,
                                       allreduce_halving_doubling, allreduce_ring, cost, scatter_binomial,
                                       scatter_linear)
from tessel.passes.machine import Link

LINK = Link(alpha=1e-5, beta=1e-9)


def test_formulas():
    n, p = 8_000_000, 4
    assert scatter_linear(LINK, p, n) == pytest.approx(3 * (1e-5 + 1e-9 * n / 4))
    assert scatter_binomial(LINK, p, n) == pytest.approx(2 * 1e-5 + 1e-9 * n * 3 / 4)
    assert allgather_ring(LINK, p, n) == pytest.approx(3 * (1e-5 + 1e-9 * n / 4))
    assert allgather_recursive_doubling(LINK, p, n) == pytest.approx(2 * 1e-5 + 1e-9 * n * 3 / 4)
    assert allreduce_ring(LINK, p, n) == pytest.approx(6 * (1e-5 + 1e-9 * n / 4))
    assert allreduce_halving_doubling(LINK, p, n) == pytest.approx(4 * 1e-5 + 2e-9 * n * 3 / 4)
    assert allreduce_gloo(LINK, p, n) == allreduce_ring(LINK, p, n)  # gloo's own is its ring


def test_one_device_or_nothing_to_move_costs_nothing():
    for fn in (scatter_linear, scatter_binomial, allgather_ring, allreduce_ring, allreduce_halving_doubling):
        assert fn(LINK, 1, 1000) == 0.0 and fn(LINK, 8, 0) == 0.0


def test_cheapest_algorithm():
    # Both move the same bytes; halving/doubling needs log p latencies instead of p - 1.
    assert cost("allreduce", LINK, 16, 1 << 20)[1] == "halving_doubling"
    assert cost("scatter", LINK, 8, 1 << 20)[1] == "binomial"
    seconds, name = cost("gather", LINK, 4, 1 << 20, "linear")
    assert name == "linear" and seconds == pytest.approx(scatter_linear(LINK, 4, 1 << 20))
