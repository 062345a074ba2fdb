"""Ops that depend on element order along an axis: CumSum and TopK."""
from __future__ import annotations

from ..tvm_env import tvm
from .context import LowerContext

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx


def _axis(value: int, rank: int) -> int:
    return value + rank if value < 0 else value


def _cumsum(ctx: LowerContext):
    """Running sums along `axis` (exclusive: without the element itself; reverse: from the end), as one
    reduction over the axis per output element (the axes node tests and models sum over are short)."""
    x = ctx.input(0)
    rank = len(x.shape)
    axis = _axis(int(ctx.require_data(1).reshape(-1)[0]), rank)
    length = int(x.shape[axis])
    exclusive, reverse = bool(ctx.attr("exclusive", 0)), bool(ctx.attr("reverse", 0))
    k = te.reduce_axis((0, length), name="k")
    zero = tir.const(0, x.dtype)

    def body(*index):
        i = index[axis]
        taken = (k > i if exclusive else k >= i) if reverse else (k < i if exclusive else k <= i)
        return te.sum(tir.Select(taken, x[index[:axis] + (k,) + index[axis + 1:]], zero), axis=k)

    return [te.compute(x.shape, body, name="cumsum")]


def _top_k(ctx: LowerContext):
    """The k largest (or smallest) values along `axis` and their indices, sorted; ties keep the lower index.

    Each element's rank is how many elements come before it in that order; output r takes the element of
    rank r (TOPI's topk does not build in this TVM)."""
    x = ctx.input(0)
    axis = _axis(ctx.attr("axis", -1), len(x.shape))
    k = int(ctx.require_data(1).reshape(-1)[0])
    length = int(x.shape[axis])
    largest = bool(ctx.attr("largest", 1))
    at = lambda index, position: index[:axis] + (position,) + index[axis + 1:]  # noqa: E731
    m = te.reduce_axis((0, length), name="m")

    def rank(*index):
        j = index[axis]
        value, other = x[index], x[at(index, m)]
        before = tir.any(other > value if largest else other < value, tir.all(other == value, m < j))
        return te.sum(tir.Select(before, 1, 0), axis=m)

    ranks = te.compute(x.shape, rank, name="topk_rank")
    out_shape = at(tuple(x.shape), k)
    j = te.reduce_axis((0, length), name="j")
    values = te.compute(out_shape, lambda *index: te.sum(tir.Select(
        ranks[at(index, j)] == index[axis], x[at(index, j)], tir.const(0, x.dtype)), axis=j), name="topk_values")
    j2 = te.reduce_axis((0, length), name="j2")
    indices = te.compute(out_shape, lambda *index: te.sum(tir.Select(
        ranks[at(index, j2)] == index[axis], tir.Cast("int64", j2), tir.const(0, "int64")), axis=j2), name="topk_indices")
    return [values, indices]


RULES = {
    "CumSum": _cumsum,
    "TopK": _top_k,
}
STATIC_INPUTS = {"CumSum": {1}, "TopK": {1}}
