"""Winograd F(m×m, 3×3) on an NCHW[16]c input: every transform vectorized over the 16 channels of a block.

The kernel runs one row of output tiles (m output rows, the whole width) at a time, in parallel over the rows:
- the input transform V = Bᵀ·d·B of the row's tiles, read from the blocked input (16 channels a vector),
  written (α, α, C/16, tiles, 16);
- per point (e, ν) of the α × α transformed tile, the product M = V·U over the input channels as register tiles
  of up to 14 tiles × two 16-channel vectors (28 accumulators, as packing.f32_conv_blocks' direct tiles), U the
  weights transformed at load (winograd.transform_weight's (α, α, C, K); the artifact stores the 3×3 weight);
- the output transform Aᵀ·M·A, with the conv's epilogue (bias and whatever elementwise ops were fused after
  it: a residual add, a ReLU), written straight to the output (NCHW[16]c when the result is kept blocked).
A row's V and M stay in L2 between the steps (at 56 × 56 × 64 channels with F(4×4): 129 KB each), where the
NCHW kernel (winograd.py) writes the whole V and M to memory and reads them back.
Above 128 × 128 channels the transformed weights outgrow L2 (9.4 MB at 256 × 256), and reading them once per tile
row cost more than the multiplies saved: those convs run their tile rows in groups (`row_groups`: each group's
V and M up to 4 MB, in L3), every step of the kernel over a group's rows at once, so the weights are read once per
group; their product tiles have 4 vectors where a row's tiles make too few accumulators (`product_vectors`).
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .schedule import MIN_PARALLEL_WORK, reads_blocks, try_step, writes_blocks
from .winograd import TILE, combine, transform_matrices

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

LANES = 16
# Accumulators of a product's register tile: 28 of the 32 zmm registers (the rest hold the weights), as
# packed_kernels.TILE_ACCUMULATORS.
TILE_ACCUMULATORS = 28
# Where a blocked conv runs Winograd by default (`by_default`): rows of at least this many pixels (4 tiles of F(4×4)),
MIN_DEFAULT_WIDTH = 16
# or, where the tile rows run one a task (at most GROUPED_CHANNEL_PRODUCT channels: the transformed weights are read
# once per tile row), rows of this many: 4 tiles with the last one padded.
MIN_NARROW_WIDTH = 13
# register tiles of at least this many accumulators (a row of 19 tiles has no divisor but 1 and 19: tiles of one
# tile, 2 accumulators; the measured ones have 10 to 28)...
MIN_DEFAULT_ACCUMULATORS = 4
# ...and at most this many input channels and output channels each (the largest measured: 512 × 512, transformed
# weights of 37.7 MB, read once per group of tile rows).
MAX_DEFAULT_CHANNELS = 512
# Fewer tasks than this (groups of tile rows, `row_groups`), and an odd number, run as two halves of the output
# channels each.
ODD_ROWS_SPLIT = 16
# More input × output channels than this, and the tile rows run in groups (`row_groups`): the transformed weights
# (α² · C · K floats: 9.4 MB at 256 × 256) are read once per group instead of once per tile row...
GROUPED_CHANNEL_PRODUCT = 128 * 128
# ...of at most this many bytes of transformed input (or product) tiles: two cores' in the 32 MB L3 with room.
GROUP_BYTES = 4 << 20


def applies(x, weight_u) -> bool:
    """Whether the blocked kernel runs this conv: its input arrives in NCHW[16]c and its output channels fill
    whole 16-channel blocks."""
    return reads_blocks(x) and int(x.op.input_tensors[0].shape[-1]) == LANES and int(weight_u.shape[3]) % LANES == 0


def tile_pixels(tiles_w: int, vectors: int) -> int:
    """Tiles per register tile: the largest divisor of the row's tile count that keeps `vectors` accumulators per
    tile within TILE_ACCUMULATORS (a divisor: the row's tiles are covered exactly, no padded tiles)."""
    return max(t for t in range(1, tiles_w + 1) if tiles_w % t == 0 and t * vectors <= TILE_ACCUMULATORS)


def product_vectors(out_blocks: int, tiles_w: int, wide: bool) -> int:
    """16-channel vectors per register tile of the product: two where the output blocks pair up; for a `wide`
    conv (grouped rows), four where that makes more accumulators (rows of 7 tiles: 7 × 4, not 7 × 2), each
    weight vector loaded then feeding more tiles."""
    vectors = 2 if out_blocks % 2 == 0 else 1
    if wide and out_blocks % 8 == 0 and tile_pixels(tiles_w, 4) * 4 > tile_pixels(tiles_w, 2) * 2:
        return 4
    return vectors


def row_groups(batch: int, tiles_h: int, tiles_w: int, alpha: int, in_channels: int,
               out_channels: int) -> tuple[int, int]:
    """(tile rows per group, output-channel parts) of a conv: each part of each group is one parallel task.

    Up to GROUPED_CHANNEL_PRODUCT input × output channels, one tile row a group. Above, the most rows of an image
    (a divisor of its tile rows) whose transformed tiles fit GROUP_BYTES: each group reads the transformed weights
    once. An odd number of tasks under ODD_ROWS_SPLIT runs as two halves of the output channels (else a core
    would idle at the end; a single group, both)."""
    group = 1
    if in_channels * out_channels > GROUPED_CHANNEL_PRODUCT:
        row_bytes = tiles_w * alpha ** 2 * max(in_channels, out_channels) * 4
        group = max(d for d in range(1, tiles_h + 1) if tiles_h % d == 0 and (d == 1 or d * row_bytes <= GROUP_BYTES))
    tasks = batch * tiles_h // group
    return group, 2 if tasks % 2 and tasks < ODD_ROWS_SPLIT else 1


def conv_winograd_blocks(ctx: LowerContext, before, after):
    """Dense 3×3 stride-1 conv of a blocked input, weights pre-transformed to (α, α, C, K). The padding `after`
    needs nothing of its own: the last tiles read zeros past the input and write only the output's pixels."""
    x, u, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    blocked = x.op.input_tensors[0]  # (N, C/16, H, W, 16)
    n, cb, h, wd, _ = (int(d) for d in blocked.shape)
    alpha, _, c, k = (int(d) for d in u.shape)
    m = alpha - 2
    _, _, oh, ow = ctx.out_shape()
    pt, pl = before
    a_np, b_np, _ = transform_matrices(m)
    tiles_h, tiles_w = -(-oh // m), -(-ow // m)
    kb = k // LANES
    pair = product_vectors(kb, tiles_w, c * k > GROUPED_CHANNEL_PRODUCT)  # 16-channel vectors per product tile
    reg_n = tile_pixels(tiles_w, pair)

    def pixel(ni, ty, tx, r, s, ci, cl):
        y, q = ty * m + r - pt, tx * m + s - pl
        inside = tir.all(y >= 0, y < h, q >= 0, q < wd)
        return tir.if_then_else(inside, blocked[ni, ci, y, q, cl], tir.const(0.0, blocked.dtype))

    # V[.., e, ν] = Σ_r B[r, e] Σ_s B[s, ν] d[r, s]: with e and ν unrolled, the inner sums repeat across e and LLVM
    # computes each once (the two passes of the separable transform).
    data = te.compute(
        (n, tiles_h, alpha, alpha, cb, tiles_w, LANES),
        lambda ni, ty, e, nu, ci, tx, cl: combine(
            b_np, e, lambda r: combine(b_np, nu, lambda s: pixel(ni, ty, tx, r, s, ci, cl))),
        name="winob_in")
    rc = te.reduce_axis((0, cb), "rc")
    rl = te.reduce_axis((0, LANES), "rl")
    product = te.compute(
        (n, tiles_h, alpha, alpha, kb, tiles_w, LANES),
        lambda ni, ty, e, nu, ko, tx, kl: te.sum(
            data[ni, ty, e, nu, rc, tx, rl] * u[e, nu, rc * LANES + rl, ko * LANES + kl], axis=[rc, rl]),
        name="winob_gemm")

    def output(ni, ko, y, q):
        ty, vh, tx, vw = y // m, y % m, q // m, q % m
        value = combine(a_np, vh, lambda r: combine(
            a_np, vw, lambda s: product[ni, ty, r, s, ko // LANES, tx, ko % LANES]))
        return value + bias[ko] if bias is not None else value

    out = te.compute(ctx.out_shape(), output, name="winob_result")
    big = n * k * oh * ow * c * 9 >= MIN_PARALLEL_WORK * 16

    group, halves = row_groups(n, tiles_h, tiles_w, alpha, c, k)
    # An odd, small number of tasks leaves a core idle at the end (ResNet-18's 28² layers: 7 rows, 4 + 3 on 2
    # cores): each then runs as two halves of the output channels, each transforming the group's input again.
    halves = halves if big and kb % (2 * pair) == 0 else 1

    def schedule(sch) -> None:
        result = sch.get_sblock("winob_result")
        blocked_out = writes_blocks(sch, "winob_result")
        ni, ko, y, q = sch.get_loops(result)
        ty, vh = sch.split(y, [None, m])
        tx, vw = sch.split(q, [None, m])
        inner = [tx, vh, vw]
        if group > 1:  # the rows of a group: inside the parallel loop, with the group's transforms and products
            ty, ty_in = sch.split(ty, [None, group])
            inner.insert(0, ty_in)
        if blocked_out:  # NCHW[16]c: the 16 channels of a block are the vector
            ko, kl = sch.split(ko, [None, LANES])
            inner.append(kl)
            sch.vectorize(kl)
        outer = [ni, ty]
        if halves > 1:
            half, ko = sch.split(ko, [halves, None])
            outer.append(half)
        sch.reorder(*outer, ko, *inner)
        sch.unroll(vh)
        sch.unroll(vw)
        gemm = sch.get_sblock("winob_gemm")
        sch.compute_at(gemm, outer[-1])
        sch.compute_at(sch.get_sblock("winob_in"), outer[-1])
        rows = sch.fuse(*outer)
        if big:
            sch.parallel(rows)
        _schedule_input(sch, group, alpha, cb, tiles_w)
        _schedule_product(sch, gemm, group, alpha, kb // halves, tiles_w, cb, pair, reg_n)

    return SelfScheduled([out], schedule)


def _inner_loops(sch, block, extents: dict[str, int]) -> dict[str, object]:
    """The loops compute_at made for `block` under the row loop, by name; compute_at makes none for an axis of
    extent 1 (a single channel block, a single tile), whose name maps to None."""
    present = [name for name, extent in extents.items() if extent > 1]
    loops = sch.get_loops(block)[len(sch.get_loops(block)) - len(present):]
    named = dict(zip(present, loops))
    return {name: named.get(name) for name in extents}


def _schedule_input(sch, group: int, alpha: int, cb: int, tiles_w: int) -> None:
    """Per (channel block, tile): the α × α transformed points unrolled, the 16 channels a vector."""
    block = sch.get_sblock("winob_in")
    loops = _inner_loops(sch, block, {"ty": group, "e": alpha, "nu": alpha, "ci": cb, "tx": tiles_w, "cl": LANES})
    sch.reorder(*[loops[n] for n in ("ci", "ty", "tx", "e", "nu", "cl") if loops[n] is not None])
    sch.unroll(loops["e"])
    sch.unroll(loops["nu"])
    try_step(lambda: sch.vectorize(loops["cl"]))


def _schedule_product(sch, gemm, group: int, alpha: int, kb: int, tiles_w: int, cb: int, pair: int,
                      reg_n: int) -> None:
    """Register tiles of reg_n tiles × `pair` 16-channel vectors, accumulated in registers and copied out. Per point
    and `pair` of output blocks, the weights' C × `pair` vectors stay in L1 or L2 across the group's rows."""
    tile_out = sch.cache_write(gemm, 0, "global")
    loops = _inner_loops(sch, gemm, {"ty": group, "e": alpha, "nu": alpha, "ko": kb, "tx": tiles_w, "kl": LANES,
                                     "rc": cb, "rl": LANES})
    koo, koi = sch.split(loops["ko"], [None, pair]) if pair > 1 else (loops["ko"], None)
    txo, txi = sch.split(loops["tx"], [None, reg_n]) if loops["tx"] is not None else (None, None)
    order = [loops["e"], loops["nu"], koo, loops["ty"], txo, loops["rc"], loops["rl"], txi, koi, loops["kl"]]
    sch.reorder(*[loop for loop in order if loop is not None])
    sch.reverse_compute_at(tile_out, next(loop for loop in (txo, loops["ty"], koo, loops["nu"]) if loop is not None))
    for loop in (txi, koi):
        if loop is not None:
            sch.unroll(loop)
    sch.vectorize(loops["kl"])
    try_step(lambda: sch.vectorize(sch.get_loops(tile_out)[-1]))
    sch.decompose_reduction(gemm, loops["rc"] if loops["rc"] is not None else loops["rl"])


def by_default(weight_shape, out_width: int) -> bool:
    """Whether a 3×3 stride-1 conv whose input arrives blocked runs Winograd when no selection chose: whole
    16-channel blocks in and out, output rows of at least MIN_DEFAULT_WIDTH pixels (MIN_NARROW_WIDTH up to
    GROUPED_CHANNEL_PRODUCT channels) whose tiles make register tiles of MIN_DEFAULT_ACCUMULATORS or more, at most
    MAX_DEFAULT_CHANNELS input and output channels (measured: up to 512 × 512; above 128 × 128 the tile rows run in
    groups, `row_groups`).

    Measured per kernel inside the whole program (min of 300-450 runs, 2 cores): faster on every such conv of
    ResNet-18 (56² × 64 channels: 0.455 → 0.18 ms; 28² × 128: 0.45 → 0.22, its 7 tile rows in halves) and
    YOLOv8n-320 (80² × 16: 0.075 → 0.048; 40² × 32: 0.066 → 0.031; 40² × 64: 0.245 → 0.091; 20² × 64: 0.072 →
    0.045-0.051); on topology_vgg19 (min of 45 runs in the program, with the row groups): 56² × 128 → 256: 3.76 →
    1.69, 56² × 256: 7.6-7.7 → 2.7-2.9, 28² × 256 → 512: 4.53 → 1.60, 28² × 512: 9.1-9.2 → 3.0. Slower on the
    narrower ones: 14² × 256 (0.49 → 0.53: 9.4 MB of transformed weights read for each of 4 tile rows), 7² × 512
    (0.56 → 1.45), YOLOv8n's 10² × 128 (0.085 → 0.135: 3 tile rows, padded from 10 to 12 pixels); 14² × 512 alone
    (in two groups of 2 tile rows: 1.71 → 1.93, one run). Rows of 13 pixels (4 tiles, the last one padded: 1.5×
    the products of whole tiles) at up to 128 × 128 channels, on AMD Zen 4 (min of 4 profiled runs of 200, 2 cores):
    topology_squeezenet's 13² × 64 → 256 0.240-0.248 → 0.105-0.130 ms, 13² × 48 → 192 0.138-0.144 → 0.061-0.072;
    the model 3.14-3.26 → 2.82-2.87 ms (medians of 300 runs, interleaved). Grouping their 4 tile rows into one task
    in halves of the output channels (each core reading half the transformed weights once) ran slower: 0.15-0.18.
    """
    out_channels, in_channels = weight_shape[:2]
    narrow = out_channels * in_channels <= GROUPED_CHANNEL_PRODUCT and out_width >= MIN_NARROW_WIDTH
    if out_channels % LANES or in_channels % LANES or (out_width < MIN_DEFAULT_WIDTH and not narrow):
        return False
    # conv_winograd_blocks' `pair` where it is not 4 (wide convs on 7-tile rows): the fewest accumulators it uses
    vectors = 2 if (out_channels // LANES) % 2 == 0 else 1
    tiles_w = -(-out_width // TILE)  # the output tile of winograd.transform_weight's default, as the packing makes
    return (tile_pixels(tiles_w, vectors) * vectors >= MIN_DEFAULT_ACCUMULATORS
            and max(in_channels, out_channels) <= MAX_DEFAULT_CHANNELS)
