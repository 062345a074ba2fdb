"""Depthwise 2-D conv (group = input channels = output channels) in the channel-blocked NCHW[cb]c layout.

The input is padded and packed to (N, C/cb, H', W', cb) inside the kernel (a
plain copy when the producer already wrote NCHW[16]c), weights come packed at
compile time as (C/cb, R, S, cb), and each register tile holds `reg_n` output
pixels × one cb-channel vector: the kernel window is unrolled, every tap is one
vector FMA, and the bias/activation epilogue runs on the tile as it is copied
out. Channels that do not fill the last block are zero-padded. Recipe:
../shared/docs/cpu-schedules/depthwise_conv.py (NCHW16c beat onnxruntime's kernel).
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .packed_kernels import CONV_TILE_CHOICES
from .packing import DEPTHWISE_BLOCK
from .schedule import MIN_PARALLEL_WORK, schedule_rows, try_step, writes_blocks

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx


def conv_depthwise(ctx: LowerContext, before, after):
    """Depthwise conv of x (N, C, H, W) with weights packed (C/cb, R, S, cb), plus the optional bias."""
    x, wp, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    cb = ctx.attr(DEPTHWISE_BLOCK)
    n, c, h, w = (int(d) for d in x.shape)
    blocks, r, s = (int(d) for d in wp.shape[:3])
    _, _, oh, ow = ctx.out_shape()
    (sh, sw) = ctx.attr("strides") or (1, 1)
    (dh, dw) = ctx.attr("dilations") or (1, 1)
    (pt, pl), (pb, pr) = before, after
    reg_n = min(CONV_TILE_CHOICES, key=lambda t: (-(-ow // t) * t, -t))
    ow_padded = -(-ow // reg_n) * reg_n
    hp = max(h + pt + pb, (oh - 1) * sh + (r - 1) * dh + 1)
    # Enough padded input for every (padded) output column.
    wpad = max(w + pl + pr, (ow_padded - 1) * sw + (s - 1) * dw + 1)

    def pack(ni, co, y, q, ci):
        inside = tir.all(y >= pt, y < pt + h, q >= pl, q < pl + w, co * cb + ci < c)
        return tir.if_then_else(inside, x[ni, co * cb + ci, y - pt, q - pl], tir.const(0.0, x.dtype))

    packed = te.compute((n, blocks, hp, wpad, cb), pack, name="dw_pack")
    kh = te.reduce_axis((0, r), "kh")
    kw = te.reduce_axis((0, s), "kw")
    conv = te.compute(
        (n, blocks, oh, ow_padded, cb),
        lambda ni, co, y, q, ci: te.sum(packed[ni, co, y * sh + kh * dh, q * sw + kw * dw, ci] * wp[co, kh, kw, ci],
                                        axis=[kh, kw]),
        name="dw_nchwc")

    def unpack(ni, k, y, q):
        value = conv[ni, k // cb, y, q, k % cb]
        return value + bias[k] if bias is not None else value

    out = te.compute(ctx.out_shape(), unpack, name="dw_unpack")
    # Small convs run on one thread: waking the pool costs more than the work.
    big = n * c * oh * ow * r * s >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        block = sch.get_sblock("dw_nchwc")
        # A result kept in NCHW[16]c is the tiles' own layout: each tile is written straight to it.
        tiles_to_output = ow_padded == ow and c % cb == 0 and writes_blocks(sch, "dw_unpack")
        # Accumulate each register tile in a small buffer LLVM keeps in registers, then copy it out.
        tile_out = sch.cache_write(block, 0, "global")
        if tiles_to_output:
            sch.reverse_compute_inline(sch.get_sblock("dw_unpack"))
        ni, co, y, q, ci, rkh, rkw = sch.get_loops(block)
        qo, qi = sch.split(q, [None, reg_n])
        sch.reorder(ni, co, y, qo, rkh, rkw, qi, ci)
        rows = sch.fuse(ni, co, y)
        if big:
            sch.parallel(rows)
        sch.unroll(rkh)
        sch.unroll(rkw)
        sch.unroll(qi)
        sch.vectorize(ci)
        sch.reverse_compute_at(tile_out, qo)
        try_step(lambda: sch.vectorize(sch.get_loops(tile_out)[-1]))
        sch.decompose_reduction(block, rkh)
        pack_loops = sch.get_loops(sch.get_sblock("dw_pack"))
        outer = sch.fuse(*pack_loops[:3])
        if big:
            sch.parallel(outer)
        try_step(lambda: sch.vectorize(pack_loops[-1]))
        if not tiles_to_output:
            schedule_rows(sch, "dw_unpack", big, ow % 4 == 0)

    return SelfScheduled([out], schedule)
