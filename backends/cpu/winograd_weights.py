"""Winograd F(m×m, 3×3)'s weight transform U = G·g·Gᵀ, in numpy alone: the compiler packs with it
(winograd.py, packing.py) and the loader makes the weights with it (runtime/load_transforms.py, which reads the plan
entry `winograd_entry` writes), so both compute the very same array.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tessel.ir.types import TensorType

# The plan's name of this transform (plan.json's weights.at_load entries).
WINOGRAD = "winograd"


def winograd_weight(weight: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """(K, C, 3, 3) → U = G·g·Gᵀ laid out (α, α, C, K), float32, computed in float64 (G is `matrix`, α × 3)."""
    # One product: U[e, ν] = Σ_ab G[e, a]·G[ν, b]·g[a, b] is (G ⊗ G)·vec(g), row e·α + ν, column a·3 + b (a
    # 3-operand einsum loops over every index at once: 60 ms for 128 × 128 channels, against under 1 ms).
    k, c = weight.shape[:2]
    alpha = matrix.shape[0]
    points = np.kron(matrix, matrix) @ weight.astype(np.float64).reshape(k * c, 9).T  # (α², K·C)
    return np.ascontiguousarray(points.reshape(alpha, alpha, k, c).transpose(0, 1, 3, 2), dtype=np.float32)


def winograd_entry(weight: np.ndarray, matrix: np.ndarray) -> dict[str, Any]:
    """The plan's at_load entry for the Winograd transform of `weight` by `matrix`."""
    return {"transform": WINOGRAD, "stored": TensorType.of(weight).spec(),
            "matrix": [[float(v) for v in row] for row in np.asarray(matrix, np.float64)]}
