"""Variadic ops with many inputs become a balanced tree of the same op, each node with at most MAX_FAN_IN inputs.

Concat, Sum, Max, Min and Mean take any number of inputs, and one kernel with
thousands of arguments overwhelms TVM: its lowering recurses once per input (a
Concat of 1,500 inputs overflows the stack) and its compile time grows faster
than the input count. Split into groups of at most MAX_FAN_IN inputs, level by
level, the op computes the same values (Concat keeps the order; Sum, Max and
Min are associative) and every level compiles to the same few kernels. Mean
becomes a tree of Sums divided by the input count, as ONNX defines it.
"""
from __future__ import annotations

import numpy as np

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.types import numpy_dtype

from .base import Pass, PassResult, add_op, graphs_in, retire

# 32 inputs compile in about a second (a Concat of 64 takes twice that, of 256 twenty times).
MAX_FAN_IN = 32
SPLIT_OPS = frozenset({"Concat", "Sum", "Max", "Min", "Mean"})


def split_variadic(graph: Graph, max_fan_in: int = MAX_FAN_IN) -> PassResult:
    """Replace every variadic op with more than `max_fan_in` inputs by a tree of bounded fan-in."""
    if max_fan_in < 2:
        raise ValueError(f"max_fan_in={max_fan_in}: a tree needs at least 2 inputs per node")
    split = added = 0
    for g in graphs_in(graph):
        for node in list(g.nodes):
            if node.op_type in SPLIT_OPS and not node.domain and len(node.inputs) > max_fan_in:
                added += _split(g, node, max_fan_in)
                split += 1
    return PassResult(graph, split > 0, {"ops_split": split, "nodes_added": added})


def _split(graph: Graph, node: Node, max_fan_in: int) -> int:
    """Build the tree before `node` and retire it; the number of nodes added."""
    inner = "Sum" if node.op_type == "Mean" else node.op_type
    attrs = {"axis": node.attrs["axis"]} if node.op_type == "Concat" else {}
    level: list[Value] = list(node.inputs)
    added = 0
    while len(level) > max_fan_in:
        groups = _balanced(level, -(-len(level) // max_fan_in))
        level = [add_op(graph, inner, group, attrs, before=node,
                        name=graph.unique_node_name(f"{node.name}/tree")).outputs[0] if len(group) > 1 else group[0]
                 for group in groups]
        added += sum(len(group) > 1 for group in groups)
    root = add_op(graph, inner, level, attrs, before=node, name=graph.unique_node_name(f"{node.name}/root"))
    added += 1
    result = root.outputs[0]
    if node.op_type == "Mean":
        count = graph.add_constant(graph.unique_name(f"{node.name}/count"),
                                   np.asarray(len(node.inputs), dtype=numpy_dtype(result.type.dtype)))
        result = add_op(graph, "Div", [result, count], before=node, name=graph.unique_node_name(f"{node.name}/mean")).outputs[0]
        added += 1
    retire(node, {0: result})
    return added


def _balanced(values: list[Value], groups: int) -> list[list[Value]]:
    """`values` in order, cut into `groups` runs whose lengths differ by at most one."""
    size, extra = divmod(len(values), groups)
    runs, start = [], 0
    for index in range(groups):
        end = start + size + (index < extra)
        runs.append(values[start:end])
        start = end
    return runs


SPLIT_VARIADIC = Pass("split_variadic", split_variadic)
