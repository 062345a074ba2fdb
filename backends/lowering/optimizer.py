"""The optimizer update ops (ir/optimizer_ops.py): SGDUpdate and AdamWUpdate.

Each is one elementwise compute with several outputs (the new parameter and its new slots), so one loop nest
reads the parameter, its gradient and its slots once and writes every result: one kernel per parameter. Every
operand has the parameter's shape, so the compute is marked to run as one flat loop (FLAT_LOOPS_ATTR), vectorized
and parallel even when the innermost axis is short (a 3x3 conv filter's). The arithmetic is the one
ir/optimizer_ops.py spells out for the numpy reference, built here on TIR expressions.
"""
from __future__ import annotations

from tessel.ir.optimizer_ops import adamw_update, sgd_update

from ..tvm_env import tvm
from .context import FLAT_LOOPS_ATTR, LowerContext

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx


def _scalar(tensor, dtype: str):
    """A 0-d input's value in the parameter's type."""
    value = tensor[()]
    return value if str(tensor.dtype) == dtype else value.astype(dtype)


def _update(ctx: LowerContext, tensors: list[int], scalars: list[int], arithmetic, name: str):
    """One compute over the parameter's shape whose outputs are those of `arithmetic(attrs, elements, scalar
    values, const)`, given the positions of the tensor inputs (read elementwise) and of the scalar inputs."""
    dtype = ctx.out_dtype()
    values = [_scalar(ctx.input(k), dtype) for k in scalars]

    def const(number: float):
        return tir.const(number, dtype)

    def body(*index):
        results = arithmetic(ctx.attrs, [ctx.input(k)[index] for k in tensors], values, const)
        return [r for r in results if r is not None]

    outputs = te.compute(ctx.out_shape(), body, name=name, attrs={FLAT_LOOPS_ATTR: 1})
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def sgd_update_rule(ctx: LowerContext):
    """(param'[, momentum_buffer']): torch.optim.SGD's update, elementwise."""
    # Inputs: param, grad, lr[, momentum_buffer[, grad_coef]].
    count = len(ctx.inputs)
    tensors = [0, 1] + ([3] if count > 3 else [])
    scalars = [2] + ([4] if count > 4 else [])

    def arithmetic(attrs, elements, scalar_values, const):
        param, grad, *buffer = elements
        lr, *grad_coef = scalar_values
        return sgd_update(attrs, param, grad, lr, buffer[0] if buffer else None,
                          grad_coef[0] if grad_coef else None, const=const)

    return _update(ctx, tensors, scalars, arithmetic, "sgd_update")


def adamw_update_rule(ctx: LowerContext):
    """(param', exp_avg', exp_avg_sq'): torch.optim.AdamW's update, elementwise."""

    def arithmetic(attrs, elements, scalar_values, const):
        return adamw_update(attrs, *elements, *scalar_values, sqrt=tir.sqrt, const=const)

    return _update(ctx, [0, 1, 2, 3], list(range(4, len(ctx.inputs))), arithmetic, "adamw_update")


RULES = {
    "SGDUpdate": sgd_update_rule,
    "AdamWUpdate": adamw_update_rule,
}
