"""Convolution as im2col + GEMM: the input unfolded into columns, then one register-tiled matrix product.

The column matrix (N, C·R·S, P) with P = OH·OW padded to whole vector tiles is
the algorithm's workspace: C·R·S times the input's size for a 3×3 conv, which
buys a product whose inner loop reads both operands contiguously.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .gemm_tile import PIXELS, ROW_CHOICES, tiled_gemm
from .schedule import MIN_PARALLEL_WORK, schedule_rows, try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx


def conv_im2col(ctx: LowerContext, before, after):
    """Dense 2-D conv (N, C, H, W) * (K, C, R, S) through an im2col column buffer."""
    x, w, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    n, c, h, wd = (int(d) for d in x.shape)
    k, _, r, s = (int(d) for d in w.shape)
    _, _, oh, ow = ctx.out_shape()
    (sh, sw) = ctx.attr("strides") or (1, 1)
    (dh, dw) = ctx.attr("dilations") or (1, 1)
    (pt, pl) = before
    pixels = oh * ow
    padded = -(-pixels // PIXELS) * PIXELS
    depth = c * r * s

    def column(ni, j, p):
        ci, ry, rx = j // (r * s), (j // s) % r, j % s
        y = (p // ow) * sh + ry * dh - pt
        q = (p % ow) * sw + rx * dw - pl
        inside = tir.all(p < pixels, y >= 0, y < h, q >= 0, q < wd)
        return tir.if_then_else(inside, x[ni, ci, y, q], tir.const(0.0, x.dtype))

    columns = te.compute((n, depth, padded), column, name="im2col")
    j = te.reduce_axis((0, depth), "j")
    product = te.compute(
        (n, k, padded),
        lambda ni, ki, p: te.sum(w[ki, j // (r * s), (j // s) % r, j % s] * columns[ni, j, p], axis=j),
        name="im2col_gemm")

    def result(ni, ki, y, q):
        value = product[ni, ki, y * ow + q]
        return value + bias[ki] if bias is not None else value

    out = te.compute(ctx.out_shape(), result, name="im2col_out")
    rows = next(m for m in ROW_CHOICES if k % m == 0)
    big = n * k * pixels * depth >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        tiled_gemm(sch, "im2col_gemm", rows, big)
        unfold = sch.get_sblock("im2col")
        loops = sch.get_loops(unfold)
        fused = sch.fuse(*loops[:2])
        if big:
            sch.parallel(fused)
        inner_o, inner_i = sch.split(loops[2], [None, PIXELS])
        try_step(lambda: sch.vectorize(inner_i))
        schedule_rows(sch, "im2col_out", big, ow % 4 == 0)

    return SelfScheduled([out], schedule)
