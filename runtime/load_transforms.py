"""Weights an artifact stores in their own, smaller form, and the loader transforms before any kernel runs.

A Winograd conv reads its 3×3 weights transformed to α × α points (U = G·g·Gᵀ, (α, α, C, K)): 4× the bytes of
the weight for F(4×4, 3×3). Stored transformed, they would make an artifact far larger than its ONNX file; the
artifact stores the weight as the model gives it and plan.json, per transformed weight, the transform and its
matrix G (in the sealed, hashed plan), so the loader computes exactly what the compiler computed.

A section's `weights.at_load` maps a weight name to {"transform": "winograd", "stored": its stored type,
"matrix": G as rows of floats}; the weight's type in `values` is the transformed one.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from tessel.ir.types import TensorType

WINOGRAD = "winograd"


def winograd_weight(weight: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """(K, C, 3, 3) → U = G·g·Gᵀ laid out (α, α, C, K), float32, computed in float64 (G is `matrix`, α × 3)."""
    # One product: U[e, ν] = Σ_ab G[e, a]·G[ν, b]·g[a, b] is (G ⊗ G)·vec(g), row e·α + ν, column a·3 + b (a
    # 3-operand einsum loops over every index at once: 60 ms for 128 × 128 channels, against under 1 ms).
    k, c = weight.shape[:2]
    alpha = matrix.shape[0]
    points = np.kron(matrix, matrix) @ weight.astype(np.float64).reshape(k * c, 9).T  # (α², K·C)
    return np.ascontiguousarray(points.reshape(alpha, alpha, k, c).transpose(0, 1, 3, 2).astype(np.float32))


def winograd_entry(weight: np.ndarray, matrix: np.ndarray) -> dict[str, Any]:
    """The plan's at_load entry for the Winograd transform of `weight` by `matrix`."""
    return {"transform": WINOGRAD, "stored": TensorType.of(weight).spec(),
            "matrix": [[float(v) for v in row] for row in np.asarray(matrix, np.float64)]}


def transformed(entry: Mapping[str, Any], stored: np.ndarray) -> np.ndarray:
    """The weight the kernels read, made from the `stored` array as `entry` says (checked by `entry_problem`)."""
    return winograd_weight(stored, np.asarray(entry["matrix"], np.float64))


def entry_problem(entry: Any, transformed_type: TensorType) -> str | None:
    """What is wrong with an at_load entry for a weight the kernels read as `transformed_type`, or None."""
    if not isinstance(entry, dict) or entry.get("transform") != WINOGRAD:
        return f"the only transform at load is '{WINOGRAD}'"
    matrix = entry.get("matrix")
    if (not isinstance(matrix, list) or not matrix
            or not all(isinstance(row, list) and len(row) == 3 and all(_finite(v) for v in row) for row in matrix)):
        return "its matrix must be rows of 3 finite numbers"
    try:
        stored = TensorType.parse(str(entry.get("stored")))
    except (ValueError, OverflowError):
        return f"its stored type '{entry.get('stored')}' is not a tensor type"
    alpha = len(matrix)
    if stored.dtype != "float32" or len(stored.shape) != 4 or tuple(stored.shape[2:]) != (3, 3):
        return f"it stores {stored.spec()}, not a float32 3×3 conv weight"
    k, c = stored.shape[:2]
    want = TensorType("float32", (alpha, alpha, c, k))
    if transformed_type != want:
        return f"{stored.spec()} transforms to {want.spec()}, the plan declares {transformed_type.spec()}"
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
