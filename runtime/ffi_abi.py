"""The C calling convention of TVM's compiled kernels (apache-tvm-ffi 0.1), as the native host program uses it.

Every fact here is checked against the installed tvm_ffi by tests/runtime/test_ffi_abi.py (its headers
under tvm_ffi/include and a kernel called through it):

- A kernel library exports its function as `__tvm_ffi_main`, with TVM's "safe call" signature
  `int32_t (void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result)`
  (c_api.h, TVMFFISafeCallType). `self` is unused by compiled kernels (NULL is passed). It returns 0,
  or -1 after raising an error in the calling thread (TVMFFIErrorSetRaisedFromCStrParts).
- `result->type_index` must be kTVMFFINone (0) before the call; kernels return nothing, so it stays so.
- Each tensor argument is a TVMFFIAny of 16 bytes {int32 type_index; uint32 zero_padding; union value}
  with type_index kTVMFFIDLTensorPtr (7) and the value a pointer to a DLTensor of 48 bytes
  {void* data; DLDevice {int32 device_type; int32 device_id}; int32 ndim; DLDataType {uint8 code;
  uint8 bits; uint16 lanes}; int64* shape; int64* strides; uint64 byte_offset} (dlpack.h); strides NULL
  means compact row-major; device kDLCPU (1). The kernel checks ndim, dtype, shape and device itself.
- The library must be loaded by TVM first (tvm.runtime.load_module): the loader fills the library's
  function-pointer slots (`__TVMBackendParallelLaunch`, `__TVMBackendAllocWorkspace`, `__tvm_ffi__library_ctx`,
  ...) that the kernel calls through. The entry's address is then looked up in the already loaded
  library (dlopen with RTLD_NOLOAD of the same path).
- A raised error is taken with TVMFFIErrorMoveFromRaised (an owned error object, released with
  TVMFFIObjectDecRef); the object is a 24-byte TVMFFIObject header followed by TVMFFIErrorCell, whose first
  two fields are TVMFFIByteArray {const char* data; size_t size} `kind` (e.g. "IndexError") and `message`.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

KERNEL_SYMBOL = "__tvm_ffi_main"
TYPE_INDEX_NONE = 0  # kTVMFFINone
TYPE_INDEX_DLTENSOR_PTR = 7  # kTVMFFIDLTensorPtr
DEVICE_CPU = 1  # kDLCPU
OBJECT_HEADER_BYTES = 24  # sizeof(TVMFFIObject)

# TVMFFIAny: the value of each argument and of the result.
ANY = np.dtype([("type_index", "<i4"), ("zero_padding", "<u4"), ("value", "<u8")], align=True)
# DLTensor, the tensor an argument points to.
DLTENSOR = np.dtype([("data", "<u8"), ("device_type", "<i4"), ("device_id", "<i4"), ("ndim", "<i4"),
                     ("code", "u1"), ("bits", "u1"), ("lanes", "<u2"), ("shape", "<u8"), ("strides", "<u8"),
                     ("byte_offset", "<u8")], align=True)
_BYTE_ARRAY = np.dtype([("data", "<u8"), ("size", "<u8")])


def kernel_entry(path: str | Path) -> int:
    """The address of the kernel function of a library that tvm.runtime.load_module already loaded from `path`.

    The handle stays open (and the library loaded) for the life of the process, like TVM's own.
    """
    library = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    return ctypes.cast(getattr(library, KERNEL_SYMBOL), ctypes.c_void_p).value


def dl_dtype(dtype: np.dtype) -> tuple[int, int, int]:
    """(code, bits, lanes) of DLDataType for a numpy dtype, as TVM names it."""
    import tvm_ffi

    dt = tvm_ffi.dtype(np.dtype(dtype).name)
    return int(dt.type_code), int(dt.bits), int(dt.lanes)


def _ffi_library() -> ctypes.CDLL:
    import tvm_ffi

    path = Path(tvm_ffi.__file__).parent / "lib" / "libtvm_ffi.so"
    return ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)


def take_raised_error() -> Exception:
    """The error the last failed kernel call of this thread raised, as the Python exception tvm_ffi would raise.

    Clears it from the thread; a RuntimeError when none was raised.
    """
    from tvm_ffi import core

    library = _ffi_library()
    handle = ctypes.c_void_p()
    library.TVMFFIErrorMoveFromRaised(ctypes.byref(handle))
    if not handle.value:
        return RuntimeError("a kernel failed without raising an error")
    try:
        kind, message = (ctypes.string_at(int(cell["data"]), int(cell["size"])).decode(errors="replace")
                         for cell in np.frombuffer(ctypes.string_at(handle.value + OBJECT_HEADER_BYTES, 2 * _BYTE_ARRAY.itemsize),
                                                   _BYTE_ARRAY))
    finally:
        library.TVMFFIObjectDecRef(handle)
    return core.ERROR_NAME_TO_TYPE.get(kind, RuntimeError)(message)
