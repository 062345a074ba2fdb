"""Pipeline schedules (passes/pipeline_schedule.py): GPipe and 1F1B orders, how many micro-batches each stage
holds, the bubble fraction, and the balanced stage cut against brute force."""
from __future__ import annotations

import itertools

import pytest

from tessel.passes.pipeline_schedule import (BACKWARD, FORWARD, balanced_cut, bubble_fraction, most_in_flight,
                                             stage_order)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 4), (4, 2), (3, 8), (2, 1)])
def test_every_stage_runs_each_forward_then_its_backward_once(schedule, stages, micro_batches):
    for stage in range(stages):
        order = stage_order(schedule, stages, micro_batches, stage)
        assert sorted(order) == sorted([(p, m) for p in (FORWARD, BACKWARD) for m in range(micro_batches)])
        assert [m for p, m in order if p == FORWARD] == list(range(micro_batches))
        assert [m for p, m in order if p == BACKWARD] == list(range(micro_batches))
        assert all(order.index((FORWARD, m)) < order.index((BACKWARD, m)) for m in range(micro_batches))


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert stage_order("gpipe", 2, 3, 1) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert most_in_flight(stage_order("gpipe", 4, 8, 0)) == 8


def test_one_f_one_b_warms_up_alternates_and_cools_down():
    assert stage_order("1f1b", 4, 6, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                            ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert stage_order("1f1b", 4, 6, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                                            ("B", 3), ("F", 4), ("B", 4), ("F", 5), ("B", 5)]


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 4), (4, 16), (8, 3)])
def test_one_f_one_b_holds_at_most_k_micro_batches(stages, micro_batches):
    held = [most_in_flight(stage_order("1f1b", stages, micro_batches, s)) for s in range(stages)]
    assert held == [min(stages - s, micro_batches) for s in range(stages)]
    assert max(held) <= stages


def test_bubble_fraction_and_refusals():
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        stage_order("zigzag", 2, 2, 0)


def _brute(costs, parts, marks):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = [0, *cuts, len(costs)]
        if not all(any(marks[a:b]) for a, b in zip(bounds, bounds[1:])):
            continue
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("costs, parts, marks", [
    ([1, 2, 3, 4, 5, 6], 2, None), ([5, 1, 1, 1, 1, 5], 3, None), ([0, 9, 0, 0, 1, 1], 3, [0, 1, 0, 1, 1, 1]),
    ([3, 3, 3, 3], 4, None), ([1, 0, 0, 0, 0, 7, 2], 2, [1, 0, 1, 0, 0, 1, 1]),
])
def test_balanced_cut_matches_brute_force(costs, parts, marks):
    marks = [bool(m) for m in marks] if marks else [True] * len(costs)
    bounds = balanced_cut(costs, parts, marks)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == parts + 1
    assert all(any(marks[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == _brute(costs, parts, marks)


def test_balanced_cut_refuses_too_few_marked_items():
    with pytest.raises(ValueError, match="cannot fill 3 stages"):
        balanced_cut([1.0, 1.0, 1.0], 3, [True, False, True])
