"""Micro-batch DP and cross-layer ILP against brute force."""
import itertools
import time

import pytest
from hypothesis import given, settings, strategies as st

from tessel.passes.algo_select import (AlgoSelectError, Candidate, Config, best_single, layer_pareto, micro_batch_sizes,
                                pareto, select_ilp)

ALGORITHMS = ("direct", "nchwc", "im2col")


def brute_force_front(batch, candidates, limit, policy):
    """(time, workspace) of the Pareto set over every multiset of pieces summing to the batch."""
    sizes = set(micro_batch_sizes(batch, policy))
    leaves = sorted(((c.batch, c.algorithm, c.seconds, c.workspace) for c in candidates
                     if c.batch in sizes and c.workspace <= limit))
    results = []

    def extend(start, remaining, seconds, workspace):
        if remaining == 0:
            results.append(Config((), seconds, workspace))
            return
        for index in range(start, len(leaves)):
            size, _, t, w = leaves[index]
            if size <= remaining:
                extend(index, remaining - size, seconds + t, max(workspace, w))

    extend(0, batch, 0, 0)
    return [(c.seconds, c.workspace) for c in pareto(results)]


@st.composite
def layers(draw):
    batch = draw(st.integers(1, 8))
    algorithms = ALGORITHMS[:draw(st.integers(1, 3))]
    candidates = [Candidate(a, b, draw(st.integers(1, 50)) * b + draw(st.integers(0, 20)), draw(st.integers(0, 40)) * b)
                  for a in algorithms for b in range(1, batch + 1)]
    return batch, candidates, draw(st.integers(0, 200)), draw(st.sampled_from(["undivided", "powers-of-two", "all"]))


@settings(max_examples=150, deadline=None)
@given(layers())
def test_dp_equals_brute_force(case):
    batch, candidates, limit, policy = case
    front = layer_pareto(batch, candidates, limit, policy)
    assert [(c.seconds, c.workspace) for c in front] == brute_force_front(batch, candidates, limit, policy)
    allowed = set(micro_batch_sizes(batch, policy))
    for config in front:
        assert sum(size for _, size in config.pieces) == batch
        assert all(size in allowed for _, size in config.pieces)
        assert config.workspace <= limit


def test_micro_batching_beats_the_best_single_algorithm_under_a_limit():
    # The fast algorithm's workspace grows with the batch: at 16 it does not fit, at 4 it does.
    # Every call also costs a fixed 0.5: more pieces than needed only add that.
    candidates = [Candidate("nchwc", b, 0.5 + 1.0 * b, 100 * b) for b in (1, 2, 4, 8, 16)]
    candidates += [Candidate("direct", b, 0.5 + 3.0 * b, 0) for b in (1, 2, 4, 8, 16)]
    single = best_single(16, candidates, limit=400)
    assert single.pieces == (("direct", 16),)
    best = layer_pareto(16, candidates, limit=400)[0]
    assert best.pieces == (("nchwc", 4),) * 4 and best.seconds == 18.0 and best.workspace == 400
    assert best.describe() == "nchwc 4+4+4+4"
    assert layer_pareto(16, candidates, limit=400, policy="undivided")[0] == single


def test_nothing_fits():
    assert layer_pareto(4, [Candidate("nchwc", b, 1.0, 10) for b in (1, 2, 4)], limit=5) == []
    assert best_single(4, [Candidate("nchwc", 4, 1.0, 10)], limit=5) is None


def test_unknown_policy():
    with pytest.raises(ValueError, match="powers-of-two"):
        micro_batch_sizes(4, "halves")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_ilp_equals_exhaustive_search(data):
    layer_count = data.draw(st.integers(1, 6))
    layers_ = [[Config((("a", 1),), data.draw(st.integers(1, 100)), data.draw(st.integers(0, 50)))
                for _ in range(data.draw(st.integers(1, 4)))] for _ in range(layer_count)]
    budget = data.draw(st.integers(0, 200))
    feasible = [(sum(c.seconds for c in combo), combo) for combo in itertools.product(*layers_)
                if sum(c.workspace for c in combo) <= budget]
    if not feasible:
        with pytest.raises(AlgoSelectError):
            select_ilp(layers_, budget)
        return
    result = select_ilp(layers_, budget)
    assert result.objective == pytest.approx(min(seconds for seconds, _ in feasible))
    assert result.workspace <= budget
    assert result.lp_bound <= result.objective + 1e-9
    assert 0 <= result.gap <= 1


def test_ilp_50_layers_by_20_configurations_under_a_second():
    import numpy as np

    rng = np.random.default_rng(0)
    layers_ = [[Config((("a", 1),), float(t), int(w)) for t, w in zip(rng.uniform(1, 10, 20), rng.integers(0, 1000, 20))]
               for _ in range(50)]
    started = time.perf_counter()
    result = select_ilp(layers_, budget=10_000)
    assert time.perf_counter() - started < 5  # the benchmark prints the time; the goal there is < 1 s
    assert result.workspace <= 10_000 and result.lp_bound <= result.objective + 1e-9
