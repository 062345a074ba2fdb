"""passes/optimizer_update.py: slot and scalar inputs, one step's numbers, and one update kernel per parameter."""
from __future__ import annotations

import numpy as np
import pytest

from tessel import ir
from tessel.ir.graph import Graph
from tessel.ir.interpret import interpret
from tessel.ir.types import TensorType
from tessel.passes.fuse import fuse, kernel_count
from tessel.passes.optimizer_update import (
    BIAS_CORRECTION2_SQRT, DECAY, GRAD_COEF, LR, STEP_SIZE, AdamWRule, OptimizerUpdates, SGDRule, add_updates,
)

SHAPES = {"fc.weight": (3, 4), "fc.bias": (3,)}


def _update_graph(rule) -> tuple[Graph, OptimizerUpdates]:
    """A graph whose inputs are parameters and their gradients ("<param>.grad") and whose outputs are the
    updated persistent values."""
    graph = Graph()
    params = {}
    for name, shape in SHAPES.items():
        param = graph.add_input(name, TensorType("float32", shape))
        params[name] = (param, graph.add_input(f"{name}.grad", TensorType("float32", shape)))
    updates = add_updates(graph, rule, params)
    graph.outputs = list(updates.next_values.values())
    ir.verify(graph)
    return graph, updates


def _run(graph: Graph, updates: OptimizerUpdates, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The next value of every persistent input, by the input's name."""
    outputs = interpret(graph, feeds)
    return {name: outputs[value.name] for name, value in updates.next_values.items()}


def test_sgd_slots_and_scalars():
    graph, updates = _update_graph(SGDRule(momentum=0.9, dampening=0.5))
    assert [v.name for v in updates.slot_inputs] == ["fc.weight.momentum", "fc.bias.momentum"]
    assert [v.name for v in updates.scalar_inputs] == [LR, GRAD_COEF]
    assert all(v.type == TensorType("float32", ()) for v in updates.scalar_inputs)
    assert list(updates.next_values) == ["fc.weight", "fc.weight.momentum", "fc.bias", "fc.bias.momentum"]
    assert all(not a.any() and a.shape == SHAPES[n.rsplit(".", 1)[0]] for n, a in updates.initial_slots().items())
    assert SGDRule().slots == () and SGDRule().scalars == (LR,)


def test_adamw_slots_and_scalars():
    _, updates = _update_graph(AdamWRule())
    assert [v.name for v in updates.slot_inputs] == ["fc.weight.exp_avg", "fc.weight.exp_avg_sq",
                                                     "fc.bias.exp_avg", "fc.bias.exp_avg_sq"]
    assert [v.name for v in updates.scalar_inputs] == [DECAY, STEP_SIZE, BIAS_CORRECTION2_SQRT]
    assert AdamWRule(weight_decay=0).scalars == (STEP_SIZE, BIAS_CORRECTION2_SQRT)


def _feeds(rng, updates: OptimizerUpdates) -> dict[str, np.ndarray]:
    feeds = {}
    for name, shape in SHAPES.items():
        feeds[name] = rng.standard_normal(shape).astype(np.float32)
        feeds[f"{name}.grad"] = rng.standard_normal(shape).astype(np.float32)
    for slot in updates.slot_inputs:
        feeds[slot.name] = np.abs(rng.standard_normal(slot.type.shape)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_step_numbers(nesterov):
    rule = SGDRule(momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    graph, updates = _update_graph(rule)
    feeds = _feeds(np.random.default_rng(0), updates)
    got = _run(graph, updates, {**feeds, LR: np.array(0.1, np.float32)})
    for name in SHAPES:
        grad = feeds[f"{name}.grad"] + 0.01 * feeds[name]
        buffer = 0.9 * feeds[f"{name}.momentum"] + grad
        direction = grad + 0.9 * buffer if nesterov else buffer
        np.testing.assert_allclose(got[f"{name}.momentum"], buffer, rtol=1e-6)
        np.testing.assert_allclose(got[name], feeds[name] - 0.1 * direction, rtol=1e-6)


def test_adamw_step_numbers():
    graph, updates = _update_graph(AdamWRule(beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.1))
    feeds = _feeds(np.random.default_rng(1), updates)
    scalars = {DECAY: np.array(0.99, np.float32), STEP_SIZE: np.array(0.5, np.float32),
               BIAS_CORRECTION2_SQRT: np.array(0.3, np.float32)}
    got = _run(graph, updates, {**feeds, **scalars})
    for name in SHAPES:
        grad, m, v = feeds[f"{name}.grad"], feeds[f"{name}.exp_avg"], feeds[f"{name}.exp_avg_sq"]
        m = 0.8 * m + 0.2 * grad
        v = 0.9 * v + 0.1 * grad * grad
        np.testing.assert_allclose(got[f"{name}.exp_avg"], m, rtol=1e-6)
        np.testing.assert_allclose(got[f"{name}.exp_avg_sq"], v, rtol=1e-6)
        np.testing.assert_allclose(got[name], feeds[name] * 0.99 - 0.5 * m / (np.sqrt(v) / 0.3 + 1e-3), rtol=1e-5)


@pytest.mark.parametrize("rule", [
    SGDRule(), SGDRule(weight_decay=0.1), SGDRule(momentum=0.9), SGDRule(momentum=0.9, nesterov=True),
    SGDRule(momentum=0.9, dampening=0.5, weight_decay=0.1), AdamWRule(), AdamWRule(weight_decay=0),
])
def test_one_update_kernel_per_parameter(rule):
    graph, _ = _update_graph(rule)
    fuse(graph)
    ir.verify(graph)
    assert kernel_count(graph) == len(SHAPES)
    op_type = "SGDUpdate" if isinstance(rule, SGDRule) else "AdamWUpdate"
    assert [n.op_type for n in graph.nodes] == [op_type] * len(SHAPES)


def test_scalar_names_must_be_free():
    graph = Graph()
    param = graph.add_input("w", TensorType("float32", (2,)))
    grad = graph.add_input(LR, TensorType("float32", (2,)))
    with pytest.raises(ValueError, match="already has a value named 'optim.lr'"):
        add_updates(graph, SGDRule(), {"w": (param, grad)})
