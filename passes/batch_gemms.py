"""Independent Gemms of a few rows that share one constant weight become one Gemm over all their rows.

A recurrence unrolled by hand (captcha_crnn's LSTMCell loop, exported step by
step) projects each step's input with its own Gemm: a [1, 4096] row times the
same [400, 4096] weight, twenty times per direction. Each of those products
reads the whole 6.5 MB weight for 1.6 M multiply-adds, so it runs at the speed
of memory. None of them depends on another (only the recurrent product does),
so their rows can be stacked: Concat the inputs along axis 0, one Gemm reads the
weight once for all of them, and a Split hands each old consumer its rows.

A group is the Gemms with the same constant B, the same C (constant or absent,
one row broadcast to all) and the same attributes, transA = 0, each with at most SMALL_ROWS rows; a member
whose input depends on another member's output starts a later group (stacked
with it, it would wait on itself).
"""
from __future__ import annotations

import numpy as np

from tessel.ir.graph import Graph, Node

from .base import Pass, PassResult, add_op, graphs_in, retire

# Rows of A up to which a Gemm reads its whole weight for little work (a matrix-vector product, or nearly):
# stacking such rows saves a weight read per member; bigger products already reuse each weight row.
SMALL_ROWS = 16


def batch_gemms(graph: Graph) -> PassResult:
    """Stack the rows of every group of independent small Gemms that share a constant weight into one Gemm."""
    groups = stacked = 0
    for g in graphs_in(graph):
        batches = [batch for members in _candidates(g).values() if len(members) > 1
                   for batch in _independent_batches(g, members)]
        for batch in batches:
            _stack(g, batch)
            groups += 1
            stacked += len(batch)
        if batches:
            g.topological_sort()
    return PassResult(graph, groups > 0, {"gemm_groups": groups, "gemms_stacked": stacked})


def _candidates(graph: Graph) -> dict[tuple, list[Node]]:
    """The Gemms that may stack, by what they must share (weight, bias, attributes), in graph order."""
    found: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        if node.op_type != "Gemm" or node.domain or node.attrs["transA"]:
            continue
        a, b = node.inputs[0], node.inputs[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if a.is_constant or not b.is_constant or (c is not None and not c.is_constant):
            continue
        if c is not None and len(c.type.shape) == 2 and c.type.shape[0] != 1:
            continue  # a bias per row does not broadcast over the stacked rows
        if len(a.type.shape) != 2 or a.type.shape[0] > SMALL_ROWS:
            continue
        key = (id(b), id(c) if c is not None else None, node.attrs["alpha"], node.attrs["beta"],
               node.attrs["transB"], str(a.type.dtype))
        found.setdefault(key, []).append(node)
    return found


def _independent_batches(graph: Graph, members: list[Node]) -> list[list[Node]]:
    """`members` (in graph order) cut into batches of two or more, none of whose inputs depends on another's
    output; first fit in graph order."""
    bit = {id(node): 1 << i for i, node in enumerate(members)}
    # Per node: the members it depends on (itself included), one bit each, in one sweep of the graph order.
    reach: dict[int, int] = {}
    for node in graph.nodes:
        mask = bit.get(id(node), 0)
        for value in node.dependencies():
            if value.producer is not None:
                mask |= reach.get(id(value.producer), 0)
        reach[id(node)] = mask
    left, batches = list(members), []
    while len(left) > 1:
        batch, taken, rest = [], 0, []
        for node in left:
            producer = node.inputs[0].producer
            needs = reach.get(id(producer), 0) if producer is not None else 0
            if needs & taken:
                rest.append(node)
            else:
                batch.append(node)
                taken |= bit[id(node)]
        if len(batch) > 1:
            batches.append(batch)
        left = rest
    return batches


def _stack(graph: Graph, batch: list[Node]) -> None:
    """One Gemm over the rows of `batch` (Concat before, Split after), placed before the first member; the
    caller sorts the graph again."""
    first = batch[0]
    prefix = f"{first.name}/stacked"
    rows = [node.inputs[0].type.shape[0] for node in batch]
    stacked = add_op(graph, "Concat", [node.inputs[0] for node in batch], {"axis": 0}, before=first,
                     name=graph.unique_node_name(f"{prefix}/rows")).outputs[0]
    attrs = {key: first.attrs[key] for key in ("alpha", "beta", "transA", "transB")}
    product = add_op(graph, "Gemm", [stacked, *first.inputs[1:]], attrs, before=first,
                     name=graph.unique_node_name(prefix)).outputs[0]
    # Equal parts split without sizes, which would hold this batch's row counts: a graph rebatched to another batch
    # (ir/rebatch.py) then splits its own rows evenly.
    sizes = [] if len(set(rows)) == 1 else [graph.add_constant(graph.unique_name(f"{prefix}/sizes"),
                                                                np.asarray(rows, np.int64))]
    split = {"axis": 0} if sizes else {"axis": 0, "num_outputs": len(batch)}
    parts = add_op(graph, "Split", [product, *sizes], split, before=first, num_outputs=len(batch),
                   name=graph.unique_node_name(f"{prefix}/split")).outputs
    for node, part in zip(batch, parts):
        retire(node, {0: part})


BATCH_GEMMS = Pass("batch_gemms", batch_gemms)
