"""A node's TVM-style op pattern (ir/op_traits.py's Pattern), which decides what fuses.

The op type gives the pattern (`OpTraits.pattern`); the node refines it: an
elementwise op that broadcasts is BROADCAST, and a node with several outputs,
subgraphs or a domain is opaque.
"""
from __future__ import annotations

from tessel.ir.graph import Node
from tessel.ir.op_traits import Pattern, op_traits


def pattern(node: Node) -> Pattern:
    """The node's pattern; nodes with several outputs, subgraphs or a domain are opaque."""
    if node.domain or node.subgraphs() or sum(1 for v in node.outputs if v is not None) != 1:
        return Pattern.OPAQUE
    op = node.op_type
    if op == "Dropout" and len(node.outputs) == 1:
        return Pattern.INJECTIVE
    op_pattern = op_traits(op).pattern
    if op_pattern == Pattern.ELEMWISE:
        shape = node.outputs[0].type.shape
        same = all(v is None or v.type.shape == shape or v.type.numel == 1 for v in node.inputs)
        return Pattern.ELEMWISE if same else Pattern.BROADCAST
    return op_pattern
