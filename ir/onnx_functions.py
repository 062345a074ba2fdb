"""Ops newer than the canonical opset that ONNX defines as functions: imported as their function bodies.

Attention, RMSNormalization, RotaryEmbedding (opset 23), Swish (24), SwiGLU (28), ... are defined by ONNX
as a graph of older ops. Tessel has no kernels of its own for them: a node of such an op is replaced by
the nodes of its function body (the form onnxruntime's "expanded" tests use), which import as usual.
Context-dependent functions (whose body depends on the input types) are built from the node's inputs.
"""
from __future__ import annotations

from typing import Sequence

import onnx
from onnx import defs


def _schema(op_type: str, opset: int) -> defs.OpSchema | None:
    try:
        return defs.get_schema(op_type, opset, "")
    except defs.SchemaError:
        return None


def _newest_at(versions: Sequence[int], opset: int) -> int | None:
    usable = [v for v in versions if v <= opset]
    return max(usable) if usable else None


def has_function(op_type: str, opset: int) -> bool:
    """Whether ONNX defines the op's version at `opset` (of the default domain) as a function."""
    schema = _schema(op_type, opset)
    if schema is None:
        return False
    return (_newest_at(schema.function_opset_versions, opset) is not None
            or _newest_at(schema.context_dependent_function_opset_versions, opset) is not None)


def plain_function_body(op_type: str, opset: int) -> onnx.FunctionProto | None:
    """The op's function body at `opset` when it does not depend on the input types, else None."""
    schema = _schema(op_type, opset)
    version = _newest_at(schema.function_opset_versions, opset) if schema is not None else None
    if version is None:
        return None
    return onnx.FunctionProto.FromString(schema.get_function_with_opset_version(version))


def function_body(node: onnx.NodeProto, opset: int, input_types: Sequence[onnx.TypeProto]) -> onnx.FunctionProto:
    """The function body of `node` (with its attributes and its inputs' types) at `opset`."""
    plain = plain_function_body(node.op_type, opset)
    if plain is not None:
        return plain
    schema = defs.get_schema(node.op_type, opset, "")
    version = _newest_at(schema.context_dependent_function_opset_versions, opset)
    text = schema.get_context_dependent_function_with_opset_version(
        version, with_default_attributes(node, opset).SerializeToString(), [t.SerializeToString() for t in input_types])
    return onnx.FunctionProto.FromString(text)


def with_default_attributes(node: onnx.NodeProto, opset: int) -> onnx.NodeProto:
    """A copy of `node` that also holds every attribute its schema gives a default and the node leaves out."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    given = {a.name for a in node.attribute}
    for name, attr in defs.get_schema(node.op_type, opset, "").attributes.items():
        if name not in given and attr.default_value.type:
            default = onnx.AttributeProto()
            default.CopyFrom(attr.default_value)
            default.name = name
            copy.attribute.append(default)
    return copy


def expand(node: onnx.NodeProto, function: onnx.FunctionProto, opset: int, prefix: str) -> list[onnx.NodeProto]:
    """The nodes of `function` wired to `node`'s inputs and outputs, internal values named `prefix`/name, and
    attributes that refer to the node's attributes (ref_attr_name) given their values (left out when unset)."""
    attributes = {a.name: a for a in with_default_attributes(node, opset).attribute}
    names = {formal: (node.input[k] if k < len(node.input) else "") for k, formal in enumerate(function.input)}
    names.update({formal: node.output[k] for k, formal in enumerate(function.output)
                  if k < len(node.output) and node.output[k]})

    def rename(name: str) -> str:
        return names.get(name, f"{prefix}/{name}") if name else ""

    nodes = []
    for index, inner in enumerate(function.node):
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in inner.attribute):
            raise ValueError(f"the function body of {node.op_type} holds a subgraph ({inner.op_type}), "
                             "which Tessel does not expand")
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        copy.name = f"{prefix}/{inner.name or f'{inner.op_type}_{index}'}"
        copy.input[:] = [rename(n) for n in inner.input]
        copy.output[:] = [rename(n) for n in inner.output]
        del copy.attribute[:]
        for attr in inner.attribute:
            if not attr.ref_attr_name:
                copy.attribute.append(attr)
            elif attr.ref_attr_name in attributes:
                value = onnx.AttributeProto()
                value.CopyFrom(attributes[attr.ref_attr_name])
                value.name = attr.name
                copy.attribute.append(value)
        nodes.append(copy)
    return nodes
