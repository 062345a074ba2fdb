"""Pools through a channel Concat: Pool(Concat(a, b, ...)) becomes Concat(Pool(a), Pool(b), ...).

A 2-D pool maps each channel on its own, so pooling the concatenation along the channels is the concatenation
of the pooled parts, value for value. Fused, the Concat sat inside the pool's kernel as a select per element
between its inputs, which TVM's vectorizer does not hoist: SqueezeNet 1.1's two MaxPools over a fire module's
Concat ran at 6 GFLOP/s (0.145 and 0.091 ms, OpenVINO 0.016 and 0.008). Split, each pool reads one conv's
result, which passes/conv_layout.py then keeps in NCHW[16]c for a MaxPool (the blocked pool kernel), and the
Concat copies the pooled values: a quarter of the data. The average and global pools are split alike (measured
only where a MaxPool is).

It fires for a MaxPool (its Indices output unread), AveragePool, GlobalAveragePool or GlobalMaxPool over a 4-D
Concat along axis 1 that nothing else reads. Not for a Concat along another axis (the windows would cross its
parts), nor one read elsewhere (a training step's backward reads it: the Concat would stay and the pools double).
"""
from __future__ import annotations

from tessel.ir.graph import Graph, Node

from .base import Pass, PassResult, add_op, graphs_in, retire, single_user

CHANNEL_POOLS = frozenset({"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"})
CHANNELS = 1


def pool_concat(graph: Graph) -> PassResult:
    """Move every pool that reads a channel Concat (and nothing else reads that Concat) before the Concat."""
    moved = 0
    for g in graphs_in(graph):
        for node in list(g.nodes):
            if node.graph is g and _channel_pool_of_concat(node):
                _move(g, node)
                moved += 1
    return PassResult(graph, moved > 0, {"pools_moved": moved})


def _channel_pool_of_concat(pool: Node) -> bool:
    """Whether `pool` is a per-channel pool of a 4-D Concat along the channels that only `pool` reads."""
    if pool.domain or pool.op_type not in CHANNEL_POOLS or not pool.inputs or pool.inputs[0] is None:
        return False
    if any(out is not None and (out.uses or out.is_graph_output) for out in pool.outputs[1:]):
        return False
    concat = pool.inputs[0].producer
    if concat is None or concat.domain or concat.op_type != "Concat" or concat.graph is not pool.graph:
        return False
    rank = concat.outputs[0].type.rank
    return (rank == 4 and concat.attrs["axis"] % rank == CHANNELS and single_user(concat.outputs[0]) is pool
            and all(v is not None for v in concat.inputs))


def _move(graph: Graph, pool: Node) -> None:
    """One pool per Concat input, their results concatenated in the same order, in place of `pool`."""
    concat = pool.inputs[0].producer
    attrs = dict(pool.attrs)
    pooled = [add_op(graph, pool.op_type, [part], attrs, before=pool,
                     name=graph.unique_node_name(f"{pool.name}/part{index}")).outputs[0]
              for index, part in enumerate(concat.inputs)]
    joined = add_op(graph, "Concat", pooled, {"axis": CHANNELS}, before=pool,
                    name=graph.unique_node_name(f"{concat.name}/pooled"))
    retire(pool, {0: joined.outputs[0]})


POOL_CONCAT = Pass("pool_concat", pool_concat)
