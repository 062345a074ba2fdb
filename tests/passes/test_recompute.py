"""Recomputation of activations (passes/recompute.py) on the step graphs of small PyTorch models: the rewritten
graph computes the same loss and gradients, its planned arena is lower and within the budget; an impossible
budget names the smallest peak; a generous one changes nothing."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.ir import verify
from tessel.ir.interpret import interpret
from tessel.passes.cse import cse
from tessel.passes.recompute import COPY_SUFFIX, RecomputeError, _cheap, apply_recompute, plan_cheap_recompute
from tests.passes.torch_steps import MODELS, Step


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_recomputed_step_gives_the_same_loss_and_gradients_within_the_budget(kind):
    step = Step(kind)
    before = step.arena()
    expected = interpret(step.graph, step.feeds)
    budget = int(0.9 * before)
    plan = step.plan(budget)
    assert plan.dropped and plan.copies
    assert plan.peak_before == before and plan.bound_after <= plan.peak_after <= budget < before
    assert plan.floor_bytes <= plan.peak_after and plan.extra_flops > 0

    result = apply_recompute(step.graph, plan, persistent=step.state)
    verify(step.graph)
    assert result.changed and result.stats == {"values_recomputed": len(plan.dropped),
                                                "nodes_copied": len(plan.copies)}
    assert step.arena() == plan.peak_after  # the prediction is the plan of the rewritten graph
    got = interpret(step.graph, step.feeds)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_copies_run_late_just_before_their_first_backward_reader():
    step = Step("cnn")
    loss = step.graph.outputs[0].producer
    plan = step.plan(int(0.9 * step.arena()))
    apply_recompute(step.graph, plan, persistent=step.state)
    nodes = step.graph.nodes
    position = {id(n): i for i, n in enumerate(nodes)}
    copies = [n for n in nodes if n.name.endswith(COPY_SUFFIX)]
    assert len(copies) == len(plan.copies)
    for copy in copies:
        assert position[id(copy)] > position[id(loss)]
        # Only copies sit between a copy and the backward node it was made for.
        reader = next(n for n in nodes[position[id(copy)]:] if not n.name.endswith(COPY_SUFFIX))
        assert any(v is not None and v.name.endswith(COPY_SUFFIX) for v in reader.inputs)
    for name in plan.dropped:
        value = step.graph.lookup(name)
        assert all(position[id(n)] <= position[id(loss)] for n, _ in value.uses)


def test_cse_after_recompute_merges_the_copies_back():
    """Why the pipeline runs recompute after CSE (compiler/recompute.place_recompute)."""
    step = Step("cnn")
    cse(step.graph)  # the step as the pipeline has it: a BatchStats gradient's x - mean merged with the forward's
    before = step.arena()
    apply_recompute(step.graph, step.plan(int(0.9 * before)), persistent=step.state)
    cse(step.graph)
    assert not any(n.name.endswith(COPY_SUFFIX) for n in step.graph.nodes)
    assert abs(step.arena() - before) <= 64  # back to the step's, up to where one aligned scalar lands


def test_budget_out_of_reach_names_the_smallest_reachable_peak():
    step = Step("cnn")
    before = step.arena()
    floor = step.plan(int(0.9 * before)).floor_bytes
    with pytest.raises(RecomputeError, match=r"brings them down to .* at best \(estimated\), over the budget") as info:
        step.plan(floor - 1)
    assert info.value.floor_bytes == floor < before and info.value.budget_bytes == floor - 1
    assert f"{floor / 1024:.1f} KiB at best" in str(info.value)


def test_generous_budget_changes_nothing():
    step = Step("mlp")
    before = step.arena()
    nodes = [n.name for n in step.graph.nodes]
    plan = step.plan(2 * before)
    assert plan.dropped == () and plan.copies == () and plan.peak_after == plan.peak_before == before
    assert plan.extra_flops == 0 and plan.summary().startswith("recompute: nothing to recompute")
    assert apply_recompute(step.graph, plan, persistent=step.state).changed is False
    assert [n.name for n in step.graph.nodes] == nodes


def test_plan_report_marks_predictions_estimated():
    step = Step("mlp")
    report = step.plan(int(0.9 * step.arena())).to_json()
    assert report["peak"]["source"] == report["flops"]["source"] == "estimated"
    assert report["peak"]["after_bytes"] <= report["budget_bytes"] < report["peak"]["before_bytes"]


def test_cheap_recompute_makes_relu_outputs_again_from_what_batchnorm_keeps_and_lowers_the_peak():
    """Whatever the budget: a ReLU after BatchNormalization is made again from what BN's backward keeps, by
    elementwise copies only; the step computes the same and its planned arena goes down."""
    step = Step("cnn")
    before = step.arena()
    expected = interpret(step.graph, step.feeds)
    plan = plan_cheap_recompute(step.graph, persistent=step.state)
    assert any("Relu" in name for name in plan.dropped)
    assert plan.peak_after < plan.peak_before
    result = apply_recompute(step.graph, plan, persistent=step.state)
    assert result.changed
    copies = [n for n in step.graph.nodes if n.name.endswith(COPY_SUFFIX)]
    assert copies and all(n.op_type not in ("Conv", "Gemm", "MatMul") for n in copies)
    assert step.arena() < before
    got = interpret(step.graph, step.feeds)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_downsampling_pool_is_not_cheap_to_make_again():
    """A 3x3 stride-2 MaxPool reads 4x the bytes its output would save: the cheap policy keeps its output (in
    this small step no plan drops it anyway; in ResNet-18's it did), while the ReLU and BatchNormalization
    nodes before it, one pass over as many bytes as they make, stay cheap."""
    step = Step("pool")
    kinds = {n.op_type: n for n in step.graph.nodes}
    assert not _cheap(kinds["MaxPool"])
    assert _cheap(kinds["Relu"]) and _cheap(kinds["Add"])
    plan = plan_cheap_recompute(step.graph, persistent=step.state)
    assert not any(step.graph.lookup(name).producer.op_type == "MaxPool" for name in plan.dropped)


def test_cheap_recompute_leaves_a_step_without_cheap_copies_alone():
    """In the MLP every stashed value comes from a matmul (or from a matmul through a ReLU): nothing is cheap to
    make again."""
    step = Step("mlp")
    plan = plan_cheap_recompute(step.graph, persistent=step.state)
    assert plan.dropped == () and plan.peak_after == plan.peak_before
