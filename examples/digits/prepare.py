"""Prepare the digits example: scikit-learn's 8x8 handwritten digits (shipped inside the scikit-learn wheel, no
download) split into train.npz / test.npz, and a small CNN written in PyTorch exported to cnn.onnx.

    python examples/digits/prepare.py [OUT_DIR]        (default: examples/digits/data)

The .npz files hold `x` (float32 [N, 1, 8, 8], pixels scaled to [0, 1]) and `labels` (int64 [N], the digit):
the model's input name and the labels, as `tessel train` reads them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

TEST_FRACTION = 0.2
SPLIT_SEED = 0
INIT_SEED = 0


class DigitsCNN(nn.Module):
    """Two 3x3 conv blocks with BatchNorm, a max-pool, a third conv, then a linear classifier over 10 digits."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),  # BN's shift is the bias
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        )
        self.classifier = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def split_digits(test_fraction: float = TEST_FRACTION, seed: int = SPLIT_SEED):
    """(train, test): dicts of x and labels, a seeded random split of the 1,797 digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(round(len(labels) * (1 - test_fraction)))
    train, test = order[:cut], order[cut:]
    return {"x": x[train], "labels": labels[train]}, {"x": x[test], "labels": labels[test]}


def export_cnn(path: Path, seed: int = INIT_SEED) -> None:
    """Write the untrained CNN (PyTorch's default initialisation, seeded) as ONNX with a free batch axis."""
    torch.manual_seed(seed)
    model = DigitsCNN().eval()
    torch.onnx.export(model, (torch.zeros(1, 1, 8, 8),), str(path), dynamo=False, do_constant_folding=False,
                      input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).resolve().parent / "data"
    out.mkdir(parents=True, exist_ok=True)
    train, test = split_digits()
    np.savez(out / "train.npz", **train)
    np.savez(out / "test.npz", **test)
    export_cnn(out / "cnn.onnx")
    print(f"{out}: train.npz ({len(train['labels'])} digits), test.npz ({len(test['labels'])}), cnn.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
