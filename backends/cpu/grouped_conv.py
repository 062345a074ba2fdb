"""Grouped 2-D conv (1 < group, not depthwise) as one register-tiled GEMM per group, vectorized over pixels.

Per group g the conv is the product out[g] (Kg × P) = W[g] (Kg × Cg·R·S) · cols[g]
(Cg·R·S × P), P = OH·OW. Groups rarely have channel counts that fill 16-lane
vectors (ShuffleNet's 34 or 68 channels per group), so the vector runs along the
pixels instead: each register tile is `rows` output channels × `vectors`·16
pixels, accumulated in registers over the group's reduction. Weights come
packed at compile time as (G, Kg'/rows, Cg·R·S, rows), Kg' being Kg rounded up to
whole row tiles with zero rows, so a tile's `rows` weights of one reduction step
are adjacent. The input is unfolded into (N, G, Cg·R·S, P') columns (P' = P
rounded up to whole tiles), and the bias/activation epilogue is applied as NCHW is written.

A 1×1, stride-1, unpadded grouped conv (ShuffleNet's) runs the pointwise kernel instead: no
column copy and no output pass. Its GEMMs read the NCHW input directly and each register tile
is written to the output (with the epilogue) as soon as its reduction is done: tiles of the
flattened image where whole 16-lane vectors divide it (28×28), else tiles of image rows, each
row padded to whole vectors whose padding lanes load as zeros (14×14). The tiles' rows divide
the group's output channels and the weights are packed with as many rows per tile
(grouped_tiles.py chooses for both). Images of rows of 8 pixels or fewer (7×7) keep the kernel
above: LLVM turned their masked rows into shuffles (measured several times slower).
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .gemm_tile import schedule_tiles
from .grouped_tiles import flat_tile, pointwise_applies, row_tile
from .packing import GROUPED_LAYOUT
from .schedule import MIN_PARALLEL_WORK, schedule_rows, try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

LANES = 16
# Pixels per tile: two vectors once there are enough pixels to fill them, else one.
TWO_VECTORS_FROM = 128


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
    if pointwise_applies((r, s), (sh, sw), [*before, *after]):
        # The packing chose its rows for the same tile (grouped_tiles.py); the general kernel runs where none fits.
        flat, by_rows = flat_tile(k // groups, oh * ow), row_tile(k // groups, oh, ow)
        if flat is not None and flat[0] == rows:
            return _pointwise(ctx, x, wp, bias, groups, flat[1])
        if flat is None and by_rows is not None and by_rows[0] == rows:
            return _pointwise_rows(ctx, x, wp, bias, groups, by_rows[1])
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
        schedule_tiles(sch, block, outer, big, (ri, pv), pi, jj, tile)
        unfold = sch.get_sblock("grouped_cols")
        loops = sch.get_loops(unfold)
        fused = sch.fuse(*loops[:3])
        if big:
            sch.parallel(fused)
        _, inner = sch.split(loops[3], [None, LANES])
        try_step(lambda: sch.vectorize(inner))
        schedule_rows(sch, "grouped_out", big, ow % 4 == 0)

    return SelfScheduled([out], schedule)


def _pointwise(ctx: LowerContext, x, wp, bias, groups: int, width: int):
    """The 1×1 stride-1 grouped conv as one GEMM per group read straight from the NCHW input and written straight
    to the NCHW output (see the module docstring)."""
    n, c, h, wd = (int(d) for d in x.shape)
    _, k, oh, ow = ctx.out_shape()
    in_per_group, out_per_group = c // groups, k // groups
    pixels = oh * ow
    rows = int(wp.shape[3])
    weight = _weight(wp, out_per_group, rows)
    j = te.reduce_axis((0, in_per_group), "j")

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
        schedule_tiles(sch, block, outer, big, (ri, pv), pi, jj, tile)

    return SelfScheduled([out], schedule)


def _pointwise_rows(ctx: LowerContext, x, wp, bias, groups: int, image_rows: int):
    """The 1×1 stride-1 grouped conv whose image does not split into whole vectors: tiles of image rows, each row
    padded to whole vectors (the padding lanes read as zeros: masked loads), accumulated in registers and written
    to the NCHW output row by row."""
    n, c, h, wd = (int(d) for d in x.shape)
    _, k, oh, ow = ctx.out_shape()
    in_per_group, out_per_group = c // groups, k // groups
    rows, lanes = int(wp.shape[3]), LANES
    weight = _weight(wp, out_per_group, rows)
    padded = -(-ow // lanes) * lanes
    j = te.reduce_axis((0, in_per_group), "j")

    def term(ni, ki, y, q):
        value = tir.if_then_else(q < ow, x[ni, ki // out_per_group * in_per_group + j, y, q], tir.const(0.0, x.dtype))
        return weight(ki, j) * value

    product = te.compute((n, k, oh, padded), lambda ni, ki, y, q: te.sum(term(ni, ki, y, q), axis=j),
                         name="pointwise_rows_gemm")

    def result(ni, ki, y, q):
        value = product[ni, ki, y, q]
        return value + bias[ki] if bias is not None else value

    out = te.compute(ctx.out_shape(), result, name="pointwise_rows_out")
    big = n * k * oh * ow * in_per_group >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        block = sch.get_sblock("pointwise_rows_gemm")
        ni, ki, y, q, jj = sch.get_loops(block)
        gi, kg = sch.split(ki, [groups, out_per_group])
        ko, ri = sch.split(kg, [None, rows])
        yo, yi = sch.split(y, [None, image_rows])
        qv, qi = sch.split(q, [None, lanes])
        sch.reorder(ni, gi, yo, ko, jj, ri, yi, qv, qi)
        outer = sch.fuse(ni, gi, yo, ko)
        # The tile's rows go out (with the bias and the fused epilogue) once its reduction is done.
        schedule_tiles(sch, block, outer, big, (ri, yi, qv), qi, jj, sch.get_sblock("pointwise_rows_out"))

    return SelfScheduled([out], schedule)


def _weight(wp, out_per_group: int, rows: int):
    """The packed weight of output channel ki and reduction step j: (G, Kg/rows, Cg, rows), rows dividing Kg."""
    return lambda ki, j: wp[ki // out_per_group, ki % out_per_group // rows, j, ki % rows]
