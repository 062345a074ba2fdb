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

from tessel.backends.cpu.winograd_weights import WINOGRAD, winograd_weight
from tessel.ir.types import TensorType

# The transformed tile's points per side: the kernels run F(4×4, 3×3) (backends/cpu/winograd.py TILE + 2). A plan's
# matrix of any other size is refused: it also bounds what the loader computes.
WINOGRAD_POINTS = 6
# Integers a plan's matrix may hold exactly as float64 (a larger one is no Winograd coefficient).
_EXACT_INTEGERS = 1 << 53


def _winograd_from_entry(entry: Mapping[str, Any], stored: np.ndarray) -> np.ndarray:
    return winograd_weight(stored, np.asarray(entry["matrix"], np.float64))


def _winograd_problem(entry: Mapping[str, Any], transformed_type: TensorType) -> str | None:
    matrix = entry.get("matrix")
    if (not isinstance(matrix, list) or len(matrix) != WINOGRAD_POINTS
            or not all(isinstance(row, list) and len(row) == 3 and all(_finite(v) for v in row) for row in matrix)):
        return f"its matrix must be {WINOGRAD_POINTS} rows of 3 finite numbers (F(4×4, 3×3))"
    try:
        stored = TensorType.parse(str(entry.get("stored")))
    except (ValueError, OverflowError):
        return f"its stored type '{entry.get('stored')}' is not a tensor type"
    if stored.dtype != "float32" or len(stored.shape) != 4 or tuple(stored.shape[2:]) != (3, 3):
        return f"it stores {stored.spec()}, not a float32 3×3 conv weight"
    k, c = stored.shape[:2]
    want = TensorType("float32", (WINOGRAD_POINTS, WINOGRAD_POINTS, c, k))
    if transformed_type != want:
        return f"{stored.spec()} transforms to {want.spec()}, the plan declares {transformed_type.spec()}"
    return None


# Each transform the loader knows: (make the weight the kernels read from the stored one, what is wrong with an entry).
TRANSFORMS = {WINOGRAD: (_winograd_from_entry, _winograd_problem)}


def transformed(entry: Mapping[str, Any], stored: np.ndarray) -> np.ndarray:
    """The weight the kernels read, made from the `stored` array as `entry` says (checked by `entry_problem`)."""
    make, _ = TRANSFORMS[entry["transform"]]
    return make(entry, stored)


def entry_problem(entry: Any, transformed_type: TensorType) -> str | None:
    """What is wrong with an at_load entry for a weight the kernels read as `transformed_type`, or None."""
    if not isinstance(entry, dict) or entry.get("transform") not in TRANSFORMS:
        return f"the transforms at load are {', '.join(repr(name) for name in TRANSFORMS)}"
    _, problem = TRANSFORMS[entry["transform"]]
    return problem(entry, transformed_type)


def _finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) < _EXACT_INTEGERS if isinstance(value, int) else math.isfinite(value)
