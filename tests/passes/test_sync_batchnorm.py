"""Synchronised BatchNorm in a data-parallel replica's step (passes/training_mode.py with sync_replicas) and the
gradient rule of AllReduce (passes/gradients/collectives.py), on the IR interpreter in float64: one replica
(an AllReduce over one worker is its input) against finite differences, and several replicas simulated by
ir/interpret.interpret_replicas (one interpreter thread each, their AllReduces meeting)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import tessel
from tessel.compiler.training import build_step_graph
from tessel.ir.graph import Graph
from tessel.ir.interpret import interpret_replicas
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.types import TensorType
from tessel.passes.autodiff import MissingGradientError, differentiate
from tessel.passes.base import add_op
from tests.ir.helpers import F, model
from tests.passes.gradcheck import check_gradients

BATCH, CHANNELS = 8, 4
CLASSES = CHANNELS


# ---- the gradient rule -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_all_reduce_on_one_replica_against_finite_differences(reduction):
    x = np.random.default_rng(0).standard_normal((2, 3))
    check_gradients("AllReduce", {"x": x}, {"reduction": reduction}, domain=TESSEL_DOMAIN)


def _weighted_all_reduce(reduction: str) -> tuple[Graph, list]:
    """loss = sum(AllReduce(x * x) * w), so each replica's loss depends on every replica's x."""
    graph = Graph()
    x = graph.add_input("x", TensorType("float32", (2, 3)))
    squared = add_op(graph, "Mul", [x, x]).outputs[0]
    reduced = add_op(graph, "AllReduce", [squared], {"reduction": reduction}, domain=TESSEL_DOMAIN).outputs[0]
    weights = graph.add_constant("w", np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5)
    weighted = add_op(graph, "Mul", [reduced, weights]).outputs[0]
    loss = add_op(graph, "ReduceSum", [weighted], {"keepdims": 0}).outputs[0]
    graph.outputs = [loss]
    return graph, [loss, x]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_all_reduce_gradient_over_simulated_replicas_is_that_of_the_replicas_losses_summed(reduction):
    """Three replicas: replica r's gradient of x_r equals d(loss_0 + loss_1 + loss_2)/dx_r by central differences."""
    graph, (loss, x) = _weighted_all_reduce(reduction)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((2, 3))} for _ in range(3)]
    grads = differentiate(graph, loss, [x])
    graph.outputs = [loss, grads["x"]]
    got = interpret_replicas(graph, feeds)

    def total(moved: list[dict]) -> float:
        return sum(float(out[loss.name]) for out in interpret_replicas(graph, moved))

    eps = 1e-6
    for rank in range(len(feeds)):
        expected = np.zeros((2, 3))
        for index in np.ndindex(2, 3):
            values = []
            for sign in (1.0, -1.0):
                moved = [dict(feed) for feed in feeds]
                moved[rank] = {"x": feeds[rank]["x"].copy()}
                moved[rank]["x"][index] += sign * eps
                values.append(total(moved))
            expected[index] = (values[0] - values[1]) / (2 * eps)
        np.testing.assert_allclose(got[rank][grads["x"].name], expected, rtol=1e-6, atol=1e-8)


def test_max_all_reduce_has_no_gradient_rule():
    graph = Graph()
    x = graph.add_input("x", TensorType("float32", (3,)))
    top = add_op(graph, "AllReduce", [x], {"reduction": "max"}, domain=TESSEL_DOMAIN).outputs[0]
    loss = add_op(graph, "ReduceSum", [top], {"keepdims": 0}).outputs[0]
    with pytest.raises(MissingGradientError, match=r"AllReduce \(reduction 'max'\)"):
        differentiate(graph, loss, [x])


# ---- synchronised BatchNorm in the step graph ------------------------------------------------------------------
def conv_bn_model(batch: int) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> global average pool: a CNN with BN whose channels are the class
    logits, as ONNX (few kernels to compile)."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "conv_w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["n"]),
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["y"]),
    ]
    initializers = [("conv_w", rng.standard_normal((CHANNELS, 2, 3, 3)).astype(np.float32) * 0.5),
                    ("bn_scale", 1 + 0.1 * rng.standard_normal(CHANNELS).astype(np.float32)),
                    ("bn_bias", 0.1 * rng.standard_normal(CHANNELS).astype(np.float32)),
                    ("bn_mean", np.zeros(CHANNELS, np.float32)), ("bn_var", np.ones(CHANNELS, np.float32))]
    return model(nodes, [("x", F, [batch, 2, 5, 5])], [("y", F, [batch, CLASSES])], initializers)


def input_batch(rng, batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """conv_bn_model's input (float64) and class labels; a per-channel offset larger than the spread, where the
    statistics must be the whole batch's to agree."""
    x = rng.standard_normal((batch, 2, 5, 5)) + np.array([3.0, -2.0]).reshape(1, 2, 1, 1)
    return x, rng.integers(0, CLASSES, batch)


def _step_graph(batch: int, replicas: int = 1, sync: bool = False):
    return build_step_graph(conv_bn_model(batch), {"x": (batch, 2, 5, 5)}, "cross_entropy",
                            tessel.optim.SGD(lr=0.1, momentum=0.9), replicas=replicas, sync_batchnorm=sync)


def _train(step, replicas: int, batches) -> tuple[list[float], list[dict[str, np.ndarray]]]:
    """Run the step graph's steps in float64 (`replicas` simulated, each on its slice): rank 0's losses and every
    replica's state."""
    optimizer = tessel.optim.SGD(lr=0.1, momentum=0.9)
    state = [{name: value.astype(np.float64) for name, value in step.state.items()} for _ in range(replicas)]
    losses = []
    for t, (x, labels) in enumerate(batches):
        part = len(x) // replicas
        feeds = [{**state[r], "x": x[r * part:(r + 1) * part], step.label_input: labels[r * part:(r + 1) * part],
                  **optimizer.step_scalars(t)} for r in range(replicas)]
        outputs = interpret_replicas(step.graph, feeds)
        losses.append(float(outputs[0][step.loss_output]))
        state = [{name: out[step.state_updates.get(name, name)] if name in step.state_updates else state[r][name]
                  for name in state[r]} for r, out in enumerate(outputs)]
    return losses, state


def test_synchronised_batchnorm_replicas_train_as_one_device_on_the_whole_batch():
    """Two simulated replicas with synchronised BN, 3 SGD-momentum steps in float64: losses, weights and BN
    running statistics (the unbiased variance over the whole batch's count) equal one device's to 1e-10."""
    rng = np.random.default_rng(3)
    batches = [input_batch(rng) for _ in range(3)]
    want_losses, [want] = _train(_step_graph(BATCH), 1, batches)
    got_losses, replicas = _train(_step_graph(BATCH // 2, replicas=2, sync=True), 2, batches)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-10)
    for got in replicas:
        assert set(got) == set(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
    # Per-replica statistics (the default) do not: each half normalises with its own mean and variance.
    _, apart = _train(_step_graph(BATCH // 2, replicas=2), 2, batches)
    assert not np.allclose(apart[0]["bn_var"], want["bn_var"], rtol=1e-3)
    assert not np.allclose(apart[0]["bn_mean"], apart[1]["bn_mean"], rtol=1e-3)


def test_synchronised_batchnorm_all_reduces_the_mean_and_the_variance_forward_and_back():
    step = _step_graph(BATCH // 2, replicas=2, sync=True)
    plain = _step_graph(BATCH // 2, replicas=2)
    reduces = [node for node in step.graph.nodes if node.op_type == "AllReduce"]
    extra = len(reduces) - sum(node.op_type == "AllReduce" for node in plain.graph.nodes)
    assert extra == 4  # the batch mean and variance, and their gradients
    forward = [node for node in reduces if node.inputs[0].producer.op_type == "ReduceMean"]
    assert len(forward) == 2 and all(node.attrs["reduction"] == "mean" for node in reduces)
