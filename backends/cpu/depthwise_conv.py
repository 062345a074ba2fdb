"""Depthwise 2-D conv (group = input channels = output channels) on CPU, in one of two layouts.

Channel-blocked, NCHW[cb]c: the input is padded and packed to (N, C/cb, H', W', cb)
inside the kernel (a plain copy when the producer already wrote NCHW[16]c), and
each register tile holds `reg_n` output pixels × one cb-channel vector: the
kernel window is unrolled and every tap is one vector FMA. Channels that do not
fill the last block are zero-padded. Recipe:
../shared/docs/cpu-schedules/depthwise_conv.py (NCHW16c beat onnxruntime's kernel).

Along rows, NCHW: each register tile is a few 16-pixel vectors of one output row,
every tap an unaligned vector load times the tap's weight. Packing an NCHW input
into channel blocks (and unpacking the result) is a transpose that costs more than
the depthwise conv's few FMAs per pixel, so a conv of stride up to 2 whose input
arrives in NCHW runs along rows; one reading NCHW[16]c, or of a larger stride, runs
channel-blocked. Each channel is one parallel step: its input is padded into a plane
in L1 (at stride 2 split into the even and the odd columns, so that each tap reads
contiguous columns), its rows are computed and copied out with the epilogue, all in
one parallel loop (measured on ShuffleNet's 272 channels of 14×14: 35 → 9 µs, and
3 → 1 parallel loops; 544 channels of 7×7: 20 → 12 µs).

Weights come packed at compile time as (C/cb, R, S, cb) for both, and the
bias/activation epilogue runs as the tiles are copied out.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .gemm_tile import schedule_tiles
from .packed_kernels import CONV_TILE_CHOICES
from .packing import DEPTHWISE_BLOCK
from .schedule import MIN_PARALLEL_WORK, reads_blocks, schedule_rows, try_step, writes_blocks

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

# Along rows: a register tile is up to MAX_ROW_VECTORS vectors of ROW_LANES pixels (half as many lanes for rows of 8
# pixels or fewer).
ROW_LANES = 16
MAX_ROW_VECTORS = 2
# Along rows, channels run in parallel from this many times MIN_PARALLEL_WORK multiply-adds (measured: ShuffleNet's
# 544 channels of 7×7, 240k, 20 -> 12 µs on two threads; the channel-blocked kernel keeps 16).
ROWS_PARALLEL_FROM = 8
# Strides up to this run along rows on an NCHW input (a stride-2 row's two planes: one deinterleaving copy).
MAX_ROW_STRIDE = 2


def conv_depthwise(ctx: LowerContext, before, after):
    """Depthwise conv of x (N, C, H, W) with weights packed (C/cb, R, S, cb), plus the optional bias."""
    strides = tuple(ctx.attr("strides") or (1, 1))
    if max(strides) <= MAX_ROW_STRIDE and not reads_blocks(ctx.input(0)):
        return _along_rows(ctx, before, after)
    return _channel_blocked(ctx, before, after)


def _channel_blocked(ctx: LowerContext, before, after):
    """The NCHW[cb]c kernel (see the module docstring)."""
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
        sch.unroll(qi)
        sch.vectorize(ci)
        _finish(sch, block, tile_out, (ni, co, y), qo, (rkh, rkw), "dw_pack", None if tiles_to_output else "dw_unpack",
                big, ow)

    return SelfScheduled([out], schedule)


def _along_rows(ctx: LowerContext, before, after):
    """The NCHW kernel, vectorized along the output rows (see the module docstring)."""
    x, wp, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    cb = ctx.attr(DEPTHWISE_BLOCK)
    n, c, h, w = (int(d) for d in x.shape)
    r, s = (int(d) for d in wp.shape[1:3])
    _, _, oh, ow = ctx.out_shape()
    (sh, sw) = ctx.attr("strides") or (1, 1)
    (dh, dw) = ctx.attr("dilations") or (1, 1)
    (pt, pl), (pb, pr) = before, after
    lanes = ROW_LANES if ow > ROW_LANES // 2 else ROW_LANES // 2
    vectors = min(-(-ow // lanes), MAX_ROW_VECTORS)
    ow_padded = -(-ow // (vectors * lanes)) * vectors * lanes
    hp = max(h + pt + pb, (oh - 1) * sh + (r - 1) * dh + 1)
    # The padded rows are split into `sw` planes of every sw-th column (one plane at stride 1), so that each tap
    # reads contiguous columns of one plane: padded column sw·q + t·dw is plane (t·dw) % sw, column q + (t·dw) // sw.
    plane_width = max(-(-(w + pl + pr) // sw), ow_padded + (s - 1) * dw // sw)

    def pad(ni, ci, y, plane, q):
        column = q * sw + plane
        inside = tir.all(y >= pt, y < pt + h, column >= pl, column < pl + w)
        return tir.if_then_else(inside, x[ni, ci, y - pt, column - pl], tir.const(0.0, x.dtype))

    padded = te.compute((n, c, hp, sw, plane_width), pad, name="dw_pad")
    kh = te.reduce_axis((0, r), "kh")
    kw = te.reduce_axis((0, s), "kw")
    conv = te.compute(
        (n, c, oh, ow_padded),
        lambda ni, ci, y, q: te.sum(
            padded[ni, ci, y * sh + kh * dh, kw * dw % sw, q + kw * dw // sw] * wp[ci // cb, kh, kw, ci % cb],
            axis=[kh, kw]),
        name="dw_rows")

    def result(ni, k, y, q):
        return conv[ni, k, y, q] + bias[k] if bias is not None else conv[ni, k, y, q]

    out = te.compute(ctx.out_shape(), result, name="dw_rows_out")
    big = n * c * oh * ow * r * s >= MIN_PARALLEL_WORK * ROWS_PARALLEL_FROM

    def schedule(sch) -> None:
        block = sch.get_sblock("dw_rows")
        tile_out = sch.cache_write(block, 0, "global")
        # Tiles that cover the rows exactly write the NCHW output (with the epilogue) as they are copied out.
        tiles_to_output = ow_padded == ow and not writes_blocks(sch, "dw_rows_out")
        if tiles_to_output:
            sch.reverse_compute_inline(sch.get_sblock("dw_rows_out"))
        ni, ci, y, q, rkh, rkw = sch.get_loops(block)
        qo, qv, qi = sch.split(q, [None, vectors, lanes])
        sch.reorder(ni, ci, y, qo, rkh, rkw, qv, qi)
        # One channel per parallel step: its padded plane and its rows' results stay in L1, and the padding, the
        # tiles and the copy out share one parallel loop.
        channels = sch.fuse(ni, ci)
        schedule_tiles(sch, block, channels, big, (qv, rkh, rkw), qi, rkh, tile_out, at=qo)
        pad = sch.get_sblock("dw_pad")
        sch.compute_at(pad, channels)
        try_step(lambda: sch.vectorize(sch.get_loops(pad)[-1]))
        if not tiles_to_output:
            output = sch.get_sblock("dw_rows_out")
            sch.reverse_compute_at(output, channels)
            # Rows of 8 pixels or fewer stay scalar: LLVM's odd-width vectors cost more than they save.
            if ow > ROW_LANES // 2:
                try_step(lambda: sch.vectorize(sch.get_loops(output)[-1]))

    return SelfScheduled([out], schedule)


def _finish(sch, block, tile_out, row_loops, tile_loop, window_loops, staging: str, output: str | None, big: bool,
            ow: int) -> None:
    """The channel-blocked schedule once its tile loops are placed: rows across threads (when `big`),
    the window unrolled, each register tile copied out after its loop, the staging copy (padding or packing)
    parallel and vectorized, and the `output` block (None where the tiles write it) scheduled by rows."""
    rows = sch.fuse(*row_loops)
    if big:
        sch.parallel(rows)
    for loop in window_loops:
        sch.unroll(loop)
    sch.reverse_compute_at(tile_out, tile_loop)
    try_step(lambda: sch.vectorize(sch.get_loops(tile_out)[-1]))
    sch.decompose_reduction(block, window_loops[0])
    staging_loops = sch.get_loops(sch.get_sblock(staging))
    outer = sch.fuse(*staging_loops[:3])
    if big:
        sch.parallel(outer)
    try_step(lambda: sch.vectorize(staging_loops[-1]))
    if output is not None:
        schedule_rows(sch, output, big, ow % 4 == 0)
