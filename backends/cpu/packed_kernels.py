"""Register-tiled CPU kernels for dense conv and matmul with weights packed at compile time.

Conv: the input is padded and packed to NCHW[icb]c inside the kernel, the
conv runs in NCHWc with a register tile of `reg_n` output pixels × `ocb`
channels (vectorized over channels), and the bias epilogue writes NCHW from
the tile. Matmul: B is pre-packed into (N/nb, K, nb) panels; each (mi × nb)
tile of C accumulates in registers. Recipes: ../shared/docs/cpu-schedules.
"""
from __future__ import annotations

from math import gcd

from ..kernel import BF16, PRECISION
from ..lowering.context import LowerContext, SelfScheduled
from ..tvm_env import tvm
from .bf16 import DOT_LLVM, IMPORT_LLVM, PAIR, NextBlockPrefetch, bits_of, dot_intrinsic, value_of
from .packing import BF16_WINDOW_PAIRS, CONV_BLOCKS, MATMUL_BLOCK, NARROW_ROW
from .schedule import MIN_PARALLEL_WORK, schedule_rows, try_step, writes_blocks

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx

# Register tiles: output pixels per conv tile (with 16 channels), rows per matmul tile. 10 fits YOLOv8n's rows of 10
# and 20 pixels (320² input) exactly, where 7 padded them to 14 and 21: measured on its 3 × 3 convs (each alone, min
# of 20 × 20 runs, interleaved), 10-pixel rows 18-20% faster, 20-pixel rows 11%; its 40- and 80-pixel rows (8 or 10
# pixels, both exact) ran the same. ResNet-18's rows (112, 56, 28, 14, 7) keep their tiles. bf16 convs keep the
# choices they were tuned with (BF16_TILE_CHOICES).
CONV_TILE_CHOICES = (14, 16, 12, 10, 8, 7)
BF16_TILE_CHOICES = (14, 16, 12, 8, 7)
# Vector accumulators a conv's register tile may hold: 28 of the 32 zmm registers (the rest hold the weights).
TILE_ACCUMULATORS = 28
MATMUL_ROWS = (4, 2, 1)
# Vector accumulators a packed matmul tile keeps in flight: two FMA pipes of four cycles' latency each.
INDEPENDENT_ACCUMULATORS = 8
# A product big enough to run in parallel keeps at least this many tiles (grouping panels makes fewer).
PARALLEL_TILES = 16
# bf16 conv weights from this size (bytes; a core's L2 holds 1 MiB) prefetch the next output-channel block's weights
# while computing the current one (bf16.NextBlockPrefetch)...
PREFETCH_MIN_WEIGHT_BYTES = 1 << 20
# ...where the register tile is at most this many bytes: TVM puts a smaller buffer on the stack, where LLVM keeps it in
# registers whatever else the loop does. A larger one is a heap workspace, which LLVM keeps in registers only while
# nothing else in the loop may read memory; it counts a prefetch as a read, and stored the tile after every product
# (ResNet-18's 14 × 14 convs ran 2.6× slower).
PREFETCH_MAX_TILE_BYTES = 1024
# The loop annotation that asks TVM's LoopPartition to cut a loop where a `likely` condition inside it changes.
PARTITION_HINT = "pragma_loop_partition_hint"


def conv_packed(ctx: LowerContext, before, after, direct: bool = False):
    """Dense 2-D conv with weights packed (K/ocb, C/icb, R, S, icb, ocb).

    `direct`: the same register tiles with no workspace — the input is read in
    place through bounds checks instead of packed, and each tile is written
    (with its epilogue) straight to the NCHW output.

    In bf16 (PRECISION attribute), weights come packed (K/ocb, C/icb, R, S, icb/2, ocb, 2) as bf16 bits
    (uint16), the packed input holds bf16 bits (rounded once, when packed: never `direct`; a strided 1 × 1
    conv packs only the pixels it reads), and each 16-channel × 2-channel step of the reduction is one
    `vdpbf16ps` accumulating in f32 (bf16.py). A bf16 conv whose result is NCHW (not kept blocked) unpacks each
    output row, with its epilogue, from a per-thread row buffer right after computing it.
    """
    x, wp, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    icb, ocb, swap = ctx.attr(CONV_BLOCKS)
    bf16 = ctx.attr(PRECISION) == BF16
    # A bf16 conv of very few input channels pairs neighbouring kernel columns instead (packing.py).
    window_pairs = bool(ctx.attr(BF16_WINDOW_PAIRS))
    direct = direct and not bf16
    one_d = len(x.shape) == 3
    strides = ([1] if one_d else []) + list(ctx.attr("strides") or [1] * (1 if one_d else 2))
    dilations = ([1] if one_d else []) + list(ctx.attr("dilations") or [1] * (1 if one_d else 2))
    before, after = ([0] if one_d else []) + list(before), ([0] if one_d else []) + list(after)
    if one_d:  # run as a 2-D conv of height 1
        n, c, w = (int(d) for d in x.shape)
        h = 1
        _, k, ow = ctx.out_shape()
        oh = 1
    else:
        n, c, h, w = (int(d) for d in x.shape)
        _, k, oh, ow = ctx.out_shape()
    if swap:  # a tall, narrow conv runs transposed (weights were packed transposed too)
        h, w, oh, ow = w, h, ow, oh
        strides, dilations, before, after = strides[::-1], dilations[::-1], before[::-1], after[::-1]
    kb, cb, r, s = (int(d) for d in wp.shape[:4])
    if window_pairs:  # weights (K/ocb, C, R, S/2, ocb, 2): the kernel window's columns padded to pairs
        s *= PAIR
    vectors = -(-ocb // 16)  # 16-lane accumulators per pixel
    if direct:  # tiles must cover the output width exactly to write it without an intermediate
        fits = [t for t in range(1, 17) if ow % t == 0 and t * vectors <= TILE_ACCUMULATORS]
        reg_n = next((t for t in CONV_TILE_CHOICES if t in fits), None) or max(fits)
    else:
        # A tile of two 16-channel vectors per pixel keeps at most 14 pixels: 28 accumulators of 32 registers.
        choices = [t for t in (BF16_TILE_CHOICES if bf16 else CONV_TILE_CHOICES) if t * vectors <= TILE_ACCUMULATORS]
        reg_n = min(choices, key=lambda t: (-(-ow // t) * t, -t))
        # A tile one pixel narrower that covers the rows exactly wastes nothing on padding for one accumulator per
        # vector less: topology_squeezenet's classifier conv (512 → 1000 channels on 13-pixel rows: 13 × 2 vectors
        # instead of 14 × 2) took 0.836 instead of 0.892 ms and 0.885 instead of 0.920 (AMD Zen 4, 2 cores; min of 4
        # profiled runs of 200 in the program, interleaved, two sessions).
        if not bf16 and ow % reg_n and ow % (reg_n - 1) == 0:
            reg_n -= 1
    ow_padded = -(-ow // reg_n) * reg_n
    (pt, pl), (pb, pr) = before, after
    # A strided 1 × 1 bf16 conv (a ResNet downsample) packs only the pixels it reads, then runs with stride 1:
    # converting the whole input to bf16 would read and write four times what the conv reads.
    step = strides if bf16 and r == s == 1 and strides != [1, 1] else [1, 1]
    if step != [1, 1]:
        strides = [1, 1]
    hp = -(-(h + pt + pb) // step[0])
    # Enough padded input for every (padded) output column.
    wpad = max(-(-(w + pl + pr) // step[1]), (ow_padded - 1) * strides[1] + (s - 1) * dilations[1] + 1)
    if window_pairs:  # whole 16-lane vectors per packed row: its blocks are single channels
        wpad = -(-wpad // 16) * 16

    def source(ni, ci, hi, wi):
        if one_d:
            return x[ni, ci, wi]
        return x[ni, ci, wi, hi] if swap else x[ni, ci, hi, wi]

    def pack(ni, co, hi, wi, ci):
        if step != [1, 1]:  # the pixel of the padded input this packed pixel holds
            hi, wi = hi * step[0], wi * step[1]
        bounds = (hi >= pt, hi < pt + h, wi >= pl, wi < pl + w, co * icb + ci < c)
        # Read in place (`direct`), the padding checks are marked `likely` for the schedule's loop partitioning.
        inside = tir.all(*(tir.likely(bound) for bound in bounds)) if direct else tir.all(*bounds)
        if bf16:
            return tir.if_then_else(inside, bits_of(source(ni, co * icb + ci, hi - pt, wi - pl)), tir.const(0, "uint16"))
        return tir.if_then_else(inside, source(ni, co * icb + ci, hi - pt, wi - pl), tir.const(0.0, x.dtype))

    if window_pairs:  # single channels: the pairs are neighbouring columns, the last axis
        packed = te.compute((n, cb, hp, wpad), lambda ni, co, hi, wi: pack(ni, co, hi, wi, 0), name="pack")
    else:
        packed = te.compute((n, cb, hp, wpad, icb), pack, name="pack")
    ico = te.reduce_axis((0, cb), "ico")
    kh = te.reduce_axis((0, r), "kh")
    kw = te.reduce_axis((0, s), "kw")
    (sh, sw), (dh, dw) = strides, dilations
    if window_pairs:  # pairs of kernel columns: the packed input (one channel per block) holds them side by side
        kwp = te.reduce_axis((0, s // PAIR), "kwp")
        ie = te.reduce_axis((0, PAIR), "ie")
        conv = te.compute(
            (n, kb, oh, ow_padded, ocb),
            lambda ni, ko, y, q, ki: te.sum(
                value_of(packed[ni, ico, y * sh + kh * dh, q * sw + kwp * PAIR + ie])
                * value_of(wp[ko, ico, kh, kwp, ki, ie]),
                axis=[ico, kh, kwp, ie]),
            name="conv_nchwc")
    elif bf16:  # the channel reduction as pairs: (icb/2) × 2, the pair innermost (the instruction's)
        ipair = te.reduce_axis((0, icb // PAIR), "ipair")
        ie = te.reduce_axis((0, PAIR), "ie")
        conv = te.compute(
            (n, kb, oh, ow_padded, ocb),
            lambda ni, ko, y, q, ki: te.sum(
                value_of(packed[ni, ico, y * sh + kh * dh, q * sw + kw * dw, ipair * PAIR + ie])
                * value_of(wp[ko, ico, kh, kw, ipair, ki, ie]),
                axis=[ico, kh, kw, ipair, ie]),
            name="conv_nchwc")
    else:
        ici = te.reduce_axis((0, icb), "ici")
        conv = te.compute(
            (n, kb, oh, ow_padded, ocb),
            lambda ni, ko, y, q, ki: te.sum(
                packed[ni, ico, y * sh + kh * dh, q * sw + kw * dw, ici] * wp[ko, ico, kh, kw, ici, ki],
                axis=[ico, kh, kw, ici]),
            name="conv_nchwc")
    def unpack(ni, ki, y, q):
        value = conv[ni, ki // ocb, q, y, ki % ocb] if swap else conv[ni, ki // ocb, y, q, ki % ocb]
        return value + bias[ki] if bias is not None else value

    if one_d:
        out = te.compute((n, k, ow), lambda ni, ki, q: unpack(ni, ki, 0, q), name="unpack")
    else:
        out = te.compute(ctx.out_shape(), unpack, name="unpack")
    lanes = 16 if ocb % 16 == 0 else ocb
    block = cb * r * s * icb * ocb  # weight elements per output-channel block (bf16: icb/2 pairs × ocb × 2)
    prefetch = None
    if (bf16 and not window_pairs and kb > 1 and oh > 1 and kb * block * 2 >= PREFETCH_MIN_WEIGHT_BYTES
            and reg_n * ocb * 4 <= PREFETCH_MAX_TILE_BYTES):
        prefetch = NextBlockPrefetch(block=block, step=ocb * PAIR, tile=reg_n, lanes=ocb, row=wpad * icb, rows=hp,
                                     spread=max(m for m in range(1, oh + 1) if gcd(m, strides[0]) == 1), blocks=kb)
    # Small convs run on one thread: waking the pool costs more than the work.
    big = n * kb * ocb * oh * ow * cb * icb * r * s >= MIN_PARALLEL_WORK * 16

    def schedule(sch) -> None:
        block = sch.get_sblock("conv_nchwc")
        # An NCHW[16]c result (kept blocked for the next conv) is the tiles' own layout: each tile
        # goes straight to it with its epilogue, as in `direct`, when the tiles cover the width exactly.
        blocked_output = writes_blocks(sch, "unpack")
        tiles_to_output = direct or (ow_padded == ow and blocked_output)
        # Accumulate each register tile in a small buffer LLVM keeps in registers, then copy it out.
        tile_out = sch.cache_write(block, 0, "global")
        if direct:
            sch.compute_inline(sch.get_sblock("pack"))
        if tiles_to_output:
            sch.reverse_compute_inline(sch.get_sblock("unpack"))
        # The reduction's inner loops: f32 [ici]; bf16 [ipair, ie] or, pairing kernel columns, [ie] (kw is pairs).
        ni, ko, y, q, ki, rco, rkh, *inner = sch.get_loops(block)
        reduction, pair = (inner[:-1], inner[-1:]) if bf16 else (inner, [])
        qo, qi = sch.split(q, [None, reg_n])
        kio, kii = sch.split(ki, [None, lanes])
        # Rows outside the input channels: each row reads its block's weights once (from L2 after the first row).
        # Measured on ResNet-18's 7 × 7 stage-4 convs (9.4 MB of weights): input-channel chunks of 16 outermost,
        # the seven rows' partial sums kept between chunks, ran 15-20% slower (each chunk's first pass waits on
        # memory); only with a software prefetch of the next chunk's weights did they run 2-3% faster.
        sch.reorder(ni, ko, y, qo, rco, rkh, *reduction, qi, kio, kii, *pair)
        # An input concatenated inside the kernel (YOLOv8n's C2f and neck 1 × 1 convs: a Concat of blocked values)
        # picks its part per element, in the innermost loop; cut at the parts' starts (lowering/tensor.py's Concat
        # marks them `likely`), each input-channel block loop reads one part directly. Measured in yolov8n_320 (min
        # of 450 runs in the program): 0.12-0.25 → 0.05-0.09 ms for these convs. `direct` reads its input in place:
        # cut the tiles' loop and the kernel rows' loop where the padding starts, only the edge tiles and rows check
        # it. (Float32 only: the bf16 kernels are left as they are.)
        if not bf16:
            sch.annotate(rco, PARTITION_HINT, 1)
        for loop, extent in ((qo, ow_padded // reg_n), (rkh, r)):
            if direct and extent > 1:
                sch.annotate(loop, PARTITION_HINT, 1)
        # A conv with an NCHW result unpacks each output row while it is in L1, from a per-thread row buffer,
        # instead of writing the whole NCHWc result to memory and reading it back. In float32 only wide rows do
        # (measured on ResNet-18: its f32 stem, 112-pixel rows, took 0.61 instead of 0.74 ms; its last conv, 7-pixel
        # rows, 0.74 instead of 0.56 ms).
        row_unpack = not tiles_to_output and (bf16 or ow >= NARROW_ROW)
        if row_unpack:
            sch.reverse_compute_at(tile_out, qo)
            sch.reverse_compute_at(sch.get_sblock("unpack"), y)
            sch.set_scope(tile_out, 0, "local")
        rows = sch.fuse(ni, ko, y)
        if big:
            sch.parallel(rows)
        sch.unroll(qi)
        sch.unroll(kio)
        if not bf16:
            sch.vectorize(kii)
        if not row_unpack:
            sch.reverse_compute_at(tile_out, qo)
        init = sch.decompose_reduction(block, rco)
        if bf16:  # the (16 channels × pair) loops become one vdpbf16ps; the tile starts at zero, a vector store
            sch.vectorize(sch.get_loops(init)[-1])
            sch.tensorize(kii, dot_intrinsic(prefetch))
            sch.annotate(rows, IMPORT_LLVM, DOT_LLVM)
        if direct:
            return
        if not tiles_to_output:
            sch.vectorize(sch.get_loops(tile_out)[-1])
        pack_block = sch.get_sblock("pack")
        loops = sch.get_loops(pack_block)
        outer = sch.fuse(*loops[:3])
        if big:
            sch.parallel(outer)
        if window_pairs:
            try_step(lambda: sch.vectorize(sch.split(loops[-1], [None, 16])[1]))
        else:
            try_step(lambda: sch.vectorize(loops[-1]) if icb in (4, 8, 16) else None)
        if row_unpack:
            _vectorize_row_unpack(sch, blocked_output)
        elif not tiles_to_output:
            schedule_rows(sch, "unpack", big, ow % 4 == 0)

    return SelfScheduled([out], schedule)


def _vectorize_row_unpack(sch, blocked_output: bool) -> None:
    """Vectorize the unpacking of one output row (loops: channels, pixels). An NCHW row is contiguous along its
    pixels; an NCHW[16]c row (kept blocked, the tiles not covering it exactly: 111- and 13-pixel rows in 14-pixel
    tiles) is contiguous along each block's 16 channels, read and written as one vector per pixel. Vectorized along
    the pixels it was a gather from the tile buffer and a scatter to the output: topology_squeezenet's stem (3 → 64
    channels, 111-pixel rows; min of 450 runs in the program) took 0.226 ms that way, 0.130 this one."""
    block = sch.get_sblock("unpack")
    channels, pixels = sch.get_loops(block)[-2:]
    if blocked_output:
        lanes = int(sch.get(block).writes[0].source.shape[-1])
        outer, lane = sch.split(channels, [None, lanes])
        sch.reorder(outer, pixels, lane)
        sch.vectorize(lane)
    else:
        sch.vectorize(pixels)


def gemm_epilogue(value, i, j, alpha: float, beta: float, c, dtype: str):
    """Gemm's alpha · value + beta · C at output (i, j), C broadcast to the output (None: no C)."""
    if alpha != 1.0:
        value = value * tir.const(alpha, dtype)
    if c is not None:
        c_dims = [int(d) for d in c.shape]
        index = [0 if d == 1 else idx for d, idx in zip(c_dims, [i, j][2 - len(c_dims):])]
        term = c[tuple(index)] if c_dims else c[()]
        value = value + (term * tir.const(beta, dtype) if beta != 1.0 else term)
    return value


def matmul_packed(ctx: LowerContext, trans_a: bool = False, alpha: float = 1.0, beta: float = 1.0):
    """A (..., M, K) times B packed as (⌈N/nb⌉, K, nb) (the last panel zero-padded); optional bias C (Gemm)."""
    a, bp = ctx.input(0), ctx.input(1)
    c = ctx.input(2) if ctx.op_type == "Gemm" else None
    nb = ctx.attr(MATMUL_BLOCK)
    a_dims = [int(d) for d in a.shape]
    depth = int(bp.shape[1])
    out_shape = list(ctx.out_shape())
    rows = 1
    for d in out_shape[:-1]:
        rows *= d
    cols = out_shape[-1]
    lead = a_dims[:-2]

    def a_at(i, kk):
        if trans_a:
            return a[kk, i]
        index = []
        rest = i
        for d in reversed(lead + [a_dims[-2]]):
            index.append(rest % d)
            rest = rest // d
        return a[tuple(reversed(index)) + (kk,)]

    k = te.reduce_axis((0, depth), "k")
    # Whole panels: the padded columns' sums land in the intermediate product and are never read.
    product = te.compute((rows, int(bp.shape[0]) * nb), lambda i, j: te.sum(a_at(i, k) * bp[j // nb, k, j % nb], axis=k), name="matmul_packed")

    flat = te.compute((rows, cols), lambda i, j: gemm_epilogue(product[i, j], i, j, alpha, beta, c, product.dtype),
                      name="matmul_out")

    def unflatten(*index):
        position = 0
        for idx, d in zip(index[:-1], out_shape[:-1]):
            position = position * d + idx
        return flat[position, index[-1]]

    out = te.compute(out_shape, unflatten, name="matmul_result") if len(out_shape) != 2 else flat
    mi = next(m for m in MATMUL_ROWS if rows % m == 0)
    panels = int(bp.shape[0])
    parallel = rows * cols * depth >= MIN_PARALLEL_WORK * 16
    # Panels per tile: mi x group accumulators in flight, leaving at least PARALLEL_TILES tiles to run in parallel
    # when the product runs in parallel.
    group = next(g for g in range(min(panels, INDEPENDENT_ACCUMULATORS // mi), 0, -1)
                 if panels % g == 0 and (g == 1 or not parallel or panels // g * (rows // mi) >= PARALLEL_TILES))

    def schedule(sch) -> None:
        block = sch.get_sblock("matmul_packed")
        # Accumulate each (mi x nb) tile in a small buffer LLVM keeps in registers, then copy it out:
        # accumulating in the kernel's intermediate buffer makes LLVM reload it whenever another
        # buffer of the kernel (a fused producer's) might alias it.
        tile_out = sch.cache_write(block, 0, "global")
        i, j, kk = sch.get_loops(block)
        io, ii = sch.split(i, [None, mi])
        jo, ji = sch.split(j, [None, nb])
        if group > 1:
            # A tile of one panel has mi <= 4 accumulators, each waiting on the FMA before it (a matrix-vector
            # product: one); a tile of `group` panels keeps mi x group independent ones in flight.
            jo, jg = sch.split(jo, [None, group])
            sch.reorder(jo, io, kk, jg, ii, ji)
            sch.unroll(jg)
        else:
            sch.reorder(jo, io, kk, ii, ji)
        sch.reverse_compute_at(tile_out, io)
        try_step(lambda: sch.vectorize(sch.get_loops(tile_out)[-1]))
        tiles = sch.fuse(jo, io) if panels // group < 8 else jo
        if parallel:
            sch.parallel(tiles)
        sch.unroll(ii)
        sch.vectorize(ji)
        sch.decompose_reduction(block, kk)
        tail = sch.get_sblock("matmul_out")
        if out is not flat:
            sch.compute_inline(tail)
            tail = sch.get_sblock("matmul_result")
        fused = sch.fuse(*sch.get_loops(tail))
        outer, inner = sch.split(fused, [None, next(f for f in (nb, 8, 4, 2, 1) if rows * cols % f == 0)])
        sch.vectorize(inner)
        if rows * cols >= MIN_PARALLEL_WORK:
            sch.parallel(outer)

    return SelfScheduled([out], schedule)
