"""GlobalAveragePool on CPU: each channel's plane summed in vector lanes, the channels in parallel.

The target-neutral rule (lowering/nn.py) sums a plane over its two spatial axes, one element after another: a
scalar chain the generic schedule does not vectorize (its row reductions are along one axis, and a 13-pixel row
is shorter than a vector). Here the plane (H·W contiguous floats) is read as one row: LANES partial sums, one
per lane, take every LANES-th element of its whole vectors (a plane of ACCUMULATE_FROM elements or more: 4 × LANES
in 4 vector accumulators, whose adds do not wait on each other), then the partials and the plane's last elements
(fewer than the partials) are added up and divided by H·W, once per channel. Measured in topology_squeezenet
(1000 × 13 × 13, min of 450 runs in the program, interleaved): 0.026 ms with the generic rule, 0.004 ms here.
"""
from __future__ import annotations

from ..lowering.context import MIN_PARALLEL_WORK, LowerContext, SelfScheduled
from ..tvm_env import tvm
from .schedule import try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

LANES = 16
# From this plane size (elements) the lanes are four vectors: one vector's adds each wait on the one before.
ACCUMULATE_FROM = 1024
ACCUMULATORS = 4


def applies(ctx: LowerContext) -> bool:
    """Whether this kernel runs here: CPU, float32, a 4-D (N, C, H, W) input whose plane fills two vectors (with
    one, the partial sums' loop has a single step, which TVM drops, and the schedule no longer finds its loops)."""
    x = ctx.input(0)
    return (not ctx.gpu and str(x.dtype) == "float32" and len(x.shape) == 4
            and int(x.shape[2]) * int(x.shape[3]) >= 2 * LANES)


def global_average_pool(ctx: LowerContext) -> SelfScheduled:
    """The mean of each (image, channel) plane of x (N, C, H, W), kept as (N, C, 1, 1), with its schedule."""
    x = ctx.input(0)
    n, c, h, w = (int(d) for d in x.shape)
    plane = h * w
    lanes = LANES * (ACCUMULATORS if plane >= ACCUMULATE_FROM else 1)
    whole = plane // lanes * lanes
    flat = te.compute((n, c, plane), lambda ni, ci, p: x[ni, ci, p // w, p % w], name="pool_flat")
    k = te.reduce_axis((0, plane // lanes), name="k")
    part = te.compute((n, c, lanes), lambda ni, ci, lane: te.sum(flat[ni, ci, k * lanes + lane], axis=k),
                      name="pool_part")
    # The partial sums, then the plane's last plane % lanes elements: one reduction, reading each once.
    r = te.reduce_axis((0, lanes + plane - whole), name="r")
    total = te.compute((n, c), lambda ni, ci: te.sum(
        tir.if_then_else(r < lanes, part[ni, ci, tir.min(r, lanes - 1)], flat[ni, ci, whole + r - lanes]), axis=r),
        name="pool_total")
    out = te.compute((n, c, 1, 1), lambda ni, ci, _, __: total[ni, ci] / tir.const(plane, x.dtype), name="pool_mean")

    def schedule(sch) -> None:
        sch.compute_inline(sch.get_sblock("pool_flat"))
        image, channel, _ = sch.get_loops(sch.get_sblock("pool_total"))
        channels = sch.fuse(image, channel)
        if n * c * plane >= MIN_PARALLEL_WORK:
            sch.parallel(channels)
        # The partial sums per channel, in the channel's loop (computed at its consumer: moved after it instead, the
        # total's reduction would shrink to the lanes it reads there).
        block = sch.get_sblock("pool_part")
        sch.compute_at(block, channels)
        lane, inner = sch.get_loops(block)[-2:]
        vectors, lane = sch.split(lane, [None, LANES])
        sch.reorder(inner, vectors, lane)
        sch.unroll(vectors)
        sch.vectorize(lane)
        init = sch.decompose_reduction(block, inner)
        try_step(lambda: sch.vectorize(sch.get_loops(init)[-1]))
        sch.reverse_compute_at(sch.get_sblock("pool_mean"), channels)

    return SelfScheduled([out], schedule)
