"""Common-subexpression elimination by value numbering.

Two nodes compute the same values when they have the same op, the same typed
attributes and the same input value numbers (sorted for commutative ops);
constants get the same number when their type and bytes are equal. The later
node is replaced by the earlier. Side-effecting, nondeterministic and
subgraph-holding nodes are never merged.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import op_traits

from .base import Pass, PassResult, can_replace, graphs_in, is_pure, retire

def _attr_key(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ("tensor", str(value.dtype), value.shape, hashlib.sha256(value.tobytes()).hexdigest())
    if isinstance(value, float) and value != value:  # NaN attributes still compare equal to themselves
        return ("nan",)
    return value


def _constant_key(value: Value) -> tuple:
    return ("const", value.type.spec(), hashlib.sha256(np.ascontiguousarray(value.const).tobytes()).hexdigest())


class _Numbering:
    def __init__(self) -> None:
        self.numbers: dict[int, int] = {}
        self.by_key: dict[Any, int] = {}
        self.values: dict[int, Value] = {}

    def number(self, value: Value | None) -> int:
        if value is None:
            return -1
        if id(value) not in self.numbers:
            key = _constant_key(value) if value.is_constant else ("value", id(value))
            number = self.by_key.setdefault(key, len(self.by_key))
            self.values.setdefault(number, value)
            self.numbers[id(value)] = number
        return self.numbers[id(value)]


def _node_key(node: Node, numbering: _Numbering) -> tuple:
    inputs = [numbering.number(v) for v in node.inputs]
    if op_traits(node.op_type).commutative and not node.domain:
        inputs.sort()
    attrs = tuple(sorted((name, _attr_key(value)) for name, value in node.attrs.items()))
    outputs = tuple(v.type.spec() if v is not None else None for v in node.outputs)
    return (node.domain, node.op_type, tuple(inputs), attrs, outputs)


def cse(graph: Graph) -> PassResult:
    """Merge nodes that compute the same values and constants that hold the same data."""
    merged_nodes = merged_constants = 0
    for g in graphs_in(graph):
        numbering = _Numbering()
        for value in list(g.constants):
            first = numbering.values[numbering.number(value)]
            if first is not value and can_replace(value, first) and not value.is_graph_output:
                g.replace_all_uses_with(value, first)
                g.remove_constant(value)
                merged_constants += 1
        seen: dict[tuple, Node] = {}
        for node in list(g.nodes):
            if not is_pure(node):
                continue
            key = _node_key(node, numbering)
            first = seen.get(key)
            if first is None:
                seen[key] = node
                continue
            pairs = [(old, new) for old, new in zip(node.outputs, first.outputs) if old is not None]
            if not all(can_replace(old, new) for old, new in pairs):
                continue
            retire(node, {i: first.outputs[i] for i, old in enumerate(node.outputs) if old is not None})
            merged_nodes += 1
    return PassResult(graph, bool(merged_nodes or merged_constants), {"nodes_merged": merged_nodes, "constants_merged": merged_constants})


CSE = Pass("cse", cse)
