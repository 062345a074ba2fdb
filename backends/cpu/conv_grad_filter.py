"""A dense 2-D conv's filter gradient (ConvGradFilter, group 1) as a register-tiled product on CPU.

dW is a product whose reduction runs over the batch and every output position — long (N·OH·OW) next to its
O × C·R·S output. It runs as G[j, o] = Σ_{n,y,q} x_padded[n, c(j), y·sh + r(j)·dh, q·sw + s(j)·dw] · dyT[n, y, q, o]
with j = (c, r, s): dy is transposed to channels-last so a tile of 16-lane vectors of o accumulates in registers
while each x element is one broadcast; no im2col buffer. The reduction is cut into chunks of whole images
whose padded x and dyT (made per chunk, just before its tiles read them) stay in L2; each chunk's tiles
accumulate in registers over the chunk and write a partial G, and the partials are summed at the end (a
workspace of chunks × C·R·S × O floats). Tiles run in parallel within a chunk.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .broadcast_tiles import LANES, ROWS, tile_product, vectorize_row
from .schedule import MIN_PARALLEL_WORK, try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

# The reduction length of one chunk (several images when they are small): its x and dyT stay in L2.
CHUNK_POSITIONS = 2048


def applies(ctx: LowerContext) -> bool:
    """Whether the tiled kernel runs this ConvGradFilter: dense, 2-D, float32, on CPU."""
    return (not ctx.gpu and ctx.attr("group", 1) == 1 and len(ctx.input_types[0].shape) == 4
            and ctx.input_types[0].dtype == "float32" and ctx.input_types[1].dtype == "float32")


def _images_per_chunk(batch: int, positions: int) -> int:
    return max(d for d in range(1, batch + 1) if batch % d == 0 and (d == 1 or d * positions <= CHUNK_POSITIONS))


def conv_grad_filter_tiled(ctx: LowerContext, window):
    """dW[O, C, R, S] of x[N, C, H, W] and dy[N, O, OH, OW] (see the module docstring)."""
    x, dy = ctx.input(0), ctx.input(1)
    n, c, h, w = (int(d) for d in x.shape)
    _, o, oh, ow = (int(d) for d in dy.shape)
    r, s = window.kernel
    (sh, sw), (dh, dw), (pt, pl) = window.strides, window.dilations, window.before
    hp, wp = window.padded_sizes()
    depth = c * r * s
    o_padded = -(-o // LANES) * LANES
    j_padded = -(-depth // ROWS) * ROWS

    def pad(ni, ci, y, q):
        inside = tir.all(y >= pt, y < pt + h, q >= pl, q < pl + w)
        return tir.if_then_else(inside, x[ni, ci, y - pt, q - pl], tir.const(0.0, x.dtype))

    padded = te.compute((n, c, hp, wp), pad, name="grad_filter_xpad")
    zero = tir.const(0.0, dy.dtype)

    def transpose(ni, y, q, oi):
        if o_padded == o:
            return dy[ni, oi, y, q]
        return tir.if_then_else(oi < o, dy[ni, tir.min(oi, o - 1), y, q], zero)

    dy_t = te.compute((n, oh, ow, o_padded), transpose, name="grad_filter_dyt")
    per_chunk = _images_per_chunk(n, oh * ow)
    chunks = n // per_chunk
    image = te.reduce_axis((0, per_chunk), "image")
    ry = te.reduce_axis((0, oh), "ry")
    rq = te.reduce_axis((0, ow), "rq")

    def product(chunk, j, oi):
        jj = tir.min(j, depth - 1)  # rows past C·R·S repeat the last one; the result drops them
        ci, kr, ks = jj // (r * s), (jj // s) % r, jj % s
        ni = chunk * per_chunk + image
        return te.sum(padded[ni, ci, ry * sh + kr * dh, rq * sw + ks * dw] * dy_t[ni, ry, rq, oi],
                      axis=[image, ry, rq])

    partial = te.compute((chunks, j_padded, o_padded), product, name="grad_filter_partial")
    rc = te.reduce_axis((0, chunks), "rc")
    out = te.compute((o, c, r, s), lambda oi, ci, kr, ks: te.sum(partial[rc, (ci * r + kr) * s + ks, oi], axis=rc),
                     name="grad_filter_sum")
    big = depth * o * n * oh * ow >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        chunk = sch.get_loops(sch.get_sblock("grad_filter_partial"))[0]
        tile_product(sch, "grad_filter_partial", ROWS, big, lead=1)
        # Each chunk's padded x and dyT are made just before its tiles read them, while they are in L2.
        for name in ("grad_filter_xpad", "grad_filter_dyt"):
            stage = sch.get_sblock(name)
            sch.compute_at(stage, chunk)
            loops = sch.get_loops(stage)[1:]
            outer = sch.fuse(*loops[:2])
            if big:
                sch.parallel(outer)
            vectorize_row(sch, loops[-1])
        total = sch.get_sblock("grad_filter_sum")
        loops = sch.get_loops(total)
        if big:
            try_step(lambda: sch.parallel(loops[0]))

    return SelfScheduled([out], schedule)
