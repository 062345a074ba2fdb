"""A ConvTranspose whose kernel equals its strides (no pads, no dilation, group 1) on CPU: an upsampling in which each
output pixel receives exactly one input pixel,

    out[n, co, sh·y + a, sw·x + b] = bias[co] + Σ_ci x[n, ci, y, x] · w[ci, co, a, b].

Per input row y, register tiles of 16 input pixels (one vector along x, read straight from NCHW) × the phases (a, b)
of a few output channels: each x vector feeds one FMA per (channel, phase), each weight one broadcast. The tile's
sums land in a small buffer per row and channel block (in L1), from which the output (with its fused epilogue) is
written as whole NCHW rows; rows run in parallel.

The tiled kernel (conv_transpose.py: 32-channel tiles of phase products, made for a training step's data gradient)
spends most of its work on padding channels here. ppocr_v4_det on this AMD Zen 4 (per kernel in the program, 3
alternating rounds of 40 runs): 24 → 24 channels, 160² → 320² with BatchNorm and Relu, 3.75-4.34 → 1.19-1.64 ms;
24 → 1 channel, 320² → 640² with Sigmoid, 3.51-4.82 → 0.41-0.80 ms. A training step's ConvTranspose (weights known
only at run time) keeps the tiled kernel (algorithms.py).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..lowering.context import MIN_PARALLEL_WORK, LowerContext, SelfScheduled
from ..tvm_env import tvm
from .schedule import try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

LANES = 16
# Accumulators of one register tile (channels × phases × one vector): half of AVX-512's 32 registers.
TILE_ACCUMULATORS = 16


def shape_applies(attrs: Mapping[str, Any], x_shape, w_shape, out_shape=None) -> bool:
    """Whether a ConvTranspose of these attributes and shapes is an upsampling this kernel runs: 2-D, group 1,
    kernel == strides, no pads, dilations or output padding (and, with `out_shape`, exactly strides × the input)."""
    if len(x_shape) != 4 or len(w_shape) != 4 or attrs.get("group", 1) != 1:
        return False
    kernel = [int(d) for d in w_shape[2:]]
    strides = list(attrs.get("strides") or [1, 1])
    plain = (list(attrs.get("dilations") or [1, 1]) == [1, 1] and not any(attrs.get("pads") or ())
             and not any(attrs.get("output_padding") or ()) and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")
             and not attrs.get("output_shape"))
    expected = [int(x_shape[0]), int(w_shape[1]), int(x_shape[2]) * kernel[0], int(x_shape[3]) * kernel[1]]
    return plain and kernel == strides and (out_shape is None or [int(d) for d in out_shape] == expected)


def applies(ctx: LowerContext) -> bool:
    """Whether this kernel runs the op: CPU, float32, an upsampling (`shape_applies`) of rows and input channels
    longer than 1 (the schedule finds their loops by position)."""
    x, w = ctx.input_types[0], ctx.input_types[1]
    return (not ctx.gpu and x.dtype == "float32" and w.dtype == "float32" and x.rank == 4 and x.shape[1] > 1
            and x.shape[3] > 1 and shape_applies(ctx.attrs, x.shape, w.shape, ctx.out_shape()))


def channel_block(channels: int, phases: int) -> int:
    """Output channels per register tile: the most that divide `channels` with one accumulator per phase each."""
    return max([c for c in range(1, max(1, TILE_ACCUMULATORS // phases) + 1) if channels % c == 0])


def conv_transpose_upsample(ctx: LowerContext) -> SelfScheduled:
    """ConvTranspose(x, w[, bias]) as an upsampling (see the module docstring)."""
    x, w, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    n, in_channels, h, wd = (int(d) for d in x.shape)
    _, channels, sh, sw = (int(d) for d in w.shape)
    ci = te.reduce_axis((0, in_channels), "ci")
    acc = te.compute((n, h, channels, sh, sw, wd), lambda ni, y, co, a, b, q: te.sum(
        x[ni, ci, y, q] * w[ci, co, a, b], axis=ci), name="upsample_acc")

    def value(ni, co, i, k):
        result = acc[ni, i // sh, co, i % sh, k % sw, k // sw]
        return result + bias[co] if bias is not None else result

    out = te.compute((n, channels, h * sh, wd * sw), value, name="upsample_out")
    block = channel_block(channels, sh * sw)
    parallel = n * h * wd * sh * sw * channels * in_channels >= MIN_PARALLEL_WORK

    def schedule(sch) -> None:
        ni, co, i, k = sch.get_loops(sch.get_sblock("upsample_out"))
        y, a = sch.split(i, [None, sh])
        co_outer, co_inner = sch.split(co, [None, block])
        sch.reorder(ni, y, co_outer, co_inner, a, k)
        rows = sch.fuse(ni, y)
        if parallel:
            sch.parallel(rows)
        # The interleave as a loop over input pixels of sw stores each: LLVM's loop vectorizer turns its stride-sw
        # stores into shuffles and whole vector stores. TVM's vectorize along output pixels gathered each lane's sum
        # with a scalar load: 24 → 24 channels on 160² (with BatchNorm and Relu, the kernel alone) 1.18 → 0.79 ms.
        sch.unroll(sch.split(k, [None, sw])[1])
        acc_block = sch.get_sblock("upsample_acc")
        sch.compute_at(acc_block, co_outer)
        # Register tile: the accumulators of one x vector, written back below the tile.
        tile = sch.cache_write(acc_block, 0, "global")
        loops = sch.get_loops(acc_block)
        # After the rows and the channel blocks: (channel, a, b) (compute_at leaves out those of extent 1), the row's
        # pixels, the input channels (both longer than 1: `applies`).
        *tile_loops, q, r = loops[2:]
        q_outer, lanes = sch.split(q, [None, LANES])
        sch.reorder(q_outer, r, *tile_loops, lanes)
        sch.reverse_compute_at(tile, q_outer)
        try_step(lambda: sch.vectorize(sch.get_loops(tile)[-1]))
        for loop in tile_loops:
            sch.unroll(loop)
        # A row of whole vectors (a partial last vector keeps its loop scalar).
        try_step(lambda: sch.vectorize(lanes))
        sch.decompose_reduction(acc_block, r)

    return SelfScheduled([out], schedule)
