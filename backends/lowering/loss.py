"""Loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (with its optional log-probability output).

Both pick, for each sample (and each position of its extra axes), the log-probability of its target class,
weighted by the class weight; a target equal to `ignore_index` contributes nothing, neither to the sum nor
to the mean's divisor (the sum of the weights picked).
"""
from __future__ import annotations

from ..tvm_env import tvm
from .context import LowerContext
from .reduce import log_softmax

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx


def _negative_log_likelihood(ctx: LowerContext, log_prob, target, weight, output: int = 0):
    classes = int(log_prob.shape[1])
    ignore = ctx.attr("ignore_index")
    dtype = log_prob.dtype
    zero = tir.const(0, dtype)

    def pick(index):
        t = target[index]
        valid = tir.const(True, "bool") if ignore is None else t != tir.const(ignore, t.dtype)
        safe = tir.Select(valid, tir.max(tir.min(t, classes - 1), 0), tir.const(0, t.dtype))
        w = weight[safe] if weight is not None else tir.const(1, dtype)
        return valid, safe, w

    def loss(*index):
        valid, safe, w = pick(index)
        return tir.Select(valid, -log_prob[(index[0], safe) + tuple(index[1:])] * w, zero)

    def picked_weight(*index):
        valid, _, w = pick(index)
        return tir.Select(valid, w, zero)

    losses = te.compute(target.shape, loss, name="nll")
    reduction = ctx.attr("reduction", "mean")
    if reduction == "none":
        return losses
    total = topi.sum(losses)
    if reduction == "sum":
        return total
    return topi.divide(total, topi.sum(te.compute(target.shape, picked_weight, name="nll_weight")))


def _nll_loss(ctx: LowerContext):
    return [_negative_log_likelihood(ctx, ctx.input(0), ctx.input(1), ctx.input(2))]


def _softmax_cross_entropy(ctx: LowerContext):
    log_prob = log_softmax(ctx.input(0), 1)
    loss = _negative_log_likelihood(ctx, log_prob, ctx.input(1), ctx.input(2))
    wants_log_prob = len(ctx.output_types) > 1 and ctx.output_types[1] is not None
    return [loss, log_prob] if wants_log_prob else [loss]


RULES = {
    "NegativeLogLikelihoodLoss": _nll_loss,
    "SoftmaxCrossEntropyLoss": _softmax_cross_entropy,
}
