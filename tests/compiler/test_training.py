"""compiler/training.py: the one-graph training step of a tiny MLP exported from PyTorch, interpreted in
float32, gives PyTorch's losses and updated weights over 3 steps of SGD with momentum and of AdamW."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessel import ir, optim
from tessel.compiler.training import StepGraph, build_step_graph
from tessel.ir.interpret import interpret
from tessel.passes.loss import LossError

# The legacy exporter (the one that keeps BatchNormalization unfolded) warns that it is legacy.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")

BATCH, FEATURES, HIDDEN, CLASSES = 6, 5, 7, 3
STEPS = 3


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _export(module: torch.nn.Module, mode=torch.onnx.TrainingMode.EVAL) -> bytes:
    buffer = io.BytesIO()
    module.train(mode == torch.onnx.TrainingMode.TRAINING)
    torch.onnx.export(module, (torch.zeros(BATCH, FEATURES),), buffer, dynamo=False, training=mode,
                      do_constant_folding=False, input_names=["x"], output_names=["logits"])
    return buffer.getvalue()


@pytest.fixture(scope="module")
def mlp() -> tuple[MLP, bytes]:
    torch.manual_seed(0)
    module = MLP()
    return module, _export(module)


def _batches(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, BATCH).astype(np.int64)) for _ in range(STEPS)]


def _run_steps(step: StepGraph, optimizer, batches) -> tuple[list[float], dict[str, np.ndarray]]:
    """Interpret the step graph `STEPS` times, feeding state back; the losses and the final state."""
    state = dict(step.state)
    losses = []
    for t, (x, labels) in enumerate(batches):
        feeds = {**state, step.data_inputs[0]: x, step.label_input: labels, **optimizer.step_scalars(t)}
        outputs = interpret(step.graph, feeds)
        losses.append(float(outputs[step.loss_output]))
        state.update({name: outputs[out] for name, out in step.state_updates.items()})
    return losses, state


@pytest.mark.parametrize("make", [
    lambda: (optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
             lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
    lambda: (optim.AdamW(lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)),
], ids=["sgd_momentum", "adamw"])
def test_steps_match_torch(mlp, make):
    module, onnx_bytes = mlp
    optimizer, make_torch = make()
    step = build_step_graph(onnx_bytes, None, "cross_entropy", optimizer)
    assert step.data_inputs == ["x"] and step.label_input == "labels" and step.model_outputs == ["logits"]
    assert set(step.parameters) == {name for name, _ in module.named_parameters()}
    batches = _batches()
    losses, state = _run_steps(step, optimizer, batches)

    reference = MLP()
    reference.load_state_dict(module.state_dict())
    torch_optimizer = make_torch(reference.parameters())
    want = []
    for x, labels in batches:
        torch_optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(labels))
        loss.backward()
        torch_optimizer.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for name, tensor in reference.named_parameters():
        np.testing.assert_allclose(state[name], tensor.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_step_graph_fields(mlp):
    _, onnx_bytes = mlp
    optimizer = optim.SGD(lr=0.1, momentum=0.9)
    step = build_step_graph(onnx_bytes, None, "cross_entropy", optimizer, frozen="fc1")
    assert step.parameters == ["fc2.weight", "fc2.bias"]
    assert step.scalar_inputs == ["optim.lr"]
    assert step.loss_output == "loss" and step.graph.outputs[0].name == "loss"
    assert step.graph.outputs[0].type == ir.TensorType("float32", ())
    slots = {"fc2.weight.momentum", "fc2.bias.momentum"}
    assert set(step.state) == {"fc2.weight", "fc2.bias"} | slots
    assert all(not step.state[s].any() for s in slots)
    assert set(step.state_updates) == set(step.state)
    outputs = {v.name for v in step.graph.outputs}
    assert set(step.state_updates.values()) <= outputs
    inputs = {v.name for v in step.graph.inputs}
    assert inputs == set(step.state) | {"x", "labels", "optim.lr"}
    eval_inputs = {v.name for v in step.eval_graph.inputs}
    assert eval_inputs == {"x", "fc2.weight", "fc2.bias"}


def test_eval_graph_gives_the_model_outputs(mlp):
    module, onnx_bytes = mlp
    step = build_step_graph(onnx_bytes, None, "cross_entropy", optim.AdamW())
    x = np.random.default_rng(3).standard_normal((BATCH, FEATURES)).astype(np.float32)
    feeds = {"x": x, **{v.name: step.state[v.name] for v in step.eval_graph.inputs if v.name != "x"}}
    got = interpret(step.eval_graph, feeds)["logits"]
    np.testing.assert_allclose(got, module(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_unknown_loss_is_one_error(mlp):
    with pytest.raises(LossError, match="unknown loss 'hinge'"):
        build_step_graph(mlp[1], None, "hinge", optim.SGD(lr=0.1))


class BatchNormMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.bn = torch.nn.BatchNorm1d(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


LOSSES = {
    "cross_entropy": lambda y, t: F.cross_entropy(y, t, label_smoothing=0.1),
    "mse": F.mse_loss, "l1": F.l1_loss, "bce_with_logits": F.binary_cross_entropy_with_logits,
}


@pytest.mark.parametrize("kind", list(LOSSES))
def test_each_loss_and_batch_norm_statistics_match_torch(kind):
    torch.manual_seed(1)
    module = BatchNormMLP()
    optimizer = optim.SGD(lr=0.05, momentum=0.9, nesterov=True)
    smoothing = 0.1 if kind == "cross_entropy" else 0.0
    step = build_step_graph(_export(module), None, kind, optimizer, label_smoothing=smoothing)
    assert {"bn.running_mean", "bn.running_var"} <= set(step.state_updates) - set(step.parameters)
    rng = np.random.default_rng(2)
    batches = [(x, labels if kind == "cross_entropy" else rng.random((BATCH, CLASSES)).astype(np.float32))
               for x, labels in _batches(2)]
    losses, state = _run_steps(step, optimizer, batches)

    module.train()
    torch_optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    want = []
    for x, labels in batches:
        torch_optimizer.zero_grad()
        loss = LOSSES[kind](module(torch.from_numpy(x)), torch.from_numpy(labels))
        loss.backward()
        torch_optimizer.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for name, tensor in module.state_dict().items():
        if name in step.state:
            np.testing.assert_allclose(state[name], tensor.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


class SelfLossMLP(torch.nn.Module):
    """Returns its logits and its own loss (the MSE against a `target` input)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x, target):
        y = self.fc(x)
        return y, F.mse_loss(y, target)


def test_a_model_output_is_the_loss():
    torch.manual_seed(2)
    module = SelfLossMLP()
    buffer = io.BytesIO()
    torch.onnx.export(module.eval(), (torch.zeros(BATCH, FEATURES), torch.zeros(BATCH, CLASSES)), buffer,
                      dynamo=False, do_constant_folding=False, input_names=["x", "target"],
                      output_names=["y", "mse"])
    optimizer = optim.AdamW(lr=0.1)
    step = build_step_graph(buffer.getvalue(), None, "output:1", optimizer)
    assert step.label_input is None and step.data_inputs == ["x", "target"] and step.loss_output == "mse"
    rng = np.random.default_rng(4)
    x, target = (rng.standard_normal((BATCH, n)).astype(np.float32) for n in (FEATURES, CLASSES))
    outputs = interpret(step.graph, {**step.state, "x": x, "target": target, **optimizer.step_scalars(0)})
    loss = module(torch.from_numpy(x), torch.from_numpy(target))[1]
    assert float(outputs["mse"]) == pytest.approx(loss.item(), rel=1e-6)
    torch_optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    loss.backward()
    torch_optimizer.step()
    np.testing.assert_allclose(outputs[step.state_updates["fc.weight"]], module.fc.weight.detach().numpy(), rtol=1e-5)


class DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(FEATURES, CLASSES)
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, x):
        return self.fc(self.drop(x))


def test_dropout_masks_are_fed_per_step_not_data():
    # An export in eval mode drops Dropout; in training mode it stays.
    model = _export(DropoutMLP(), torch.onnx.TrainingMode.TRAINING)
    step = build_step_graph(model, None, "cross_entropy", optim.SGD(lr=0.1))
    assert list(step.dropout_masks.values()) == [0.25]
    (mask,) = step.dropout_masks
    assert step.data_inputs == ["x"] and mask in {v.name for v in step.graph.inputs}
    assert mask not in step.state and mask not in {v.name for v in step.eval_graph.inputs}
