"""Corpus models written in PyTorch, for timing Tessel against PyTorch eager with the same weights.

Weights are looked up by the ONNX initializer names of the corpus model, so
the same arrays serve the ONNX model, Tessel's artifact and PyTorch.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

RESNET18_STAGES = ((1, 64), (2, 128), (3, 256), (4, 512))


def resnet18_weight_names() -> list[str]:
    """The initializer names the corpus ResNet-18 (BatchNorm folded, convs without bias) uses."""
    names = ["conv1.weight"]
    for stage, _ in RESNET18_STAGES:
        for block in (0, 1):
            names += [f"layer{stage}.{block}.conv1.weight", f"layer{stage}.{block}.conv2.weight"]
            if stage > 1 and block == 0:
                names.append(f"layer{stage}.0.down.0.weight")
    return names + ["fc.weight", "fc.bias"]


def resnet18(weights: Mapping[str, np.ndarray]):
    """ResNet-18 as the corpus model computes it (a torch.nn.Module on the CPU; move it with .cuda())."""
    import torch
    import torch.nn.functional as F

    class ResNet18(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name in resnet18_weight_names():
                self.register_buffer(name.replace(".", "_"), torch.from_numpy(np.ascontiguousarray(weights[name])))

        def _w(self, name: str):
            return getattr(self, name.replace(".", "_"))

        def forward(self, x):
            x = F.max_pool2d(F.relu(F.conv2d(x, self._w("conv1.weight"), stride=2, padding=3)), 3, 2, 1)
            for stage, _ in RESNET18_STAGES:
                for block in (0, 1):
                    prefix = f"layer{stage}.{block}"
                    stride = 2 if stage > 1 and block == 0 else 1
                    y = F.relu(F.conv2d(x, self._w(f"{prefix}.conv1.weight"), stride=stride, padding=1))
                    y = F.conv2d(y, self._w(f"{prefix}.conv2.weight"), padding=1)
                    shortcut = F.conv2d(x, self._w(f"{prefix}.down.0.weight"), stride=2) if stride == 2 else x
                    x = F.relu(y + shortcut)
            x = x.mean(dim=(2, 3))
            return F.linear(x, self._w("fc.weight"), self._w("fc.bias"))

    return ResNet18()
