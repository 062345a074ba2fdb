"""Conversions between Tessel's typed values and ONNX protobuf messages."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import onnx
from onnx import AttributeProto, TypeProto, helper, numpy_helper

from .types import TensorType, dtype_to_onnx

ATTR_KIND = {
    AttributeProto.INT: "int",
    AttributeProto.FLOAT: "float",
    AttributeProto.STRING: "string",
    AttributeProto.INTS: "ints",
    AttributeProto.FLOATS: "floats",
    AttributeProto.STRINGS: "strings",
    AttributeProto.TENSOR: "tensor",
    AttributeProto.GRAPH: "graph",
}
_KIND_TO_ATTR = {kind: code for code, kind in ATTR_KIND.items()}


def type_proto(type: TensorType) -> TypeProto:
    """An ONNX TypeProto for a tensor type."""
    return helper.make_tensor_type_proto(dtype_to_onnx(type.dtype), list(type.shape))


def tensor_proto(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An ONNX TensorProto holding `array`."""
    return numpy_helper.from_array(np.asarray(array), name)


def attribute_proto(
    name: str, kind: str, value: Any, graph_to_proto: Callable[[Any], onnx.GraphProto] | None = None
) -> AttributeProto:
    """An ONNX AttributeProto for a typed attribute value; graphs go through `graph_to_proto`."""
    if kind == "tensor":
        value = numpy_helper.from_array(np.asarray(value))
    elif kind == "graph":
        if graph_to_proto is None:
            raise ValueError(f"attribute '{name}' holds a graph but no graph converter was given")
        value = graph_to_proto(value)
    elif kind in ("ints", "floats", "strings"):
        value = list(value)
    return helper.make_attribute(name, value, attr_type=_KIND_TO_ATTR[kind])
