"""A dense 2-D Conv whose weights are known only at run time (a training step's parameters) on CPU.

The packed algorithms (packed_kernels.py, im2col.py, winograd.py) prepare constant weights at compile time (or at
load); a parameter changes every step. This kernel transposes the weights channels-last inside the kernel (small next
to the conv) and runs the conv as the register-tiled product of the backward convs (broadcast_tiles.py):

    G[p, o] = Σ_{c, r, s} x_padded[n, c, i·sh + r·dh, k·sw + s·dw] · Wt[c, r, s, o],  p = (n, i, k)

then writes NCHW (plus bias) a row of pixels at a time.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..lowering.conv_transpose import CHANNEL_TILE, PIXEL_TILE, PhaseProducts, interleave
from ..tvm_env import tvm
from .broadcast_tiles import rows_outer, schedule_copies, schedule_nchw_output, tile_product
from .schedule import MIN_PARALLEL_WORK

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx


def applies(ctx: LowerContext) -> bool:
    """Whether the tiled kernel runs this Conv: dense, 2-D, float32, on CPU."""
    return (not ctx.gpu and ctx.attr("group", 1) == 1 and len(ctx.input_types[0].shape) == 4
            and ctx.input_types[0].dtype == "float32" and ctx.input_types[1].dtype == "float32")


def conv_runtime_weights(ctx: LowerContext, before, after):
    """Conv(x, w[, bias]) with w a kernel argument, as a tiled product (see the module docstring)."""
    x, w, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    n, c, h, wd = (int(d) for d in x.shape)
    o, _, r, s = (int(d) for d in w.shape)
    _, _, oh, ow = ctx.out_shape()
    (sh, sw) = ctx.attr("strides") or (1, 1)
    (dh, dw) = ctx.attr("dilations") or (1, 1)
    (pt, pl) = before
    hp = max(h + pt + after[0], (oh - 1) * sh + (r - 1) * dh + 1)
    wp = max(wd + pl + after[1], (ow - 1) * sw + (s - 1) * dw + 1)
    zero = tir.const(0.0, x.dtype)

    def pad(ni, ci, y, q):
        inside = tir.all(y >= pt, y < pt + h, q >= pl, q < pl + wd)
        return tir.if_then_else(inside, x[ni, ci, y - pt, q - pl], zero)

    padded = te.compute((n, c, hp, wp), pad, name="conv_rw_pad")
    channels = -(-o // CHANNEL_TILE) * CHANNEL_TILE
    weights = te.compute(
        (c, r, s, channels),
        lambda ci, kr, ks, oc: tir.if_then_else(oc < o, w[tir.min(oc, o - 1), ci, kr, ks], zero),
        name="conv_rw_weights")
    pixels = n * oh * ow
    ci = te.reduce_axis((0, c), "ci")
    kr = te.reduce_axis((0, r), "kr")
    ks = te.reduce_axis((0, s), "ks")

    def product(p, oc):
        pp = tir.min(p, pixels - 1)  # pixels past the last repeat it; the output drops them
        ni, i, k = pp // (oh * ow), (pp // ow) % oh, pp % ow
        return te.sum(padded[ni, ci, i * sh + kr * dh, k * sw + ks * dw] * weights[ci, kr, ks, oc], axis=[ci, kr, ks])

    tiles = te.compute((-(-pixels // PIXEL_TILE) * PIXEL_TILE, channels), product, name="conv_rw_tiles")
    phases = PhaseProducts({(0, 0): tiles}, {(0, 0): (oh, ow)}, o, tuple(ctx.out_shape()))
    out = interleave(phases, (1, 1), bias, ctx.out_dtype(), name="conv_rw_out")
    big = pixels * o * c * r * s >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        tile_product(sch, "conv_rw_tiles", PIXEL_TILE, big, row_tiles_outer=rows_outer(c * r * s * channels * 4))
        schedule_copies(sch, ("conv_rw_pad", "conv_rw_weights"), big)
        schedule_nchw_output(sch, "conv_rw_out", big)

    return SelfScheduled([out], schedule)
