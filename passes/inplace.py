"""Which inputs a kernel may overwrite with its output (in-place candidates for the memory planner).

A kernel can write its output over input x when every output element is
computed from x's element at the same position only, and x is read nowhere
else in the kernel: x is read only by elementwise ops of the output's shape,
and every op downstream of those is elementwise or broadcast with the output's
shape. A conv's residual Add qualifies (the epilogue reads x[i] and then
writes out[i]); x feeding the conv itself does not. An optimizer update
(ir/optimizer_ops.py) computes each of its outputs element by element from the
parameter and its slots at the same position, read before anything is written:
each output may overwrite the input it is the next value of.
"""
from __future__ import annotations

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import Pattern
from tessel.ir.optimizer_ops import NEXT_VALUE_OF
from tessel.ir.schema import FUSED, TESSEL_DOMAIN

from .op_patterns import pattern


def inplace_pairs(node: Node) -> list[tuple[int, int]]:
    """(output, input) positions among the node's outputs and inputs: the output may reuse the input's buffer."""
    if node.domain == TESSEL_DOMAIN and node.op_type in NEXT_VALUE_OF:
        return [(k, position) for k, position in enumerate(NEXT_VALUE_OF[node.op_type])
                if k < len(node.outputs) and _candidate(node.inputs[position], node.outputs[k])]
    written = [o for o, value in enumerate(node.outputs) if value is not None]
    return [(written[0], k) for k in _inplace_inputs(node)] if len(written) == 1 else []


def _inplace_inputs(node: Node) -> list[int]:
    """Positions of the node's inputs whose buffer its (single) output may reuse."""
    outs = [v for v in node.outputs if v is not None]
    if len(outs) != 1:
        return []
    out = outs[0]
    if node.domain == TESSEL_DOMAIN and node.op_type == FUSED:
        body: Graph = node.attrs["body"]
        return [k for k, (param, outer) in enumerate(zip(body.inputs, node.inputs))
                if _candidate(outer, out) and _elementwise_path(body, param)]
    if node.domain or pattern(node) != Pattern.ELEMWISE:
        return []
    return [k for k, value in enumerate(node.inputs) if value is not None and _candidate(value, out)
            and node.inputs.index(value) == k]


def _candidate(value: Value | None, out: Value) -> bool:
    return value is not None and not value.is_constant and value.type == out.type


def _elementwise_path(body: Graph, param: Value) -> bool:
    """True when `param` reaches the body's result only through same-shaped elementwise ops."""
    result = body.outputs[0]
    shape = result.type.shape
    reached = {id(param)}
    for node in body.nodes:
        reads = [k for k, v in enumerate(node.inputs) if v is not None and id(v) in reached]
        if not reads:
            continue
        kind = pattern(node)
        out = node.outputs[0]
        if kind > Pattern.BROADCAST or out.type.shape != shape:
            return False
        if any(node.inputs[k].type.shape != shape for k in reads):
            return False
        reached.add(id(out))
    return id(result) in reached
