"""Where a numpy array object keeps its data pointer and flags, for native code handed the object itself.

The native host program takes a run's input arrays as the Python objects (ctypes `py_object`: the
`PyObject*`) and reads their data pointer and flags there: from Python, `array.ctypes.data` costs about
1 µs, as much as copying a 64 KB input. The fields are numpy's public C struct `PyArrayObject_fields`
(numpy/ndarraytypes.h: after the 16-byte `PyObject_HEAD` of a 64-bit CPython come `char *data`, `int nd`,
`npy_intp *dimensions`, `npy_intp *strides`, `PyObject *base`, `PyArray_Descr *descr`, `int flags`), whose
layout the C API's PyArray_DATA/PyArray_FLAGS read and numpy keeps for compiled extensions.

`layout_holds()` checks these offsets on live arrays of this process (a debug or free-threaded CPython has
another header): the native host reads arrays only when it holds, and copies them from Python otherwise.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

DATA_OFFSET = 16  # char *data
FLAGS_OFFSET = 64  # int flags
C_CONTIGUOUS = 0x0001  # NPY_ARRAY_C_CONTIGUOUS


def _fields(array: np.ndarray) -> tuple[int, int]:
    """(data pointer, flags) read at the offsets from the array object's address (id is it on CPython)."""
    address = id(array)
    return (ctypes.c_void_p.from_address(address + DATA_OFFSET).value or 0,
            ctypes.c_int32.from_address(address + FLAGS_OFFSET).value)


@functools.cache
def layout_holds() -> bool:
    """Whether numpy arrays of this process keep their data pointer and flags at DATA_OFFSET and FLAGS_OFFSET."""
    whole = np.arange(64, dtype=np.float32).reshape(8, 8)
    for array, contiguous in ((whole, True), (whole[:, 1:], False), (whole[2:], True), (whole.T, False)):
        data, flags = _fields(array)
        if data != array.ctypes.data or bool(flags & C_CONTIGUOUS) != contiguous:
            return False
    return True
