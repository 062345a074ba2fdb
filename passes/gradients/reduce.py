"""Gradient rules of reductions (Reduce*): the output gradient is broadcast back over the reduced axes."""
from __future__ import annotations

import math

from tessel.ir.graph import Node, Value

from .builder import GradBuilder, Grads, Rule, const_ints


def reduced_axes(node: Node) -> list[int]:
    """The axes a Reduce* node reduces, normalized and sorted ([] when it passes its input through)."""
    rank = node.inputs[0].type.rank
    axes = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
    if not axes:
        return [] if node.attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    return sorted({a % rank for a in axes})


def _kept(b: GradBuilder, node: Node, value: Value, axes: list[int]) -> Value:
    """A reduction result (or its gradient) reshaped to keepdims form, ready to broadcast against the input."""
    shape = [1 if i in axes else d for i, d in enumerate(node.inputs[0].type.shape)]
    return b.reshape(value, shape)


def _reduce(weight):
    """A rule for Reduce ops: dx = broadcast(dy) * weight(b, node, x, y_kept, axes) (None: weight 1)."""
    def build(b: GradBuilder, node: Node, grads: Grads) -> Grads:
        x = node.inputs[0]
        axes = reduced_axes(node)
        dy = b.expand(_kept(b, node, grads[0], axes), x.type.shape)
        if weight is not None:
            dy = b.mul(dy, weight(b, node, x, _kept(b, node, node.outputs[0], axes), axes))
        return [dy] + [None] * (len(node.inputs) - 1)
    return build


def _mean_weight(b, node, x, y, axes):
    return b.scalar(1.0 / math.prod(x.type.shape[a] for a in axes), x)


def _sum_square_weight(b, node, x, y, axes):
    return b.mul(x, b.scalar(2.0, x))


def _l2_weight(b, node, x, y, axes):
    return b.div(x, y)


def _log_sum_exp_weight(b, node, x, y, axes):
    return b.op("Exp", [b.sub(x, y)])


def _extremum_weight(b, node, x, y, axes):
    # Ties share the gradient evenly, as torch.amax / amin.
    hit = b.cast(b.op("Equal", [x, y]), x.type.dtype)
    return b.div(hit, b.reduce_sum(hit, axes, keepdims=True))


RULES: dict[str, Rule] = {
    "ReduceSum": Rule(_reduce(None)),
    "ReduceMean": Rule(_reduce(_mean_weight)),
    "ReduceSumSquare": Rule(_reduce(_sum_square_weight)),
    "ReduceL2": Rule(_reduce(_l2_weight)),
    "ReduceLogSumExp": Rule(_reduce(_log_sum_exp_weight)),
    "ReduceMax": Rule(_reduce(_extremum_weight)),
    "ReduceMin": Rule(_reduce(_extremum_weight)),
}
