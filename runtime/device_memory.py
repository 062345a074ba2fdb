"""Buffers in the memory of a TVM device (a GPU): the same interface as `runtime.memory.HostMemory`.

The arena is one device allocation; each activation is a DLPack view of it at its
planned offset (TVM's kernels refuse a DLTensor with a byte_offset, so a view is
a tensor whose data pointer starts at the offset, as a numpy slice is on the host).
"""
from __future__ import annotations

import ctypes

import numpy as np

from .device_inputs import device_tensor

from .errors import ArtifactError
from .memory import check_in_arena

# The alignment TVM's kernels assume of every tensor they take (tvm.runtime.from_dlpack checks it).
KERNEL_ALIGNMENT = 64

# DLPack type codes (dlpack.h: kDLInt, kDLUInt, kDLFloat, kDLBool).
_TYPE_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype = ctypes.py_object
_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _View:
    """A DLPack producer for `shape`/`dtype` at device address `pointer`; it must outlive its tensor.

    The deleter is NULL: the memory belongs to the arena, which the executor keeps alive.
    """

    def __init__(self, pointer: int, device, shape, dtype):
        dtype = np.dtype(dtype)
        self._device = (int(device.dlpack_device_type()), int(device.index))
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        tensor = _DLTensor(pointer, _DLDevice(*self._device), len(shape),
                           _DLDataType(_TYPE_CODES[dtype.kind], 8 * dtype.itemsize, 1), self._shape, None, 0)
        self._managed = _DLManagedTensor(tensor, None, _Deleter())

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, **_):
        return _capsule(ctypes.addressof(self._managed), b"dltensor", None)


class DeviceMemory:
    """Buffers in the memory of `device` (a tvm.runtime.Device); kernels take them as they are."""

    def __init__(self, device, arena_bytes: int):
        from tessel.backends.tvm_env import tvm

        self._tvm = tvm()
        if not device.exist:
            raise ArtifactError(f"this artifact's kernels run on {device}, which TVM does not see here "
                                "(no GPU, or no driver); run it on a machine with one, or compile for llvm")
        self.device = device
        self._arena = self._allocate((max(int(arena_bytes), 1),), "uint8", "the activation arena")
        self._views: list[_View] = []  # the DLPack views behind every buffer live as long as the memory

    @property
    def arena_bytes(self) -> int:
        """Size of the activation arena."""
        return int(self._arena.shape[0])

    def _view(self, pointer: int, shape, dtype, alignment: int = KERNEL_ALIGNMENT):
        """A TVM tensor over the memory at `pointer`, which must be aligned to `alignment` bytes (0: any)."""
        import tvm_ffi

        view = _View(pointer, self.device, tuple(int(d) for d in shape), dtype)
        self._views.append(view)
        return tvm_ffi.from_dlpack(view, require_alignment=alignment, require_contiguous=True)

    def _allocate(self, shape, dtype: str, what: str):
        try:
            return self._tvm.runtime.empty(tuple(shape), dtype, self.device)
        except Exception as exc:  # noqa: BLE001 - TVM reports an allocation failure as its own error type
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            raise ArtifactError(f"{what}: cannot allocate {nbytes} bytes on {self.device} ({first}); "
                                "free device memory or recompile with a smaller batch") from None

    def at(self, offset: int, shape, dtype):
        """The buffer of `shape` and `dtype` at byte `offset` of the arena."""
        # A view is a raw device pointer: nothing downstream would notice one outside the arena.
        check_in_arena(offset, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, self.arena_bytes)
        return self._view(self._arena.data_ptr() + offset, shape, dtype)

    def empty(self, shape, dtype):
        """A buffer outside the arena."""
        dtype = str(np.dtype(dtype))
        return self._allocate(shape, dtype, f"a {dtype}{list(shape)} buffer")

    def weight(self, array: np.ndarray):
        """A weight, copied to the device."""
        return self._tvm.runtime.tensor(np.require(array, requirements="C"), self.device)

    def reshape(self, buffer, shape):
        """The same memory seen with another shape."""
        return self._view(buffer.data_ptr(), shape, buffer.dtype)

    def rows(self, buffer, start: int, stop: int):
        """The slice [start, stop) of axis 0, sharing memory, at any alignment (as a numpy slice is): a transfer
        or a copy takes it as it is, a kernel only through `tensor`, which checks."""
        shape = tuple(buffer.shape)
        if not 0 <= start <= stop <= (shape[0] if shape else 0):
            raise ArtifactError(f"rows [{start}, {stop}) of a buffer of {shape[0] if shape else 0} rows; "
                                "the plan is damaged: recompile the model")
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(str(buffer.dtype)).itemsize
        return self._view(buffer.data_ptr() + start * row_bytes, (stop - start,) + shape[1:], str(buffer.dtype), 0)

    def tensor(self, buffer):
        """The TVM tensor a kernel takes for `buffer`: the buffer itself, which must be aligned as kernels assume."""
        if buffer.data_ptr() % KERNEL_ALIGNMENT:
            raise ArtifactError(f"a kernel argument at device address {buffer.data_ptr():#x} is not aligned to "
                                f"{KERNEL_ALIGNMENT} bytes; the plan is damaged: recompile the model")
        return buffer

    def write(self, buffer, array) -> None:
        """Copy a host array, or a tensor already on a GPU (device to device), into `buffer` (same shape and
        dtype)."""
        on_device = device_tensor(array)
        buffer.copyfrom(on_device if on_device is not None else np.require(array, requirements="C"))

    def read(self, buffer) -> np.ndarray:
        """A fresh host copy of `buffer`."""
        return buffer.numpy()

    def copy(self, destination, source) -> None:
        """Copy one buffer into another of the same type (on the device)."""
        source.copyto(destination)

    def fill(self, byte: int) -> None:
        """Set every byte of the arena."""
        self._arena.copyfrom(np.full(self.arena_bytes, byte, np.uint8))

    def sync(self) -> None:
        """Wait for the kernels launched so far."""
        self.device.sync()
