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


class HostMemory:
    """Buffers in host memory (numpy), for llvm kernels: the arena is one aligned byte array.

    The executor handles buffers only through this interface, so the same program
    runs on a GPU with `runtime.device_memory.DeviceMemory`.
    """

    def __init__(self, arena_bytes: int):
        from backends.tvm_env import tvm

        self._tvm = tvm()
        self._arena = aligned_empty((max(int(arena_bytes), 1),), np.uint8)

    @property
    def arena_bytes(self) -> int:
        """Size of the activation arena."""
        return int(self._arena.nbytes)

    def at(self, offset: int, shape, dtype) -> np.ndarray:
        """The buffer of `shape` and `dtype` at byte `offset` of the arena."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        return self._arena[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def empty(self, shape, dtype) -> np.ndarray:
        """A buffer outside the arena."""
        return aligned_empty(shape, dtype)

    def weight(self, array: np.ndarray) -> np.ndarray:
        """A weight, copied into an aligned buffer."""
        return aligned_copy(array)

    def reshape(self, buffer: np.ndarray, shape) -> np.ndarray:
        """The same memory seen with another shape."""
        return buffer.reshape(shape)

    def rows(self, buffer: np.ndarray, start: int, stop: int) -> np.ndarray:
        """The slice [start, stop) of axis 0, sharing memory."""
        return buffer[start:stop]

    def tensor(self, buffer: np.ndarray):
        """The TVM tensor a kernel takes for `buffer` (no copy)."""
        return self._tvm.runtime.from_dlpack(buffer)

    def write(self, buffer: np.ndarray, array: np.ndarray) -> None:
        """Copy a host array into `buffer` (same shape and dtype)."""
        np.copyto(buffer, array, casting="no")

    def read(self, buffer: np.ndarray) -> np.ndarray:
        """A fresh host copy of `buffer`."""
        return np.array(buffer, copy=True)

    def copy(self, destination: np.ndarray, source: np.ndarray) -> None:
        """Copy one buffer into another of the same type."""
        np.copyto(destination, source)

    def fill(self, byte: int) -> None:
        """Set every byte of the arena."""
        self._arena.fill(byte)

    def sync(self) -> None:
        """Wait for the kernels launched so far (host kernels return when done)."""
