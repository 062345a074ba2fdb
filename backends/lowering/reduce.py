"""Reductions over axes, arg-reductions, softmax family.

Max and Min reductions are NaN when any reduced element is, as NumPy's and ONNX's
reference are: TVM's max and min keep whichever operand their comparison picks,
so a NaN survived or vanished depending on where it fell in the reduction order.
"""
from __future__ import annotations

from ..tvm_env import tvm
from .context import REDUCTION_LANES, ROW_REDUCTION_MIN, LowerContext
from .elementwise import _exp

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx


def _axes(ctx: LowerContext) -> list[int] | None:
    """Normalized reduction axes; None means all axes, [] means no reduction."""
    rank = len(ctx.input(0).shape)
    data = ctx.data(1)
    if data is None or data.size == 0:
        return [] if ctx.attr("noop_with_empty_axes", 0) else None
    return sorted({int(a) + rank if a < 0 else int(a) for a in data.reshape(-1)})


def _nan_keeping(prefer):
    """Combine of a reduction that keeps `acc` when `prefer(acc, value)` holds or acc is NaN, else `value`: a NaN
    on either side wins in any order, at the cost of one compare and one select per lane."""
    return lambda acc, value: tir.Select(tir.any(prefer(acc, value), tir.isnan(acc)), acc, value)


def _self_unequal_keeping(prefer):
    """`_nan_keeping` for bfloat16, whose NaN TVM's isnan does not take: NaN is the value unequal to itself."""
    return lambda acc, value: tir.Select(tir.any(prefer(acc, value), acc != acc), acc, value)


def lowest(dtype):
    """The value below every other of `dtype`: -inf for floats (the type's finite minimum would win over -inf)."""
    return tir.const(float("-inf"), dtype) if str(dtype).startswith("float") else tir.min_value(dtype)


def highest(dtype):
    """The value above every other of `dtype`: +inf for floats."""
    return tir.const(float("inf"), dtype) if str(dtype).startswith("float") else tir.max_value(dtype)


_NAN_MAX_COMBINE = _nan_keeping(lambda a, b: a > b)
_NAN_MIN_COMBINE = _nan_keeping(lambda a, b: a < b)
NAN_MAX = te.comm_reducer(_NAN_MAX_COMBINE, lowest, name="nan_max")
NAN_MIN = te.comm_reducer(_NAN_MIN_COMBINE, highest, name="nan_min")
_COMBINES = {NAN_MAX: _NAN_MAX_COMBINE, NAN_MIN: _NAN_MIN_COMBINE}
_BF16 = {
    NAN_MAX: te.comm_reducer(_self_unequal_keeping(lambda a, b: a > b), lowest, name="nan_max_bf16"),
    NAN_MIN: te.comm_reducer(_self_unequal_keeping(lambda a, b: a < b), highest, name="nan_min_bf16"),
}


def nan_reduce(reducer, x, axes: list[int] | None, keep: bool):
    """`reducer` (NAN_MAX or NAN_MIN) over `axes` (None: all), the reduced axes kept as size-1 dimensions or dropped."""
    if str(x.dtype) == "bool":  # TVM compares no bools: reduce them as 0/1 bytes
        return topi.cast(nan_reduce(reducer, topi.cast(x, "int8"), axes, keep), "bool")
    if str(x.dtype) == "bfloat16":
        reducer = _BF16[reducer]
    rank = len(x.shape)
    axes = list(range(rank)) if axes is None else axes
    if reducer in _COMBINES and axes == [rank - 1] and int(x.shape[-1]) >= ROW_REDUCTION_MIN:
        return _lane_split_last(reducer, x, keep)
    reduce_axes = {a: te.reduce_axis((0, x.shape[a]), name=f"r{a}") for a in axes}
    kept = [d for d in range(rank) if d not in reduce_axes]

    def body(*index):
        out_index = dict(zip(range(rank), index)) if keep else dict(zip(kept, index))
        at = [reduce_axes[d] if d in reduce_axes else out_index[d] for d in range(rank)]
        return reducer(x[tuple(at)], axis=list(reduce_axes.values()))

    shape = [1 if d in reduce_axes else x.shape[d] for d in range(rank)] if keep else [x.shape[d] for d in kept]
    return te.compute(shape, body, name="nan_reduce")


def _lane_split_last(reducer, x, keep: bool):
    """`reducer` over the last axis as REDUCTION_LANES partial results, element j of a row going to partial
    j % REDUCTION_LANES, then across the partials and the row's last few elements. Schedules vectorize the partials
    over their lane axis; TVM's rfactor, which would split the lanes off in a schedule, does not know a NaN-keeping
    select."""
    lanes = REDUCTION_LANES
    lead = [int(d) for d in x.shape[:-1]]
    whole, rest = divmod(int(x.shape[-1]), lanes)
    c = te.reduce_axis((0, whole), name="rc")
    partial = te.compute(lead + [lanes], lambda *i: reducer(x[i[:-1] + (c * lanes + i[-1],)], axis=c),
                         name="nan_reduce_lanes")
    lane = te.reduce_axis((0, lanes), name="rl")
    rows = te.compute(lead, lambda *i: reducer(partial[i + (lane,)], axis=lane), name="nan_reduce_rows")
    if rest:
        t = te.reduce_axis((0, rest), name="rt")
        tail = te.compute(lead, lambda *i: reducer(x[i + (whole * lanes + t,)], axis=t), name="nan_reduce_tail")
        combine, across = _COMBINES[reducer], rows
        rows = te.compute(lead, lambda *i: combine(across[i], tail[i]), name="nan_reduce_join")
    if not keep:
        return rows
    return te.compute(lead + [1], lambda *i: rows[i[:-1]], name="nan_reduce")


def _reduce(combine):
    def rule(ctx: LowerContext):
        x = ctx.input(0)
        axes = _axes(ctx)
        if axes == []:
            return [topi.identity(x)]
        keep = bool(ctx.attr("keepdims", 1))
        return [combine(x, axes, keep, ctx)]

    return rule


def _count(x, axes) -> int:
    dims = [int(d) for d in x.shape]
    total = 1
    for axis in (axes if axes is not None else range(len(dims))):
        total *= dims[axis]
    return total


def _mean(x, axes, keep, ctx):
    return topi.divide(topi.sum(x, axes, keep), tir.const(_count(x, axes), x.dtype))


RULES = {
    "ReduceSum": _reduce(lambda x, a, k, c: topi.sum(x, a, k)),
    "ReduceMean": _reduce(_mean),
    "ReduceMax": _reduce(lambda x, a, k, c: nan_reduce(NAN_MAX, x, a, k)),
    "ReduceMin": _reduce(lambda x, a, k, c: nan_reduce(NAN_MIN, x, a, k)),
    "ReduceProd": _reduce(lambda x, a, k, c: topi.prod(x, a, k)),
    "ReduceL1": _reduce(lambda x, a, k, c: topi.sum(topi.abs(x), a, k)),
    "ReduceL2": _reduce(lambda x, a, k, c: topi.sqrt(topi.sum(topi.multiply(x, x), a, k))),
    "ReduceSumSquare": _reduce(lambda x, a, k, c: topi.sum(topi.multiply(x, x), a, k)),
    "ReduceLogSum": _reduce(lambda x, a, k, c: topi.log(topi.sum(x, a, k))),
    "ReduceLogSumExp": _reduce(lambda x, a, k, c: _log_sum_exp(x, a, k)),
}


def _log_sum_exp(x, axes, keep):
    peak = topi.max(x, axes, True)
    total = topi.sum(topi.exp(topi.subtract(x, peak)), axes, True)
    out = topi.add(topi.log(total), peak)
    if keep:
        return out
    return topi.squeeze(out, axes if axes is not None else None)


def _arg(kind):
    def rule(ctx: LowerContext):
        x = ctx.input(0)
        rank = len(x.shape)
        axis = ctx.attr("axis", 0)
        axis = axis + rank if axis < 0 else axis
        keep = bool(ctx.attr("keepdims", 1))
        fn = topi.argmax if kind == "max" else topi.argmin
        if not ctx.attr("select_last_index", 0):
            return [topi.cast(fn(x, axis=axis, keepdims=keep), "int64")]
        # TOPI picks the first extreme: on the reversed axis that is the last one, counted from the end.
        first_from_end = topi.cast(fn(topi.flip(x, axis), axis=axis, keepdims=keep), "int64")
        return [topi.subtract(tir.const(int(x.shape[axis]) - 1, "int64"), first_from_end)]

    return rule


def log_softmax(x, axis: int):
    """log(softmax(x)) along `axis`, from the shifted values (no log of an underflowed exp)."""
    shifted = topi.subtract(x, topi.max(x, axis, True))
    return topi.subtract(shifted, topi.log(topi.sum(_exp(shifted), axis, True)))


def _wide_sum(x, axis: int):
    """Sum along `axis` (kept), a float16 one accumulated in float32 and rounded once, as ONNX's reference does."""
    if str(x.dtype) != "float16":
        return topi.sum(x, axis, True)
    return topi.cast(topi.sum(topi.cast(x, "float32"), axis, True), "float16")


def _softmax(log: bool):
    def rule(ctx: LowerContext):
        x = ctx.input(0)
        rank = len(x.shape)
        axis = ctx.attr("axis", -1)
        axis = axis + rank if axis < 0 else axis
        if log:
            return [log_softmax(x, axis)]
        # One exp, stored (it feeds the sum) and read back by the division, instead of one per use.
        exps = _exp(topi.subtract(x, topi.max(x, axis, True)))
        return [topi.divide(exps, _wide_sum(exps, axis))]

    return rule


def _hardmax(ctx: LowerContext):
    """1 at the first maximum along `axis`, 0 elsewhere."""
    x = ctx.input(0)
    rank = len(x.shape)
    axis = ctx.attr("axis", -1)
    axis = axis + rank if axis < 0 else axis
    first = topi.argmax(x, axis=axis, keepdims=True)
    one, zero = tir.const(1, x.dtype), tir.const(0, x.dtype)
    return [te.compute(x.shape, lambda *i: tir.Select(
        i[axis] == first[i[:axis] + (0,) + i[axis + 1:]], one, zero), name="hardmax")]


def _lp_normalization(ctx: LowerContext):
    """x / ||x||_p along `axis` (p = 1 or 2); a zero norm gives 0, as ONNX's reference does."""
    x = ctx.input(0)
    rank = len(x.shape)
    axis = ctx.attr("axis", -1)
    axis = axis + rank if axis < 0 else axis
    p = ctx.attr("p", 2)
    if p not in (1, 2):
        raise ctx.fail(f"p={p} (only 1 and 2 are ONNX's)")
    norm = topi.sum(topi.abs(x), axis, True) if p == 1 else topi.sqrt(topi.sum(topi.multiply(x, x), axis, True))
    zero = tir.const(0, x.dtype)
    return [te.compute(x.shape, lambda *i: tir.Select(
        norm[i[:axis] + (0,) + i[axis + 1:]] == zero, zero, x[i] / norm[i[:axis] + (0,) + i[axis + 1:]]),
        name="lp_normalization")]


RULES.update({
    "Hardmax": _hardmax,
    "LpNormalization": _lp_normalization,
    "ArgMax": _arg("max"),
    "ArgMin": _arg("min"),
    "Softmax": _softmax(False),
    "LogSoftmax": _softmax(True),
})

STATIC_INPUTS = {op: {1} for op in RULES if op.startswith("Reduce")}
