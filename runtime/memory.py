"""Aligned host buffers: TVM's vectorized kernels need 64-byte-aligned memory."""
from __future__ import annotations

import numpy as np

ALIGNMENT = 64


def aligned_empty(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an `alignment`-byte boundary."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    raw = np.empty(count * dtype.itemsize + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)


def aligned_copy(array: np.ndarray, alignment: int = ALIGNMENT) -> np.ndarray:
    """An aligned, C-contiguous copy of `array`."""
    out = aligned_empty(array.shape, array.dtype, alignment)
    out[...] = array
    return out
