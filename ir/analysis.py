"""Whole-graph summaries: op histogram, parameters, FLOPs, activation memory lower bound."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .costs import bytes_moved, flops
from .graph import Graph
from .op_traits import op_traits


def op_histogram(graph: Graph) -> Counter:
    """Node count per op type, subgraphs included ("domain::Op" outside the default domain)."""
    return Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in graph.walk_nodes())


def total_flops(graph: Graph) -> int:
    """FLOPs of one run of the main graph (each If counts its costlier branch)."""
    return sum(flops(node) for node in graph.nodes)


def total_bytes_moved(graph: Graph) -> int:
    """Bytes read and written by the main graph's nodes, each tensor crossing memory once per node."""
    return sum(bytes_moved(node) for node in graph.nodes)


@dataclass(frozen=True)
class ConstantStats:
    """How many constants the graph holds, their elements and bytes."""

    count: int
    elements: int
    bytes: int


def constant_stats(graph: Graph) -> ConstantStats:
    """Totals over the constants of the graph and its subgraphs."""
    values = list(graph.constants) + [v for n in graph.walk_nodes() for sub in n.subgraphs() for v in sub.constants]
    return ConstantStats(len(values), sum(v.type.numel for v in values), sum(v.type.nbytes for v in values))


@dataclass(frozen=True)
class LiveMemory:
    """Peak bytes of activations alive at once when nodes run in graph order."""

    peak_bytes: int
    peak_node: str | None


def max_live_bytes(graph: Graph) -> LiveMemory:
    """The activation-memory lower bound of running `graph` in its topological order.

    Inputs live from the start, each node output from its node to its last reader
    (graph outputs to the end); constants are weights, not activations. At each
    node its inputs and outputs are live together.
    """
    last_use: dict[int, int] = {}
    for index, node in enumerate(graph.nodes):
        for value in node.dependencies():
            last_use[id(value)] = index
    end = len(graph.nodes)
    for value in graph.outputs:
        last_use[id(value)] = end
    live = {id(v): v.type.nbytes for v in graph.inputs}
    for value in graph.inputs:
        last_use.setdefault(id(value), -1)
    current = sum(live.values())
    peak, peak_node = current, None
    for index, node in enumerate(graph.nodes):
        for out in node.outputs:
            if out is not None:
                live[id(out)] = out.type.nbytes
                current += out.type.nbytes
        if current > peak:
            peak, peak_node = current, node.name
        for key in [k for k in live if last_use.get(k, index) <= index]:
            current -= live.pop(key)
    return LiveMemory(peak, peak_node)


def weight_derived(graph: Graph) -> set[int]:
    """ids of the values that are weights or computed from weights alone."""
    derived: set[int] = set()
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.is_constant:
                derived.add(id(v))
        inputs = [v for v in node.inputs if v is not None]
        if inputs and op_traits(node.op_type).deterministic and all(id(v) in derived for v in inputs):
            derived.update(id(v) for v in node.outputs if v is not None)
    return derived
