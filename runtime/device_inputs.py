"""Inputs that already live on the GPU: a cuda artifact takes them without a trip through host memory.

Any DLPack tensor on a device other than the CPU (a PyTorch CUDA tensor, a TVM
tensor, a CuPy array) is taken as it is: its shape and dtype are checked like a
numpy input's, and it is copied device to device into the artifact's arena
(as onnxruntime's IOBinding or TVM's set_input with a device tensor). An
artifact whose buffers are in host memory refuses one with one line.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# DLPack's device type of host memory (kDLCPU); pinned host memory (kDLCUDAHost) is host memory as well.
HOST_DEVICE_TYPES = (1, 3)


def on_gpu(value: Any) -> bool:
    """Whether `value` is a DLPack tensor in device (not host) memory."""
    locate = getattr(value, "__dlpack_device__", None)
    return locate is not None and not isinstance(value, np.ndarray) and int(locate()[0]) not in HOST_DEVICE_TYPES


def device_tensor(value: Any):
    """`value` as a TVM tensor when it is a DLPack tensor on a GPU (no copy), else None."""
    if not on_gpu(value):
        return None
    import tvm_ffi

    return tvm_ffi.from_dlpack(value)


def shape_and_dtype(value: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and numpy dtype of an input, on the host or on a GPU."""
    tensor = device_tensor(value)
    if tensor is None:
        array = np.asarray(value)
        return array.shape, array.dtype
    return tuple(int(d) for d in tensor.shape), np.dtype(str(tensor.dtype))
