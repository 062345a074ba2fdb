"""Tensor types: an element dtype plus a fully static shape."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

# Element types Tessel accepts, by canonical name (numpy's, plus bfloat16).
_ONNX_TO_NAME = {
    TensorProto.FLOAT: "float32",
    TensorProto.DOUBLE: "float64",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT8: "int8",
    TensorProto.INT16: "int16",
    TensorProto.INT32: "int32",
    TensorProto.INT64: "int64",
    TensorProto.UINT8: "uint8",
    TensorProto.UINT16: "uint16",
    TensorProto.UINT32: "uint32",
    TensorProto.UINT64: "uint64",
    TensorProto.BOOL: "bool",
}
_NAME_TO_ONNX = {name: code for code, name in _ONNX_TO_NAME.items()}

DTYPES = tuple(_NAME_TO_ONNX)


def dtype_from_onnx(elem_type: int) -> str:
    """Return Tessel's dtype name for an ONNX element type code, or raise KeyError."""
    return _ONNX_TO_NAME[elem_type]


def dtype_to_onnx(dtype: str) -> int:
    """Return the ONNX element type code of a Tessel dtype name."""
    return _NAME_TO_ONNX[dtype]


def onnx_type_name(elem_type: int) -> str:
    """Human-readable name of any ONNX element type code (for error messages)."""
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"type code {elem_type}"


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that stores elements of a Tessel dtype."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(_NAME_TO_ONNX[dtype]))


def dtype_of_array(array: np.ndarray) -> str:
    """Tessel's dtype name for a numpy array's element type, or raise KeyError."""
    return dtype_from_onnx(helper.np_dtype_to_tensor_dtype(array.dtype))


@dataclass(frozen=True)
class TensorType:
    """A tensor's element type and static shape; every IR value has one."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in _NAME_TO_ONNX:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)

    @property
    def rank(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return numpy_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of a dense tensor of this type."""
        return self.numel * self.itemsize

    @classmethod
    def of(cls, array: np.ndarray) -> "TensorType":
        """The type of a numpy array."""
        return cls(dtype_of_array(array), array.shape)

    def spec(self) -> str:
        """The type as text with the full dtype name, e.g. "float32[1,3,224,224]"; `parse` reads it back."""
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    @classmethod
    def parse(cls, text: str) -> "TensorType":
        """Read a type written by `spec`; raise ValueError on malformed text."""
        dtype, sep, rest = text.partition("[")
        if not sep or not rest.endswith("]"):
            raise ValueError(f"malformed tensor type {text!r}; expected e.g. float32[1,3,224,224]")
        dims = rest[:-1]
        return cls(dtype, tuple(int(d) for d in dims.split(",")) if dims else ())

    def __str__(self) -> str:
        short = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}
        name = short.get(self.dtype, self.dtype.replace("uint", "u").replace("int", "i"))
        return f"{name}[{','.join(str(d) for d in self.shape)}]"
