"""The float64 version of an ONNX model: every float32 tensor it declares, stores or makes becomes float64.

What `precision="fp64"` compiles. Training in float64 is how a step is checked against a reference where float32
rounding decides the trajectory (ResNet-18 at batch 4: PyTorch float32 does not follow PyTorch float64 for 20
steps), and how gradients are checked against finite differences. The promotion is exact: every float32 value is a
float64 value.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

# Node attributes that name an element type ("to" of Cast, "dtype" of EyeLike and the Random* ops).
_TYPE_ATTRIBUTES = ("to", "dtype")
# Ops whose output is float32 when they say nothing: the type they default to becomes explicit.
_FLOAT_BY_DEFAULT = {"RandomNormal": "dtype", "RandomUniform": "dtype"}


def promote_to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` computing in float64: float32 initializers, graph inputs, outputs and value infos, Constant
    and ConstantOfShape values (given or default), Cast targets and the Random* ops' types become float64, in
    subgraphs too. Other types are left alone (a float16 initializer that a Cast widens is then widened to
    float64), and so are sparse initializers, which the importer refuses anyway."""
    promoted = onnx.ModelProto()
    promoted.CopyFrom(model)
    _promote_graph(promoted.graph)
    return promoted


def _promote_graph(graph: onnx.GraphProto) -> None:
    for initializer in graph.initializer:
        _promote_tensor(initializer)
    for value in (*graph.input, *graph.output, *graph.value_info):
        _promote_value_type(value.type)
    for node in graph.node:
        _make_float_defaults_explicit(node)
        for attribute in node.attribute:
            if attribute.name in _TYPE_ATTRIBUTES and attribute.type == onnx.AttributeProto.INT \
                    and attribute.i == TensorProto.FLOAT:
                attribute.i = TensorProto.DOUBLE
            elif attribute.type == onnx.AttributeProto.TENSOR:
                _promote_tensor(attribute.t)
            elif attribute.type == onnx.AttributeProto.TENSORS:
                for tensor in attribute.tensors:
                    _promote_tensor(tensor)
            elif attribute.type == onnx.AttributeProto.GRAPH:
                _promote_graph(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    _promote_graph(subgraph)


def _make_float_defaults_explicit(node: onnx.NodeProto) -> None:
    """Spell out the float32 a node makes without saying so, as an attribute the promotion then widens: Constant's
    value_float(s), ConstantOfShape's default 0, the Random* ops' default dtype."""
    names = {attribute.name for attribute in node.attribute}
    if node.op_type == "Constant":
        for attribute in list(node.attribute):
            if attribute.name in ("value_float", "value_floats"):
                values = attribute.f if attribute.name == "value_float" else list(attribute.floats)
                node.attribute.remove(attribute)
                node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(
                    np.asarray(values, np.float32))))
    elif node.op_type == "ConstantOfShape" and "value" not in names:
        node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(np.zeros(1, np.float32))))
    elif node.op_type in _FLOAT_BY_DEFAULT and _FLOAT_BY_DEFAULT[node.op_type] not in names:
        node.attribute.append(onnx.helper.make_attribute(_FLOAT_BY_DEFAULT[node.op_type], TensorProto.FLOAT))


def _promote_tensor(tensor: onnx.TensorProto) -> None:
    if tensor.data_type == TensorProto.FLOAT:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))


def _promote_value_type(value_type: onnx.TypeProto) -> None:
    kind = value_type.WhichOneof("value")
    if kind == "tensor_type" and value_type.tensor_type.elem_type == TensorProto.FLOAT:
        value_type.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _promote_value_type(value_type.sequence_type.elem_type)
    elif kind == "optional_type":
        _promote_value_type(value_type.optional_type.elem_type)
