"""ONNX export: `to_onnx` writes a Tessel graph as an ONNX model at the canonical opset.

The export is the numerical oracle for every pass (run it in onnxruntime and
compare) and the way to look at Tessel's graphs in Netron.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .graph import Graph, Node
from .onnx_export_shapes import without_contradicted_dims
from .onnx_proto import attribute_proto, tensor_proto, type_proto
from .schema import CANONICAL_OPSET, FUSED, TESSEL_DOMAIN, get_schema
from .types import numpy_dtype

# ir_version 10 is what ONNX writes for opset 21.
IR_VERSION = 10


# Fused groups (tessel::Fused) are exported as model-local ONNX functions in this domain.
FUSED_DOMAIN = "tessel.fused"


def to_onnx(graph: Graph) -> onnx.ModelProto:
    """The graph as an ONNX model (opset 21) that passes onnx.checker and runs in onnxruntime.

    Each fused group becomes a call of a model-local function holding its ops.
    """
    functions = [_function_proto(node) for node in graph.walk_nodes() if _is_fused(node)]
    opsets = [helper.make_opsetid("", CANONICAL_OPSET)]
    if functions:
        opsets.append(helper.make_opsetid(FUSED_DOMAIN, 1))
    model = helper.make_model(
        _graph_proto(graph, is_main=True),
        opset_imports=opsets,
        producer_name="tessel",
        ir_version=IR_VERSION,
        functions=functions,
    )
    return without_contradicted_dims(model)


def _is_fused(node: Node) -> bool:
    return node.domain == TESSEL_DOMAIN and node.op_type == FUSED


def _function_proto(node: Node) -> onnx.FunctionProto:
    body: Graph = node.attrs["body"]
    # Functions have no initializers: the body's constants become Constant nodes.
    nodes = [helper.make_node("Constant", [], [v.name], value=tensor_proto("", v.const)) for v in body.constants]
    nodes += [proto for member in body.nodes for proto in _node_protos(member)]
    return helper.make_function(
        FUSED_DOMAIN, node.name, [v.name for v in body.inputs], [v.name for v in body.outputs], nodes,
        opset_imports=[helper.make_opsetid("", CANONICAL_OPSET)],
    )


def _graph_proto(graph: Graph, is_main: bool) -> onnx.GraphProto:
    nodes = [proto for node in graph.nodes for proto in _node_protos(node)]
    constant_names = {v.name: v.name for v in graph.constants}
    fresh = _FreshNames(graph)
    outputs = []
    returned: set[int] = set()
    for value in graph.outputs:
        name = value.name
        # ONNX wants each graph output to be a distinct tensor computed inside the graph.
        if value.producer is None or value.graph is not graph or id(value) in returned:
            source = value.name
            identity_at = len(nodes)
            if value.is_constant and value.graph is graph and id(value) not in returned:
                # The initializer is renamed and the Identity gives the old name: it runs first,
                # since nodes may read the constant.
                source = constant_names[value.name] = fresh(f"{value.name}__value")
                identity_at = 0
            else:
                name = fresh(f"{value.name}_out")
            nodes.insert(identity_at, helper.make_node("Identity", [source], [name], name=fresh(f"{name}_identity")))
        returned.add(id(value))
        outputs.append(helper.make_value_info(name, type_proto(value.type)))
    initializers = [tensor_proto(constant_names[v.name], v.const) for v in graph.constants]
    inputs = [helper.make_value_info(v.name, type_proto(v.type)) for v in graph.inputs]
    value_info = [
        helper.make_value_info(out.name, type_proto(out.type))
        for node in graph.nodes for out in node.outputs if out is not None and not out.is_graph_output
    ]
    return helper.make_graph(nodes, graph.name, inputs, outputs, initializers, value_info=value_info)


class _FreshNames:
    """Names unused in the graph's scope tree and among those already handed out."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.given: set[str] = set()

    def __call__(self, base: str) -> str:
        name, k = base, 0
        while name in self.given or self.graph.unique_name(name) != name:
            k += 1
            name = f"{base}_{k}"
        self.given.add(name)
        return name


def _node_protos(node: Node) -> list[onnx.NodeProto]:
    inputs = [v.name if v is not None else "" for v in node.inputs]
    outputs = [v.name if v is not None else "" for v in node.outputs]
    if node.domain == TESSEL_DOMAIN and node.op_type == "Unreachable":
        return _unreachable_protos(node, outputs)
    if _is_fused(node):
        return [helper.make_node(node.name, inputs, outputs, name=node.name, domain=FUSED_DOMAIN)]
    if node.domain == TESSEL_DOMAIN and node.op_type == "Send":
        return []
    if node.domain == TESSEL_DOMAIN and node.op_type == "Recv":
        # A placed graph exports as the single-device computation: a Recv reads the tensor sent.
        return [helper.make_node("Identity", [node.attrs["tensor"]], outputs, name=node.name)]
    schema = get_schema(node.op_type, node.domain)
    proto = helper.make_node(node.op_type, inputs, outputs, name=node.name, domain=node.domain)
    proto.attribute.extend(
        attribute_proto(name, schema.attributes[name].kind, value, lambda g: _graph_proto(g, is_main=False))
        for name, value in node.attrs.items()
    )
    return [proto]


def _unreachable_protos(node: Node, outputs: list[str]) -> list[onnx.NodeProto]:
    """ONNX has no op that fails on purpose: gather index 1 of a one-element tensor, which
    type-checks but fails when run, then broadcast it to each output's shape."""
    protos = []
    for out, name in zip(node.outputs, outputs):
        if out is None:
            continue
        dtype = numpy_dtype(out.type.dtype)
        prefix = f"{node.name}_{name}"
        protos += [
            helper.make_node("Constant", [], [f"{prefix}_one"], value=tensor_proto("", np.zeros([1], dtype))),
            helper.make_node("Constant", [], [f"{prefix}_index"], value=tensor_proto("", np.array(1, np.int64))),
            helper.make_node("Constant", [], [f"{prefix}_shape"], value=tensor_proto("", np.asarray(out.type.shape, np.int64))),
            helper.make_node("Gather", [f"{prefix}_one", f"{prefix}_index"], [f"{prefix}_fail"]),
            helper.make_node("Expand", [f"{prefix}_fail", f"{prefix}_shape"], [name], name=f"{prefix}_expand"),
        ]
    return protos
