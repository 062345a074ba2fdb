"""Gradient rules of the Tessel-domain collectives: AllReduce (a data-parallel replica's synchronised statistics).

y = AllReduce_sum(x) over R replicas is y = S x with S the R×R matrix of ones acting across replicas, and the
mean's matrix is S / R: both are symmetric, so the gradient of every replica's x is the same AllReduce of the
output gradients, as torch.nn.SyncBatchNorm's backward all-reduces its sum_dy and sum_dy_xmu. Max and min
route the gradient to one replica's value and have no rule.
"""
from __future__ import annotations

from tessel.ir.graph import Node
from tessel.ir.schema import TESSEL_DOMAIN

from .builder import GradBuilder, Grads, Rule

# Reductions whose gradient is the same reduction of the output gradient.
_LINEAR = ("sum", "mean")


def _all_reduce(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    return [b.op("AllReduce", [grads[0]], domain=TESSEL_DOMAIN, reduction=node.attrs["reduction"])]


def _all_reduce_unsupported(node: Node) -> str | None:
    reduction = node.attrs["reduction"]
    return None if reduction in _LINEAR else f"reduction '{reduction}'"


RULES: dict[str, Rule] = {
    "AllReduce": Rule(_all_reduce, _all_reduce_unsupported),
}
