"""The table of lowering rules, by op type."""
from __future__ import annotations

from . import conv_transpose, elementwise, grad, loss, nn, optimizer, ordering, pool, reduce, rnn, scatter, simple_rnn, tensor

RULES = {**elementwise.RULES, **tensor.RULES, **reduce.RULES, **nn.RULES, **rnn.RULES, **scatter.RULES,
         **grad.RULES, **conv_transpose.RULES, **optimizer.RULES, **pool.RULES, **loss.RULES,
         **ordering.RULES, **simple_rnn.RULES}
_STATIC = {**tensor.STATIC_INPUTS, **reduce.STATIC_INPUTS, **rnn.STATIC_INPUTS, **ordering.STATIC_INPUTS,
           **simple_rnn.STATIC_INPUTS}


def supports(op_type: str) -> bool:
    """True when `op_type` has a lowering rule."""
    return op_type in RULES


def static_inputs(op_type: str) -> frozenset[int]:
    """Input positions the op needs as compile-time data (never kernel arguments)."""
    return frozenset(_STATIC.get(op_type, ()))
