"""Random model inputs, for runs and measurements made without the user's data."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ir.types import TensorType, numpy_dtype


def random_input(t: TensorType, rng: np.random.Generator, shape: Sequence[int] | None = None) -> np.ndarray:
    """Standard-normal values for a floating-point input, zeros otherwise (indices, flags, sizes)."""
    shape = tuple(t.shape if shape is None else shape)
    dtype = numpy_dtype(t.dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype)
