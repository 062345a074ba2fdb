"""Grouped 2-D conv (1 < group, not depthwise) as one register-tiled GEMM per group, vectorized over pixels.

Per group g the conv is the product out[g] (Kg × P) = W[g] (Kg × Cg·R·S) · cols[g]
(Cg·R·S × P), P = OH·OW. Groups rarely have channel counts that fill 16-lane
vectors (ShuffleNet's 34 or 68 channels per group), so the vector runs along the
pixels instead: each register tile is `rows` output channels × `vectors`·16
pixels, accumulated in registers over the group's reduction. Weights come
packed at compile time as (G, Kg'/rows, Cg·R·S, rows), Kg' being Kg rounded up to
whole row tiles with zero rows, so a tile's `rows` weights of one reduction step
are adjacent. The input is unfolded into (N, G, Cg·R·S, P') columns (P' = P
rounded up to whole tiles; for a 1×1 stride-1 conv a plain copy), and the
bias/activation epilogue is applied as NCHW is written.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .packing import GROUPED_LAYOUT
from .schedule import MIN_PARALLEL_WORK, schedule_rows, try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

LANES = 16
# Pixels per tile: two vectors once there are enough pixels to fill them, else one.
TWO_VECTORS_FROM = 128
# The pointwise kernel's register tile: at most this many accumulator registers (of 32) and vectors of pixels.
TILE_REGISTERS = 24
MAX_TILE_VECTORS = 4


def conv_grouped(ctx: LowerContext, before, after):
    """Grouped conv of x (N, C, H, W) with weights packed by `pack_grouped_weight`, plus the optional bias."""
    x, wp, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    rows, r, s = ctx.attr(GROUPED_LAYOUT)
    groups = ctx.attr("group")
    n, c, h, wd = (int(d) for d in x.shape)
    _, k, oh, ow = ctx.out_shape()
    _, tiles, depth, _ = (int(d) for d in wp.shape)
    (sh, sw) = ctx.attr("strides") or (1, 1)
    (dh, dw) = ctx.attr("dilations") or (1, 1)
    if pointwise_applies(r, s, (sh, sw), before, after):
        tile = pointwise_tile(k // groups, oh * ow)
        if tile is not None:
            return _pointwise(ctx, x, wp, bias, rows, groups, tile)
    (pt, pl) = before
    in_per_group, out_per_group = c // groups, k // groups
    pixels = oh * ow
    vectors = 2 if pixels >= TWO_VECTORS_FROM else 1
    tile_pixels = vectors * LANES
    padded = -(-pixels // tile_pixels) * tile_pixels

    def column(ni, gi, j, p):
        ci, ry, rx = j // (r * s), (j // s) % r, j % s
        y = (p // ow) * sh + ry * dh - pt
        q = (p % ow) * sw + rx * dw - pl
        inside = tir.all(p < pixels, y >= 0, y < h, q >= 0, q < wd)
        return tir.if_then_else(inside, x[ni, gi * in_per_group + ci, y, q], tir.const(0.0, x.dtype))

    columns = te.compute((n, groups, depth, padded), column, name="grouped_cols")
    j = te.reduce_axis((0, depth), "j")
    product = te.compute(
        (n, groups, tiles * rows, padded),
        lambda ni, gi, ki, p: te.sum(wp[gi, ki // rows, j, ki % rows] * columns[ni, gi, j, p], axis=j),
        name="grouped_gemm")

    def result(ni, ki, y, q):
        value = product[ni, ki // out_per_group, ki % out_per_group, y * ow + q]
        return value + bias[ki] if bias is not None else value

    out = te.compute(ctx.out_shape(), result, name="grouped_out")
    big = n * k * pixels * depth >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        block = sch.get_sblock("grouped_gemm")
        tile = sch.cache_write(block, 0, "global")
        ni, gi, ki, p, jj = sch.get_loops(block)
        ko, ri = sch.split(ki, [None, rows])
        po, pv, pi = sch.split(p, [None, vectors, LANES])
        sch.reorder(ni, gi, ko, po, jj, ri, pv, pi)
        # The tiles of one row block run in order on a thread: its weight panel stays in L1.
        outer = sch.fuse(ni, gi, ko, po)
        if big:
            sch.parallel(outer)
        sch.unroll(ri)
        sch.unroll(pv)
        sch.vectorize(pi)
        sch.reverse_compute_at(tile, outer)
        try_step(lambda: sch.vectorize(sch.get_loops(tile)[-1]))
        sch.decompose_reduction(block, jj)
        unfold = sch.get_sblock("grouped_cols")
        loops = sch.get_loops(unfold)
        fused = sch.fuse(*loops[:3])
        if big:
            sch.parallel(fused)
        _, inner = sch.split(loops[3], [None, LANES])
        try_step(lambda: sch.vectorize(inner))
        schedule_rows(sch, "grouped_out", big, ow % 4 == 0)

    return SelfScheduled([out], schedule)


def pointwise_applies(r: int, s: int, strides, before, after) -> bool:
    """Whether the conv is 1×1, stride 1, unpadded: its groups' GEMMs can read the NCHW input itself."""
    return (r, s) == (1, 1) and tuple(strides) == (1, 1) and not any(before) and not any(after)


def pointwise_tile(out_per_group: int, pixels: int) -> tuple[int, int] | None:
    """(rows, width) of the pointwise kernel's register tile, None when no tile fits: `rows` output channels dividing
    the group's × `width` pixels, whole 16-lane vectors dividing the image's, so every tile is whole and writes the
    output itself (LLVM spills vectors of other widths).

    Estimated, not measured: a reduction step costs max(FMA issue slots, loads) (a 16-lane FMA takes two 256-bit
    slots; the loads are the tile's vectors and one broadcast per row), and the tile with the most useful
    multiply-adds per unit of that cost wins, more accumulators breaking ties, within TILE_REGISTERS accumulators."""
    best = None
    for rows in (d for d in range(1, out_per_group + 1) if out_per_group % d == 0):
        for vectors in range(1, MAX_TILE_VECTORS + 1):
            if pixels % (vectors * LANES) or rows * vectors > TILE_REGISTERS:
                continue
            cost = max(2 * rows * vectors, vectors + rows)
            key = (rows * vectors / cost, rows * vectors)
            if best is None or key > best[0]:
                best = (key, (rows, vectors * LANES))
    return None if best is None else best[1]


def _pointwise(ctx: LowerContext, x, wp, bias, packed_rows: int, groups: int, tile: tuple[int, int]):
    """The 1×1 stride-1 grouped conv as one GEMM per group read straight from the NCHW input and written straight
    to the NCHW output (see the module docstring)."""
    n, c, h, wd = (int(d) for d in x.shape)
    _, k, oh, ow = ctx.out_shape()
    in_per_group, out_per_group = c // groups, k // groups
    pixels = oh * ow
    rows, width = tile
    j = te.reduce_axis((0, in_per_group), "j")

    def weight(ki, ji):
        g, kk = ki // out_per_group, ki % out_per_group
        return wp[g, kk // packed_rows, ji, kk % packed_rows]

    product = te.compute(
        (n, k, pixels),
        lambda ni, ki, p: te.sum(weight(ki, j) * x[ni, ki // out_per_group * in_per_group + j, p // ow, p % ow],
                                 axis=j),
        name="pointwise_gemm")

    def result(ni, ki, y, q):
        value = product[ni, ki, y * ow + q]
        return value + bias[ki] if bias is not None else value

    out = te.compute(ctx.out_shape(), result, name="pointwise_out")
    big = n * k * pixels * in_per_group >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        block = sch.get_sblock("pointwise_gemm")
        tile = sch.cache_write(block, 0, "global")
        # The bias and the fused epilogue run as each register tile is written to the output.
        sch.reverse_compute_inline(sch.get_sblock("pointwise_out"))
        ni, ki, p, jj = sch.get_loops(block)
        gi, kg = sch.split(ki, [groups, out_per_group])
        ko, ri = sch.split(kg, [None, rows])
        po, pv, pi = sch.split(p, [None, width // LANES, LANES])
        # The row tiles of one pixel tile run in turn on a thread: its input columns stay in L1.
        sch.reorder(ni, gi, po, ko, jj, ri, pv, pi)
        outer = sch.fuse(ni, gi, po, ko)
        if big:
            sch.parallel(outer)
        sch.unroll(ri)
        sch.unroll(pv)
        sch.vectorize(pi)
        sch.reverse_compute_at(tile, outer)
        try_step(lambda: sch.vectorize(sch.get_loops(tile)[-1]))
        sch.decompose_reduction(block, jj)

    return SelfScheduled([out], schedule)
