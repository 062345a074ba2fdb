"""JSON round trip of graphs: `to_json` and `from_json`.

Constants and tensor attributes are stored inline as base64 of their raw
little-endian bytes; no pickle anywhere. `to_json(graph, tensor_data=False)`
writes only their names and types: a description of the graph (an artifact's
graph.json, whose weights live in its weights files), which `from_json` refuses.
"""
from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from .errors import SerializationError
from .graph import Graph, Value
from .schema import get_schema
from .types import TensorType, numpy_dtype

FORMAT = "tessel.graph"
VERSION = 1


def to_json(graph: Graph, tensor_data: bool = True) -> str:
    """The graph as a JSON document; without `tensor_data`, constants and tensor attributes keep only their types."""
    doc = {"format": FORMAT, "version": VERSION, "graph": _graph_dict(graph, tensor_data)}
    if not tensor_data:
        doc["tensor_data"] = False
    return json.dumps(doc, separators=(",", ":"))


def from_json(text: str) -> Graph:
    """Read a graph written by `to_json`; raise SerializationError when the document is malformed."""
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise SerializationError(f"not a {FORMAT} v{VERSION} document")
        if doc.get("tensor_data", True) is not True:
            raise SerializationError(f"this {FORMAT} document was written without tensor data: it describes the "
                                     "graph (names, types, nodes) but cannot be read back into one")
        return _read_graph(doc["graph"], None)
    except SerializationError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SerializationError(f"malformed {FORMAT} document: {type(exc).__name__}: {exc}") from exc


def _array_dict(array: np.ndarray, tensor_data: bool) -> dict[str, Any]:
    if not tensor_data:
        return {"type": TensorType.of(array).spec()}
    return {"type": TensorType.of(array).spec(), "data": base64.b64encode(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()).decode()}


def _read_array(doc: dict[str, Any]) -> np.ndarray:
    t = TensorType.parse(doc["type"])
    raw = base64.b64decode(doc["data"])
    return np.frombuffer(raw, dtype=numpy_dtype(t.dtype).newbyteorder("<")).reshape(t.shape).astype(numpy_dtype(t.dtype))


def _graph_dict(graph: Graph, tensor_data: bool) -> dict[str, Any]:
    return {
        "name": graph.name,
        "inputs": [{"name": v.name, "type": v.type.spec()} for v in graph.inputs],
        "constants": [{"name": v.name, **_array_dict(v.const, tensor_data)} for v in graph.constants],
        "nodes": [
            {
                "name": n.name,
                "op_type": n.op_type,
                "domain": n.domain,
                "inputs": [v.name if v is not None else None for v in n.inputs],
                "outputs": [{"name": v.name, "type": v.type.spec()} if v is not None else None for v in n.outputs],
                "attrs": {k: _attr_dict(v, tensor_data) for k, v in n.attrs.items()},
            }
            for n in graph.nodes
        ],
        "outputs": [v.name for v in graph.outputs],
    }


def _attr_dict(value: Any, tensor_data: bool) -> Any:
    if isinstance(value, Graph):
        return {"graph": _graph_dict(value, tensor_data)}
    if isinstance(value, np.ndarray):
        return {"tensor": _array_dict(value, tensor_data)}
    return value


def _read_graph(doc: dict[str, Any], parent: Graph | None) -> Graph:
    graph = Graph(doc["name"], parent=parent)
    for v in doc["inputs"]:
        _add_named(graph, graph.add_input(v["name"], TensorType.parse(v["type"])), v["name"])
    for c in doc["constants"]:
        _add_named(graph, graph.add_constant(c["name"], _read_array(c)), c["name"])
    for n in doc["nodes"]:
        schema = get_schema(n["op_type"], n["domain"])
        if schema is None:
            raise SerializationError(f"node '{n['name']}': unknown op {n['domain']}::{n['op_type']}")
        attrs = {k: _read_attr(v, graph) for k, v in n["attrs"].items()}
        inputs = [_lookup(graph, name, n["name"]) if name is not None else None for name in n["inputs"]]
        outs = n["outputs"]
        node = graph.add_node(
            n["op_type"], inputs, schema.make_attributes(attrs, n["name"]),
            [TensorType.parse(o["type"]) if o is not None else None for o in outs],
            name=n["name"], output_names=[o["name"] if o is not None else "" for o in outs], domain=n["domain"],
        )
        for value, o in zip(node.outputs, outs):
            if value is not None:
                _add_named(graph, value, o["name"])
    graph.outputs = [_lookup(graph, name, "graph outputs") for name in doc["outputs"]]
    return graph


def _read_attr(value: Any, graph: Graph) -> Any:
    if isinstance(value, dict) and "graph" in value:
        return _read_graph(value["graph"], graph)
    if isinstance(value, dict) and "tensor" in value:
        return _read_array(value["tensor"])
    return value


def _add_named(graph: Graph, value: Value, name: str) -> None:
    if value.name != name:
        raise SerializationError(f"value name '{name}' is defined twice")


def _lookup(graph: Graph, name: str, where: str) -> Value:
    value = graph.lookup(name)
    if value is None:
        raise SerializationError(f"{where}: reads '{name}', which is not defined before it")
    return value
