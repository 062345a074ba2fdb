"""Recomputation of activations (passes/recompute.py) on the step graphs of small PyTorch models: the rewritten
graph computes the same loss and gradients, its planned arena is lower and within the budget; an impossible
budget names the smallest peak; a generous one changes nothing."""
from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tessel.ir import from_onnx, verify  # noqa: E402
from tessel.ir.graph import Graph  # noqa: E402
from tessel.ir.interpret import interpret  # noqa: E402
from tessel.passes.autodiff import differentiate  # noqa: E402
from tessel.passes.base import add_op  # noqa: E402
from tessel.passes.cse import cse  # noqa: E402
from tessel.passes.graph_memory import plan_graph_memory  # noqa: E402
from tessel.passes.recompute import COPY_SUFFIX, RecomputeError, apply_recompute, plan_recompute  # noqa: E402
from tessel.passes.training_mode import prepare_training  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        hidden = [layer for k in range(6) for layer in (torch.nn.Tanh() if k % 2 else torch.nn.ReLU(),
                                                         torch.nn.Linear(64, 64))]
        self.layers = torch.nn.Sequential(torch.nn.Linear(32, 64), *hidden, torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.layers(x)


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2, self.b2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c3 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        x = torch.relu(self.c3(x))
        return self.fc(x.flatten(1))


MODELS = {"mlp": (MLP, (128, 32)), "cnn": (CNN, (4, 1, 8, 8))}
_EXPORTED: dict[str, bytes] = {}


def exported(kind: str) -> bytes:
    """The model as ONNX (exported once per test session)."""
    if kind not in _EXPORTED:
        make, shape = MODELS[kind]
        torch.manual_seed(0)
        buffer = io.BytesIO()
        torch.onnx.export(make().eval(), (torch.randn(*shape),), buffer, dynamo=False, do_constant_folding=False,
                          input_names=["x"], output_names=["y"])
        _EXPORTED[kind] = buffer.getvalue()
    return _EXPORTED[kind]


class Step:
    """A step graph built with the passes: training import, ReduceMean of the output as the loss, autodiff."""

    def __init__(self, kind: str):
        self.graph: Graph = from_onnx(exported(kind), training=True)
        model = prepare_training(self.graph)
        self.state = model.state
        output = self.graph.lookup(model.model_outputs[0])
        loss = add_op(self.graph, "ReduceMean", [output], {"keepdims": 0}).outputs[0]
        grads = differentiate(self.graph, loss, [self.graph.lookup(p) for p in model.parameters])
        self.graph.outputs = [loss, *grads.values()] + [v for v in self.graph.outputs if v.name.endswith("__next")]
        rng = np.random.default_rng(1)
        self.feeds = {v.name: model.state[v.name] if v.name in model.state
                      else rng.standard_normal(v.type.shape).astype(np.float32) for v in self.graph.inputs}

    def arena(self) -> int:
        return plan_graph_memory(self.graph, self.state).arena_bytes

    def plan(self, budget: int):
        return plan_recompute(self.graph, budget, persistent=self.state)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_recomputed_step_gives_the_same_loss_and_gradients_within_the_budget(kind):
    step = Step(kind)
    before = step.arena()
    expected = interpret(step.graph, step.feeds)
    budget = int(0.8 * before)
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
    plan = step.plan(int(0.8 * step.arena()))
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
    before = step.arena()
    apply_recompute(step.graph, step.plan(int(0.8 * before)), persistent=step.state)
    cse(step.graph)
    assert not any(n.name.endswith(COPY_SUFFIX) for n in step.graph.nodes)
    assert step.arena() == before


def test_budget_out_of_reach_names_the_smallest_reachable_peak():
    step = Step("cnn")
    before = step.arena()
    floor = step.plan(int(0.8 * before)).floor_bytes
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
    report = step.plan(int(0.8 * step.arena())).to_json()
    assert report["peak"]["source"] == report["flops"]["source"] == "estimated"
    assert report["peak"]["after_bytes"] <= report["budget_bytes"] < report["peak"]["before_bytes"]
