"""BatchStats on CPU in one read of x: per channel, the sum and the sum of squares around a shift, together.

The target-neutral rule (lowering/grad.py) takes the mean, then the mean of the squares around it: two reads of x
(ResNet-18's stem activations at batch 32 are 103 MB a read). Here one block reads each element once and adds
both d = x − K and d² to per-lane partial sums, where K, the shift, is the channel's first element; then

    mean = K + S₁ / count,    variance = S₂ / count − (S₁ / count)².

The shift is what keeps this accurate: K is a sample of the channel, so S₁ / count is of the order of the standard
deviation, and the subtraction loses no more digits than the two-pass form when |mean| is many standard deviations
(around zero instead, E[x²] − E[x]² would cancel catastrophically). A first element m standard deviations from the
mean costs about m² in the variance's relative error: an outlier shift loses digits the two-pass form keeps.

The partials are per (channel, image, lane): the lanes split each image's plane (H·W) in `lanes` interleaved
parts, so the inner loop is one vector of both sums and the plane is read in order; they are added up per channel
in the channel's loop. Channels run in parallel.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .schedule import lanes_for, try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx


def _sum_pair(a, b):
    return a[0] + b[0], a[1] + b[1]


def _zero_pair(t0, t1):
    return tir.const(0, t0), tir.const(0, t1)


SUM_PAIR = te.comm_reducer(_sum_pair, _zero_pair, name="sum_pair")


def applies(ctx: LowerContext) -> bool:
    """Whether this kernel runs the BatchStats: CPU, float32 (else the target-neutral rule)."""
    return not ctx.gpu and str(ctx.input(0).dtype) == "float32"


def batch_stats(ctx: LowerContext) -> SelfScheduled:
    """(mean, biased variance) of each channel of x (N, C, ...), kept as (1, C, 1, ...), with its schedule."""
    x = ctx.input(0)
    shape = [int(d) for d in x.shape]
    n, c, rest = shape[0], shape[1], shape[2:]
    plane = 1
    for d in rest:
        plane *= d
    lanes = lanes_for(plane) or 1
    count = n * plane
    flat = te.compute((n, c, plane), lambda ni, ci, p: x[(ni, ci, *_unflatten(p, rest))], name="stats_flat")

    def d(ni, ci, p):
        return flat[ni, ci, p] - flat[0, ci, 0]

    k = te.reduce_axis((0, plane // lanes), name="k")
    part = te.compute(
        (c, n, lanes),
        lambda ci, ni, lane: SUM_PAIR((d(ni, ci, k * lanes + lane), _square(d(ni, ci, k * lanes + lane))), axis=k),
        name="stats_part")
    images = te.reduce_axis((0, n), name="images")
    lane_axis = te.reduce_axis((0, lanes), name="lanes")
    totals = te.compute(
        (c,),
        lambda ci: SUM_PAIR((part[0][ci, images, lane_axis], part[1][ci, images, lane_axis]),
                            axis=[images, lane_axis]),
        name="stats_total")
    scale = tir.const(1.0 / count, x.dtype)
    kept = [1, c] + [1] * len(rest)

    def mean_body(_, ci, *__):
        return flat[0, ci, 0] + totals[0][ci] * scale

    def var_body(_, ci, *__):
        centre = totals[0][ci] * scale
        variance = totals[1][ci] * scale - centre * centre
        # Clamped at 0 (rounding), but NaN stays NaN as in the generic rule: max would turn it into 0.
        return tir.Select(tir.isnan(variance), variance, tir.max(variance, tir.const(0.0, x.dtype)))

    mean = te.compute(kept, mean_body, name="stats_mean")
    var = te.compute(kept, var_body, name="stats_var")

    def schedule(sch) -> None:
        sch.compute_inline(sch.get_sblock("stats_flat"))
        block = sch.get_sblock("stats_part")
        channel, image, lane, inner = sch.get_loops(block)
        sch.reorder(channel, image, inner, lane)
        try_step(lambda: sch.parallel(channel))
        if lanes > 1:
            try_step(lambda: sch.vectorize(lane))
        try_step(lambda: sch.decompose_reduction(block, inner))
        for name in ("stats_total", "stats_mean", "stats_var"):
            try_step(lambda b=sch.get_sblock(name): sch.reverse_compute_at(b, channel))

    return SelfScheduled([mean, var], schedule)


def _unflatten(p, sizes):
    """The row-major indices of flat position p in an array of `sizes`."""
    indices = []
    for size in reversed(sizes):
        indices.append(p % size)
        p = p // size
    return list(reversed(indices))


def _square(v):
    return v * v
