"""A tiny classifier (x[N, 4] -> logits[N, 3], one Gemm) and matching .npz data for the `tessel train` tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from tests.ir.helpers import F, model


def write_classifier(path: Path) -> Path:
    """logits = x @ W^T + b with a free batch axis; W and b are initializers (the trainable parameters)."""
    rng = np.random.default_rng(0)
    weights = [("W", rng.standard_normal((3, 4)).astype(np.float32) * 0.1), ("b", np.zeros(3, np.float32))]
    graph = model([helper.make_node("Gemm", ["x", "W", "b"], ["logits"], name="fc", transB=1)],
                  [("x", F, ["N", 4])], [("logits", F, ["N", 3])], weights)
    onnx.save(graph, str(path))
    return path


def write_data(path: Path, samples: int = 40, **overrides) -> Path:
    """x float32 [samples, 4] and labels int64 [samples] (a separable rule), with `overrides` replacing arrays
    (None removes one)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((samples, 4)).astype(np.float32)
    arrays = {"x": x, "labels": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1).astype(np.int64)}
    arrays.update(overrides)
    np.savez(path, **{name: array for name, array in arrays.items() if array is not None})
    return path
