"""Training step graphs of small PyTorch models, built with the passes (training import, ReduceMean of the output
as the loss, autodiff): shared by the recomputation tests."""
from __future__ import annotations

import io

import numpy as np
import torch

from tessel.ir import from_onnx
from tessel.ir.graph import Graph
from tessel.passes.autodiff import differentiate
from tessel.passes.base import add_op
from tessel.passes.graph_memory import plan_graph_memory
from tessel.passes.recompute import plan_recompute
from tessel.passes.training_mode import prepare_training


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


class PoolCNN(torch.nn.Module):
    """ResNet's stem in small: conv, BatchNorm, ReLU, a 3x3 stride-2 MaxPool, then a conv reading the pool."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.b1(self.c1(x))), 3, 2, 1)
        return self.fc(torch.relu(self.c2(x)).flatten(1))


MODELS = {"mlp": (MLP, (128, 32)), "cnn": (CNN, (4, 1, 8, 8))}
# Steps for targeted tests, outside the sweep over MODELS.
OTHER_MODELS = {"pool": (PoolCNN, (4, 1, 8, 8))}
_EXPORTED: dict[str, bytes] = {}


def exported(kind: str) -> bytes:
    """The model as ONNX (exported once per test session)."""
    if kind not in _EXPORTED:
        make, shape = {**MODELS, **OTHER_MODELS}[kind]
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
