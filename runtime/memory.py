"""Aligned host buffers: TVM's vectorized kernels need 64-byte-aligned memory."""
from __future__ import annotations

import os

import numpy as np

from .errors import ArtifactError

ALIGNMENT = 64


def physical_memory() -> int | None:
    """Bytes of RAM on this machine, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def allocate(nbytes: int, what: str) -> np.ndarray:
    """An aligned byte buffer for `what`; one ArtifactError line when this machine cannot hold it.

    Linux overcommits: a buffer larger than the RAM may be granted and kill the process on first
    touch, so it is refused up front.
    """
    ram = physical_memory()
    if ram is not None and nbytes > ram:
        raise ArtifactError(f"{what} needs {nbytes} bytes but this machine has {ram} bytes of memory; "
                            "run it on a larger machine or recompile with a smaller batch")
    try:
        return aligned_empty((nbytes,), np.uint8)
    except (MemoryError, ValueError) as exc:
        raise ArtifactError(f"{what}: cannot allocate {nbytes} bytes ({str(exc).splitlines()[0] or 'out of memory'}); "
                            "free memory or recompile with a smaller batch") from None


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


def check_in_arena(offset: int, nbytes: int, arena_bytes: int) -> None:
    """Raise ArtifactError unless bytes [offset, offset + nbytes) lie inside an arena of `arena_bytes`."""
    if offset < 0 or offset + nbytes > arena_bytes:
        raise ArtifactError(f"a buffer of {nbytes} bytes at offset {offset} lies outside the arena of {arena_bytes} bytes; "
                            "the plan is damaged: recompile the model")


def _count(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


class HostMemory:
    """Buffers in host memory (numpy), for llvm kernels: the arena is one aligned byte array.

    The executor handles buffers only through this interface, so the same program
    runs on a GPU with `runtime.device_memory.DeviceMemory`.
    """

    def __init__(self, arena_bytes: int):
        from tessel.backends.tvm_env import tvm

        self._tvm = tvm()
        self._arena = allocate(max(int(arena_bytes), 1), "the activation arena")

    @property
    def arena_bytes(self) -> int:
        """Size of the activation arena."""
        return int(self._arena.nbytes)

    def arena_range(self) -> tuple[int, int]:
        """The arena's [start, end) addresses."""
        start = int(self._arena.ctypes.data)
        return start, start + self.arena_bytes

    def at(self, offset: int, shape, dtype) -> np.ndarray:
        """The buffer of `shape` and `dtype` at byte `offset` of the arena."""
        dtype = np.dtype(dtype)
        nbytes = _count(shape) * dtype.itemsize
        check_in_arena(offset, nbytes, self.arena_bytes)
        return self._arena[offset:offset + nbytes].view(dtype).reshape(shape)

    def empty(self, shape, dtype) -> np.ndarray:
        """A buffer outside the arena."""
        dtype = np.dtype(dtype)
        return allocate(_count(shape) * dtype.itemsize, f"a {dtype}{list(shape)} buffer").view(dtype).reshape(shape)

    def weight(self, array: np.ndarray) -> np.ndarray:
        """A weight, copied into an aligned buffer."""
        out = self.empty(array.shape, array.dtype)
        out[...] = array
        return out

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
