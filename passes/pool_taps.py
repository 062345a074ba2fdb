"""Pool taps: a training step's MaxPool keeps where each window's maximum was, and its gradient scatters through it.

Autodiff differentiates MaxPool(x) into MaxPoolGrad(x, dy), which searches every window of x again for its
first maximum in the backward. Where the forward MaxPool with the same window reads the same x, this pass
makes the forward a MaxPoolWithTaps(x) -> (y, taps), whose second output is each window's first-maximum tap
(int32, row-major within the window), and the gradient MaxPoolTapsGrad(taps, dy): PyTorch's backward through
stored indices. The step then keeps taps (the pool output's size, int32) for the backward instead of x (four
times as large for a 3x3 stride-2 pool) when nothing else keeps x. Ties and NaN go to the same element as
MaxPoolGrad's (the first maximum, NaN counting as maximum), so the gradient is unchanged.

It does not fire for a MaxPoolGrad without such a forward pool (GlobalMaxPool's, or a graph that holds only the
backward), for a pool whose Indices output is read, or for one that runs after the gradient.
"""
from __future__ import annotations

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.schema import TESSEL_DOMAIN

from .base import Pass, PassResult, add_op, graphs_in, retire
from .gradients.nn import window_attrs

_GRAD = "MaxPoolGrad"
_FORWARD = "MaxPoolWithTaps"
_TAPS_GRAD = "MaxPoolTapsGrad"


def _explicit(attrs, rank: int) -> tuple:
    """A window's attributes with every default filled in, for comparing two windows."""
    return (tuple(attrs["kernel_shape"]), tuple(attrs.get("strides") or (1,) * rank),
            tuple(attrs.get("pads") or (0,) * (2 * rank)), tuple(attrs.get("dilations") or (1,) * rank),
            int(attrs.get("ceil_mode", 0) or 0))


def _forward_window(node: Node, x: Value) -> tuple | None:
    """The explicit window of a MaxPool (or an already rewritten MaxPoolWithTaps) over x; None for other nodes and
    for a MaxPool whose Indices output is read."""
    rank = x.type.rank - 2
    if node.op_type == _FORWARD and node.domain == TESSEL_DOMAIN:
        return _explicit(node.attrs, rank)
    if node.op_type != "MaxPool" or node.domain:
        return None
    indices = node.outputs[1] if len(node.outputs) > 1 else None
    if indices is not None and (indices.uses or indices.is_graph_output):
        return None
    window = window_attrs(node, x, node.outputs[0], list(node.attrs["kernel_shape"]))
    return _explicit({**window, "ceil_mode": node.attrs.get("ceil_mode", 0)}, rank)


def _forward_of(grad: Node, position: dict[int, int]) -> Node | None:
    """The pool before `grad` that reads its x with its window and makes a value of dy's type."""
    x, dy = grad.inputs
    wanted = _explicit(grad.attrs, x.type.rank - 2)
    for node, _ in x.uses:
        if (node.graph is grad.graph and position.get(id(node), len(position)) < position[id(grad)]
                and node.outputs[0].type == dy.type and _forward_window(node, x) == wanted):
            return node
    return None


def _with_taps(graph: Graph, pool: Node) -> Node:
    """`pool` as a MaxPoolWithTaps (itself when it already is one)."""
    if pool.op_type == _FORWARD:
        return pool
    x = pool.inputs[0]
    kernel, strides, pads, dilations, ceil_mode = _forward_window(pool, x)
    attrs = dict(kernel_shape=list(kernel), strides=list(strides), pads=list(pads), dilations=list(dilations),
                 ceil_mode=ceil_mode)
    node = add_op(graph, _FORWARD, [x], attrs, name=graph.unique_node_name(f"{pool.name}/taps"), before=pool,
                  num_outputs=2, domain=TESSEL_DOMAIN)
    retire(pool, {0: node.outputs[0]})
    return node


def pool_taps(graph: Graph) -> PassResult:
    """Rewrite each MaxPoolGrad whose forward MaxPool is in the graph into MaxPoolWithTaps + MaxPoolTapsGrad."""
    rewritten = 0
    for g in graphs_in(graph):
        grads = [n for n in g.nodes if n.op_type == _GRAD and n.domain == TESSEL_DOMAIN]
        if not grads:
            continue
        position = {id(n): i for i, n in enumerate(g.nodes)}
        for grad in grads:
            pool = _forward_of(grad, position)
            if pool is None:
                continue
            forward = _with_taps(g, pool)
            position[id(forward)] = position[id(pool)]
            x, dy = grad.inputs
            attrs = {k: v for k, v in grad.attrs.items() if v is not None}
            new = add_op(g, _TAPS_GRAD, [forward.outputs[1], dy], {**attrs, "input_shape": list(x.type.shape)},
                         name=g.unique_node_name(f"{grad.name}/taps"), before=grad, domain=TESSEL_DOMAIN)
            retire(grad, {0: new.outputs[0]})
            rewritten += 1
    return PassResult(graph, bool(rewritten), {"pools_keeping_taps": rewritten})


POOL_TAPS = Pass("pool_taps", pool_taps)
