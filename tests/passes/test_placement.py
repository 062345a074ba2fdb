"""Placement planners: bounds, memory limits, pins, auto, and speed on a large synthetic DAG."""
from __future__ import annotations

import itertools
import random
import time

import pytest

from tessel.passes.machine import Link, Machine, Task
from tessel.passes.placement import PlacementError, lower_bound, place, simulate

LINK = Link(alpha=1e-4, beta=1e-9)


def _chain(n: int, seconds: float = 1e-3, nbytes: int = 1000, weights: int = 10) -> list[Task]:
    return [Task(f"t{i}", "Conv", seconds, weights, nbytes, ((f"t{i - 1}", nbytes),) if i else ()) for i in range(n)]


def _diamond_fan(width: int) -> list[Task]:
    tasks = [Task("src", "Conv", 1e-3, 0, 100)]
    tasks += [Task(f"b{k}", "Conv", 5e-3, 0, 100, (("src", 100),)) for k in range(width)]
    tasks.append(Task("sink", "Concat", 1e-3, 0, 100, tuple((f"b{k}", 100) for k in range(width))))
    return tasks


def test_every_plan_respects_its_bound_and_simulation():
    tasks = _diamond_fan(4)
    machine = Machine((1 << 30,) * 4, LINK)
    for planner in ("single", "pipeline", "list"):
        plan = place(tasks, machine, planner)
        assert plan.makespan >= plan.bound * (1 - 1e-9)
        start, finish = simulate(tasks, plan.device, LINK)
        assert plan.finish == finish and plan.start == start
    assert place(tasks, machine, "list").makespan < place(tasks, machine, "single").makespan


def test_list_scheduling_is_optimal_on_independent_branches_with_free_links():
    tasks = _diamond_fan(4)
    plan = place(tasks, Machine((1 << 30,) * 4, Link(0.0, 0.0)), "list")
    assert plan.makespan == pytest.approx(lower_bound(tasks, 4)) == pytest.approx(7e-3)


def test_pipeline_stages_are_contiguous_and_balanced():
    tasks = _chain(12)
    plan = place(tasks, Machine((1 << 30,) * 3, Link(0.0, 0.0)), "pipeline", microbatches=4)
    devices = [plan.device[t.name] for t in tasks]
    assert devices == sorted(devices) and set(devices) == {0, 1, 2}
    assert max(plan.busy_seconds) == pytest.approx(4e-3)
    # Four micro-batches: fill the pipeline once (12 ms), then one every 4 ms.
    assert plan.makespan == pytest.approx(12e-3 + 3 * 4e-3)


def test_pipeline_matches_exhaustive_search_on_small_chains():
    rng = random.Random(0)
    for _ in range(20):
        tasks = [Task(f"t{i}", "Op", rng.uniform(1e-4, 1e-3), 0, 0, ((f"t{i - 1}", 0),) if i else ()) for i in range(7)]
        plan = place(tasks, Machine((1 << 30,) * 3, Link(0.0, 0.0)), "pipeline")
        best = min(max(sum(t.seconds for t in tasks[a:b]) for a, b in zip((0, *cuts), (*cuts, 7)))
                   for cuts in itertools.combinations(range(1, 7), 2))
        assert max(plan.busy_seconds) == pytest.approx(best, rel=1e-5)


def test_memory_limits_and_pins():
    tasks = _chain(6, weights=400)
    machine = Machine((1000, 1000, 1000), LINK)
    plan = place(tasks, machine, "pipeline")
    for d in range(3):
        assert sum(400 for t in tasks if plan.device[t.name] == d) <= 1000
    with pytest.raises(PlacementError, match="memory"):
        place(tasks, Machine((500, 500, 500), LINK), "pipeline")
    pinned = place(tasks, Machine((1 << 30,) * 3, LINK), "list", pins=["t[0-2]=2"])
    assert all(pinned.device[f"t{i}"] == 2 for i in range(3))
    with pytest.raises(PlacementError, match="REGEX=DEVICE"):
        place(tasks, machine, "list", pins=["t0"])


def test_auto_picks_the_best_prediction():
    tasks = _diamond_fan(3)
    machine = Machine((1 << 30,) * 3, LINK)
    auto = place(tasks, machine, "auto")
    assert auto.makespan == min(place(tasks, machine, p).makespan for p in ("single", "pipeline", "list"))


def test_ten_thousand_nodes_on_64_devices_in_under_ten_seconds():
    rng = random.Random(1)
    tasks = []
    for i in range(10_000):
        preds = rng.sample(range(max(0, i - 64), i), min(i, rng.randint(1, 3)))
        tasks.append(Task(f"t{i}", "Op", rng.uniform(1e-5, 1e-3), rng.randint(0, 1 << 20), 1 << 16,
                          tuple((f"t{p}", rng.randint(1 << 10, 1 << 20)) for p in preds)))
    machine = Machine((1 << 36,) * 64, LINK)
    started = time.perf_counter()
    plan = place(tasks, machine, "auto")
    elapsed = time.perf_counter() - started
    print(f"10,000 tasks on 64 devices: {elapsed:.2f} s, {plan.planner}, makespan/bound {plan.quality:.2f}")
    assert elapsed < 10 and plan.makespan >= plan.bound * (1 - 1e-9)


def test_data_placement_divides_the_work_and_pays_the_scatter_and_gather():
    from tessel.passes.collectives import scatter_linear

    tasks = _chain(10, seconds=4e-3)
    link = Link(alpha=1e-4, beta=1e-9)
    machine = Machine((1 << 30,) * 4, link)
    plan = place(tasks, machine, "data", batch=8, io_bytes=(4_000_000, 4000))
    compute = sum(t.seconds for t in tasks) / 4
    expected = compute + scatter_linear(link, 4, 4_000_000) + scatter_linear(link, 4, 4000)
    assert plan.planner == "data" and plan.replicated
    assert plan.makespan == pytest.approx(expected) and plan.bound == pytest.approx(compute)
    assert plan.makespan >= plan.bound
    # A chain cannot spread over devices any other way: auto takes the data plan when the batch splits.
    assert place(tasks, machine, "auto", batch=8, io_bytes=(4_000_000, 4000)).planner == "data"
    assert place(tasks, machine, "auto", batch=6, io_bytes=(4_000_000, 4000)).planner != "data"


def test_data_placement_refuses_what_it_cannot_do():
    tasks = _chain(4, nbytes=100)
    machine = Machine((1 << 30,) * 2, Link(1e-5, 1e-9))
    with pytest.raises(PlacementError, match="not a multiple"):
        place(tasks, machine, "data", batch=3)
    with pytest.raises(PlacementError, match="micro"):
        place(tasks, machine, "data", batch=4, microbatches=2)
    with pytest.raises(PlacementError, match="--pin"):
        place(tasks, machine, "data", pins=["t0=1"], batch=4)
    small = Machine((10,) * 2, Link(1e-5, 1e-9))
    heavy = [Task(t.name, t.op, t.seconds, 100, t.output_bytes, t.inputs) for t in tasks]
    with pytest.raises(PlacementError, match="every weight on every device"):
        place(heavy, small, "data", batch=4)


def test_hybrid_keeps_a_heavy_tail_on_one_device_when_replicas_do_not_fit():
    from tessel.passes.collectives import scatter_linear

    link = Link(alpha=1e-4, beta=1e-9)
    # Eight light "convolutions", then a fully-connected tail with most of the weights.
    tasks = _chain(10, seconds=4e-3, weights=10)
    tasks[-1] = Task(tasks[-1].name, "Gemm", 1e-3, 900, 100, tasks[-1].inputs)
    cuts = {i: 1000 for i in range(1, 10)}
    roomy = Machine((2000, 2000), link)
    assert place(tasks, roomy, "auto", batch=8, io_bytes=(8000, 100), cuts=cuts).planner == "data"
    # Device 1 cannot hold the tail's weights: data placement is out, the hybrid keeps the tail on device 0.
    tight = Machine((2000, 500), link)
    plan = place(tasks, tight, "auto", batch=8, io_bytes=(8000, 100), cuts=cuts)
    assert plan.planner == "hybrid" and plan.cut == 9
    head = sum(t.seconds for t in tasks[:9]) / 2
    expected = scatter_linear(link, 2, 8000) + head + scatter_linear(link, 2, 1000) + tasks[-1].seconds
    assert plan.makespan == pytest.approx(expected) and plan.makespan >= plan.bound
    with pytest.raises(PlacementError, match="no cut"):
        place(tasks, tight, "hybrid", batch=8, io_bytes=(8000, 100), cuts={})
