"""Models written in PyTorch for the training comparisons (tests/compiler/test_training_torch.py, bench/train.py):
each one trains in PyTorch and, exported to ONNX from the same weights, in Tessel.

Written out here rather than taken from torchvision (PyPI's torchvision does not import beside the pinned torch).
No dropout anywhere: its masks are drawn differently by the two engines. Each spec gives the model, its input
shape (batch first), the loss and how to draw a batch, all seeded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn


class MLP(nn.Module):
    """Two hidden layers with ReLU; a regression head (trained with MSE)."""

    def __init__(self, features: int = 32, hidden: int = 64, outputs: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, outputs))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU twice with a max-pool between, global average pool, linear classifier. The convolutions have
    no bias: BN removes it, so its gradient is rounding noise, which AdamW's normalisation turns into steps of the
    learning rate's size in a direction no two engines agree on."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(self.features(x).mean(dim=(2, 3)))


class DepthwiseSeparableCNN(nn.Module):
    """MobileNet-style blocks: depthwise 3x3 (groups = channels) + BN + ReLU, pointwise 1x1 + BN + ReLU."""

    def __init__(self, classes: int = 10):
        super().__init__()

        def block(cin, cout, stride):
            return [nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                    nn.ReLU(), nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      *block(8, 16, 1), *block(16, 32, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN, a projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18 (He et al.; torchvision's layout and initialisation of convs and BN)."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class EncoderBlock(nn.Module):
    """A pre-LayerNorm transformer encoder block (multi-head softmax attention, GELU MLP) and a classifier over
    the mean token."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(
            2, 0, 3, 1, 4)
        attention = torch.softmax(q @ k.transpose(-2, -1) * (dim // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(batch, tokens, dim))
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(dim=1))


class RecurrentClassifier(nn.Module):
    """An LSTM or GRU over the sequence (batch first); a linear classifier on the last hidden state."""

    def __init__(self, cell: str, features: int = 8, hidden: int = 16, classes: int = 5):
        super().__init__()
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(features, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])


@dataclass(frozen=True)
class ModelSpec:
    """A model to train: how to build it, its input shape (batch first), its loss and what its labels are."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    loss: str  # "cross_entropy" (labels: class indices) or "mse" (labels: targets of the output's shape)
    outputs: int  # classes, or the regression targets per sample

    def batch(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """A random batch: inputs float32, labels int64 class indices or float32 targets."""
        x = rng.standard_normal(self.input_shape).astype(np.float32)
        if self.loss == "cross_entropy":
            return x, rng.integers(0, self.outputs, self.input_shape[0]).astype(np.int64)
        return x, rng.standard_normal((self.input_shape[0], self.outputs)).astype(np.float32)

    def model(self, seed: int = 0) -> nn.Module:
        """The model with PyTorch's default initialisation under `seed`, its normalisation layers' scales,
        shifts and running statistics jittered: left at their ones and zeros, equal tensors would be shared by
        the ONNX exporter (one initializer for several layers), and a test could not tell the layers apart."""
        torch.manual_seed(seed)
        model = self.build()
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm)):
                    module.weight.add_(0.1 * torch.randn_like(module.weight))
                    module.bias.add_(0.1 * torch.randn_like(module.bias))
                if isinstance(module, nn.BatchNorm2d):
                    module.running_mean.add_(0.1 * torch.randn_like(module.running_mean))
                    module.running_var.add_(0.1 * torch.rand_like(module.running_var))
        return model


SPECS = {spec.name: spec for spec in (
    ModelSpec("mlp", MLP, (16, 32), "mse", 4),
    ModelSpec("cnn_bn", SmallCNN, (8, 3, 16, 16), "cross_entropy", 10),
    ModelSpec("depthwise_cnn", DepthwiseSeparableCNN, (8, 3, 16, 16), "cross_entropy", 10),
    ModelSpec("resnet18", lambda: ResNet18(classes=10), (4, 3, 32, 32), "cross_entropy", 10),
    ModelSpec("transformer_block", EncoderBlock, (8, 16, 32), "cross_entropy", 10),
    ModelSpec("lstm", lambda: RecurrentClassifier("lstm"), (8, 6, 8), "cross_entropy", 5),
    ModelSpec("gru", lambda: RecurrentClassifier("gru"), (8, 6, 8), "cross_entropy", 5),
)}


def export(model: nn.Module, input_shape: tuple[int, ...], path: Path) -> Path:
    """Write the model as ONNX (input "x", output "y"): the legacy exporter without constant folding, which would
    fold BatchNorm into the convolutions; eval mode so BatchNorm exports in its inference form."""
    was_training = model.training
    torch.onnx.export(model.eval(), (torch.zeros(input_shape),), str(path), dynamo=False,
                      do_constant_folding=False, input_names=["x"], output_names=["y"])
    model.train(was_training)
    return path


def torch_loss(kind: str, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss `kind` as PyTorch computes it (mean over the batch)."""
    if kind == "cross_entropy":
        return nn.functional.cross_entropy(output, labels)
    return nn.functional.mse_loss(output, labels)


def torch_optimizer(kind: str, params, lr: float):
    """torch.optim's SGD with momentum 0.9 or AdamW with its defaults."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def torch_train_step(loss: str, model, optimizer):
    """One PyTorch training step on (x, y) as a function returning the loss: zero the gradients, forward, the loss,
    backward, the optimizer's update."""
    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        value = torch_loss(loss, model(x), y)
        value.backward()
        optimizer.step()
        return value.item()

    return step
