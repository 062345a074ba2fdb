"""A readable text form of a graph, one line per node."""
from __future__ import annotations

import numpy as np

from .graph import Graph, Node, Value

_INDENT = "  "


def format_graph(graph: Graph, indent: str = "") -> str:
    """The graph as text: signature, constants, one node per line, subgraphs nested."""
    inputs = ", ".join(_decl(v) for v in graph.inputs)
    outputs = ", ".join(f"%{v.name}" for v in graph.outputs)
    lines = [f"{indent}graph {graph.name}({inputs}) {{"]
    body = indent + _INDENT
    for value in graph.constants:
        lines.append(f"{body}const {_decl(value)}{_preview(value.const)}")
    for node in graph.nodes:
        lines.extend(_format_node(node, body))
    lines.append(f"{body}return {outputs}")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def _decl(value: Value) -> str:
    return f"%{value.name}: {value.type}"


def _preview(array: np.ndarray) -> str:
    if array.size > 8:
        return ""
    return " = " + np.array2string(array.reshape(-1) if array.ndim else array, separator=",", threshold=8)


def _format_node(node: Node, indent: str) -> list[str]:
    outs = ", ".join(_decl(v) if v is not None else "_" for v in node.outputs)
    ins = ", ".join(f"%{v.name}" if v is not None else "_" for v in node.inputs)
    op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
    plain = {k: v for k, v in node.attrs.items() if not isinstance(v, Graph)}
    attrs = " {" + ", ".join(f"{k}={_attr(v)}" for k, v in plain.items()) + "}" if plain else ""
    lines = [f"{indent}{outs} = {op}({ins}){attrs}  # {node.name}"]
    for key, value in node.attrs.items():
        if isinstance(value, Graph):
            lines.append(f"{indent}{_INDENT}{key}:")
            lines.append(format_graph(value, indent + _INDENT * 2))
    return lines


def _attr(value) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(_attr(v) for v in value) + "]"
    if isinstance(value, np.ndarray):
        return f"tensor<{value.dtype}{list(value.shape)}>"
    if isinstance(value, str):
        return repr(value)
    return str(value)
