"""Tessel's graph IR: static-shaped tensors, typed ops, ONNX import and export."""
from .attributes import Attributes
from .errors import (
    ModelImportError,
    ModelLoadError,
    SerializationError,
    ShapeBindingError,
    TesselError,
    UnsupportedModelError,
    VerificationError,
)
from .graph import Graph, Node, Value
from .onnx_export import to_onnx
from .onnx_import import from_onnx, load_model
from .printer import format_graph
from .schema import CANONICAL_OPSET, OpSchema, get_schema
from .serialize import from_json, to_json
from .types import TensorType
from .verify import check, verify

__all__ = [
    "Attributes", "CANONICAL_OPSET", "Graph", "ModelImportError", "ModelLoadError", "Node", "OpSchema",
    "SerializationError", "ShapeBindingError", "TensorType", "TesselError", "UnsupportedModelError", "Value",
    "VerificationError", "check", "format_graph", "from_json", "from_onnx", "get_schema", "load_model", "to_json", "to_onnx", "verify",
]
