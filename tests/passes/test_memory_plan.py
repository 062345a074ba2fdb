"""Memory planning: lifetimes, views, in-place reuse, offsets against the bound, and the arena at run time."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessel import ir
from tessel.backends.target import parse_target
from tessel.compiler.api import compile
from tessel.compiler.memory import plan_program_memory
from tessel.compiler.pipeline import run_pipeline
from tessel.compiler.program import build_program
from tessel.passes.memory_plan import STRATEGIES, Storage, StepUse, plan_memory
from tests.conftest import POSITIVE, by_name

MIB = 1 << 20


def _chain(inplace: bool):
    steps = [StepUse("a", "Conv", ("x",), ("a",)), StepUse("b", "Relu", ("a",), ("b",), inplace=(("b", "a"),)),
             StepUse("c", "Reshape", ("b",), ("c",), views=(("c", "b"),)), StepUse("d", "Conv", ("c",), ("y",))]
    sizes = {"x": MIB, "a": MIB, "b": MIB, "c": MIB, "y": MIB}
    return plan_memory(steps, sizes, inputs=["x"], outputs=["y"], inplace=inplace)


def test_chain_reuses_memory_views_share_and_relu_runs_in_place():
    plan = _chain(inplace=True)
    assert plan.inplace == [("b", "a")]
    assert plan.offsets["a"] == plan.offsets["b"] == plan.offsets["c"]
    # x and a are live together at step 0; the view c and y at step 3: two megabytes suffice.
    assert plan.arena_bytes == plan.bound_bytes == 2 * MIB
    assert plan.no_reuse_bytes == 4 * MIB


def test_without_inplace_the_relu_needs_its_own_buffer():
    plan = _chain(inplace=False)
    assert plan.inplace == [] and plan.offsets["a"] != plan.offsets["b"]
    assert plan.bound_bytes == plan.arena_bytes == 2 * MIB


def test_inplace_does_not_fire_when_the_input_is_read_later():
    steps = [StepUse("r", "Relu", ("x",), ("a",), inplace=(("a", "x"),)), StepUse("s", "Add", ("a", "x"), ("y",))]
    plan = plan_memory(steps, {"x": 64, "a": 64, "y": 64}, inputs=["x"], outputs=["y"])
    assert plan.inplace == [] and plan.offsets["a"] != plan.offsets["x"]


@st.composite
def _lifetimes(draw):
    count = draw(st.integers(1, 40))
    storages = []
    for k in range(count):
        start = draw(st.integers(-1, 30))  # -1: a model input, live before the first step
        end = draw(st.integers(start, 31))
        storages.append(Storage((f"t{k}",), 64 * draw(st.integers(1, 64)), start, end))
    return storages


@settings(max_examples=200, deadline=None)
@given(_lifetimes())
def test_no_two_live_tensors_overlap(storages):
    for name, strategy in STRATEGIES.items():
        placed = strategy(storages)
        assert sorted(s.values for s in placed) == sorted(s.values for s in storages), name
        for i, a in enumerate(placed):
            assert a.offset % 64 == 0
            for b in placed[i + 1:]:
                if a.start <= b.end and b.start <= a.end:
                    assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset, (name, a, b)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(1, 50)), min_size=1, max_size=30))
def test_plan_from_random_schedules_is_sound(edges):
    """Random programs: each step reads two earlier values; the plan never overlaps live values."""
    steps, sizes = [], {"x": 256}
    names = ["x"]
    for k, (a, b, size) in enumerate(edges):
        out = f"v{k}"
        reads = (names[a % len(names)], names[b % len(names)])
        steps.append(StepUse(out, "Add", reads, (out,), inplace=((out, reads[0]),)))
        sizes[out] = 64 * size
        names.append(out)
    plan = plan_memory(steps, {n: sizes[n] for n in names}, inputs=["x"], outputs=[names[-1]])
    assert plan.arena_bytes >= plan.bound_bytes
    live = {}
    for s in plan.storages:
        for t in range(max(s.start, 0), s.end + 1):
            live.setdefault(t, []).append(s)
    for group in live.values():
        spans = sorted((s.offset, s.offset + s.nbytes) for s in group)
        assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))
    # Values sharing bytes may touch only at an in-place step: one is last read where the other is written.
    first = {"x": -1, **{s.writes[0]: t for t, s in enumerate(steps)}}
    final = {n: max([t for t, s in enumerate(steps) if n in s.reads] + [first[n]]) for n in names}
    final[names[-1]] = len(steps)
    for i, u in enumerate(names):
        for v in names[i + 1:]:
            a, b = (plan.offsets[u], plan.offsets[u] + sizes[u]), (plan.offsets[v], plan.offsets[v] + sizes[v])
            if a[0] < b[1] and b[0] < a[1]:
                assert final[u] <= first[v] or final[v] <= first[u], (u, v)


@pytest.mark.parametrize("model", by_name(POSITIVE))
def test_corpus_arena_is_within_ten_percent_of_the_bound(model):
    graph, _ = run_pipeline(ir.from_onnx(str(model.path), model.input_shapes))
    plan = plan_program_memory(build_program(graph, parse_target("llvm")), "llvm")
    assert plan.ratio <= 1.10, f"{model.name}: arena {plan.arena_bytes}, bound {plan.bound_bytes}"
    assert plan.arena_bytes < plan.no_reuse_bytes or plan.no_reuse_bytes <= plan.bound_bytes


def test_repeated_runs_allocate_no_activation_memory(kernel_cache):
    model = next(m for m in POSITIVE if m.name == "resnet18")
    artifact = compile(model.path, input_shapes=model.input_shapes, cache_dir=kernel_cache)
    feeds = model.make_inputs()
    artifact.run(feeds)
    output_bytes = sum(a.nbytes for a in artifact.run(feeds).values())
    tracemalloc.start()
    try:
        for _ in range(3):
            artifact.run(feeds)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Each run allocates only its fresh output arrays (and small Python objects), never activations.
    activations = artifact.report()["memory"]["arena_bytes"]
    assert peak < output_bytes + 64 * 1024 < activations


def test_device_memory_too_small_fails_with_the_peak(kernel_cache):
    model = next(m for m in POSITIVE if m.name == "mtcnn_onet")
    from tessel.compiler.api import CompileError

    with pytest.raises(CompileError, match=r"missing; the activation peak is at node '.*' \(.*\) with '.*'"):
        compile(model.path, input_shapes=model.input_shapes, cache_dir=kernel_cache, device_memory="64KiB")
    artifact = compile(model.path, input_shapes=model.input_shapes, cache_dir=kernel_cache, device_memory="64MiB")
    reports = artifact.directory / "reports"
    assert (reports / "memory.json").is_file() and (reports / "memory.md").is_file()
    assert (reports / "memory_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.isclose(artifact.report()["memory"]["ratio"], 1.0, atol=0.1)


def test_an_output_reuses_at_most_one_dying_input():
    # x * sigmoid(x): both inputs of the Mul die there, but they are distinct live buffers.
    steps = [StepUse("conv", "Conv", ("x",), ("c",)), StepUse("sig", "Sigmoid", ("c",), ("s",), inplace=(("s", "c"),)),
             StepUse("mul", "Mul", ("c", "s"), ("y",), inplace=(("y", "c"), ("y", "s")))]
    plan = plan_memory(steps, {n: 576 for n in "xcsy"}, inputs=["x"], outputs=["y"])
    assert plan.inplace == [("y", "c")] and plan.offsets["c"] != plan.offsets["s"]
