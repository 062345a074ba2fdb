"""2-D MaxPool on CPU, separable: the max over each window's column first, then over its row.

The generic rule (lowering/nn.py) reduces each kh×kw window on its own into a register tile of output pixels.
Where a window reads padding it first makes a padded copy of the input in a scalar loop (ResNet-18's stem pool:
~1 ms of the model's ~10), and an output row no vector width divides leaves it short vectors or scalar loops. Here
each output row is made in two steps, vectorized along the row, as in the note on MaxPool with stride < kernel in
issue 17:

1. `pool_cols`: the max of the kh input rows under the output row, element by element over the padded row's width
   (contiguous loads; a position in the padding reads -inf through a select, so no padded copy is made);
2. `pool_rows`: the max of kw neighbours of that row, one output pixel per lane.

That is kh + kw compares per pixel of the kh×kw window's kh·kw (fewer for stride 1, as YOLO's 5×5 SPPF pools; the
same count for 3×3 stride 2, where the gain is contiguous loads and no padded copy). The column maxima live in a
per-row scratch row (stack, per thread) computed under the output row's loop. Both steps keep NaN as the generic
rule does: a NaN anywhere in a window is the window's max.

A pool whose input arrives in NCHW[16]c (passes/conv_layout.py keeps it blocked between conv kernels: YOLO's SPPF)
runs the same two steps on the blocks, one 16-channel vector per pixel: its rows of 10 pixels (YOLOv8n at 320)
are no vector width.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..lowering.pool import pool_window
from ..lowering.reduce import lowest
from ..tvm_env import tvm
from .schedule import lanes_for, reads_blocks, try_step

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

# A pool with fewer output rows (N·C·OH) than this runs on one thread. Measured on 2 threads (TVM's time_evaluator,
# min of 3 medians): two threads lost up to 960 rows (captcha_crnn's 64×15 rows: 12.7 µs on one thread, 14.5 on two;
# mtcnn_onet's 32×23: 7.9 and 9.8) and won from 1280 (YOLOv8n's 5×5 SPPF, 128×10 rows: 46 and 33 µs).
MIN_PARALLEL_ROWS = 1024
# A row up to this many lanes is one vector (LLVM splits it in 16-lane pieces); a longer one is split in 16s.
MAX_WHOLE_ROW = 64
LANES = 16
# The scope of a row's scratch, allocated inside the parallel row loop: on the thread's stack when under 1 KiB
# (padded rows up to 255 floats; a wider one costs a workspace call per row, as before). "global", not "local":
# TVM's LowerTVMBuiltin keeps only global-scope CPU allocations under 1 KiB on the stack and turns every other one
# into a TVMBackendAllocWorkspace / FreeWorkspace pair, here one per row. inception_v2's
# AveragePool over 576 × 14² (8064 rows of 14 pixels) took 0.092 ms with "local" and 0.046 with "global"
# (TVM's time_evaluator, 2 threads, quiet).
ROW_SCRATCH = "global"


def applies(ctx: LowerContext) -> bool:
    """Whether the separable kernel runs this MaxPool: CPU, float32, 2-D windows, no Indices output, and not a
    window the generic schedule already runs well.

    That is a window that reads no padding with output rows a vector width divides: the generic schedule then keeps
    a row of outputs in registers over the window (oww_embedding's 2×2 stride-2 pools of 16-pixel rows: 1.6 µs,
    separable 7.0 µs; mtcnn_rnet's last one, 4 pixels wide: 1.4 and 1.6 µs). Padding costs it a padded copy made
    by a scalar loop, and other rows a scalar or gathering loop (mtcnn_onet's first pool: 43.5 µs, separable 7.9).
    """
    x = ctx.input(0)
    wants_indices = len(ctx.output_types) > 1 and ctx.output_types[1] is not None
    if ctx.gpu or str(x.dtype) != "float32" or len(x.shape) != 4 or wants_indices:
        return False
    kernel, strides, dilations, before, after = pool_window(ctx, x)
    in_dims = [int(d) for d in x.shape[2:]]
    out_dims = list(ctx.out_shape())[2:]
    reads = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(out_dims, strides, kernel, dilations)]
    padded = any(before) or any(r > i for r, i in zip(reads, in_dims))
    return padded or lanes_for(out_dims[-1]) is None


def reads_channel_blocks(ctx: LowerContext) -> bool:
    """Whether the blocked kernel runs this MaxPool: float32 on CPU, 2-D windows, no Indices output, its input the
    view of an NCHW[16]c argument."""
    x = ctx.input(0)
    wants_indices = len(ctx.output_types) > 1 and ctx.output_types[1] is not None
    return (not ctx.gpu and str(x.dtype) == "float32" and len(x.shape) == 4 and not wants_indices
            and reads_blocks(x))


def is_nan(value):
    """TIR: whether a float32 value is NaN, from its bits (exponent all ones, a fraction that is not zero).

    Not `tir.isnan`: TVM's VectorizeLoop does not vectorize that call and turns the whole loop back into scalars
    (LLVM then vectorized the blocked pool across pixels, with gathers: ResNet-18's stem pool took 0.18-0.23 ms in the
    model instead of 0.05-0.10; YOLOv8n's 5 × 5 SPPF pools 0.017 instead of 0.004); and not `value != value`, which
    TVM's simplifier folds to false."""
    u32 = "uint32"
    return (tir.reinterpret(u32, value) & tir.const(0x7FFFFFFF, u32)) > tir.const(0x7F800000, u32)


def fold_max(values, dtype, nan_test=tir.isnan):
    """The max of `values`, NaN when one of them is: a plain max and an any-NaN flag, each value read once by each.

    Folding NAN_MAX's combine instead (a select that reads its accumulator three times) makes an expression of
    3^(k-1) terms for a window of k: TVM took minutes to build a 5×5 pool. `nan_test`: `is_nan` where TVM must
    vectorize the loop itself (the blocked kernel's 16 lanes); the separable kernel's rows keep `tir.isnan`, whose
    scalar loops LLVM vectorizes better than TVM does a whole strided row (ResNet's stem pool on NCHW: 0.13 ms,
    0.30 with is_nan, alone, niced).
    """
    top, nan = values[0], nan_test(values[0])
    for value in values[1:]:
        top, nan = tir.max(top, value), tir.Or(nan, nan_test(value))
    return tir.Select(nan, tir.const(float("nan"), dtype), top)


def max_pool_separable(ctx: LowerContext) -> SelfScheduled:
    """MaxPool of x (N, C, H, W) as `pool_cols` then `pool_rows` (see the module docstring), with its schedule."""
    x = ctx.input(0)
    n, c, h, w = (int(d) for d in x.shape)
    (kh, kw), (sh, sw), (dh, dw), (bh, bw), _ = pool_window(ctx, x)
    out_shape = [int(d) for d in ctx.out_shape()]
    oh, ow = out_shape[2:]
    width = (ow - 1) * sw + (kw - 1) * dw + 1  # the padded input columns the row's windows cover
    floor = lowest(x.dtype)

    def read(ni, ci, y, xw):
        """x at (y, xw) of the padded input: -inf in the padding (and past a ceil-mode overhang)."""
        conditions = []
        if bh or (oh - 1) * sh + (kh - 1) * dh + 1 - bh > h:
            conditions.append(tir.all(y >= 0, y < h))
        if bw or width - bw > w:
            conditions.append(tir.all(xw >= 0, xw < w))
        if not conditions:
            return x[ni, ci, y, xw]
        value = x[ni, ci, tir.max(tir.min(y, h - 1), 0), tir.max(tir.min(xw, w - 1), 0)]
        return tir.Select(tir.all(*conditions), value, floor)

    cols = te.compute(
        (n, c, oh, width),
        lambda ni, ci, yo, xw: fold_max([read(ni, ci, yo * sh + i * dh - bh, xw - bw) for i in range(kh)], x.dtype),
        name="pool_cols")
    rows = te.compute(
        out_shape,
        lambda ni, ci, yo, xo: fold_max([cols[ni, ci, yo, xo * sw + j * dw] for j in range(kw)], x.dtype),
        name="pool_rows")
    parallel = n * c * oh >= MIN_PARALLEL_ROWS

    def schedule(sch) -> None:
        scratch = schedule_pool_rows(sch, "pool_rows", "pool_cols", ow, parallel)
        vectorize_pool_row(sch, sch.get_loops(scratch)[-1], width)

    return SelfScheduled([rows], schedule)


def max_pool_blocks(ctx: LowerContext) -> SelfScheduled:
    """MaxPool of an NCHW[b]c input (`reads_channel_blocks`) in the two steps, each pixel's b channels one vector.

    The result is NCHW (lower.py writes it as blocks when it is kept blocked: the same loop then writes each
    pixel's vector whole)."""
    x = ctx.input(0)
    source = x.op.input_tensors[0]  # the (N, C/b, H, W, b) argument x is the NCHW view of
    n, blocks, h, w, lanes = (int(d) for d in source.shape)
    (kh, kw), (sh, sw), (dh, dw), (bh, bw), _ = pool_window(ctx, x)
    out_shape = [int(d) for d in ctx.out_shape()]
    oh, ow = out_shape[2:]
    width = (ow - 1) * sw + (kw - 1) * dw + 1
    floor = lowest(x.dtype)

    def read(ni, co, y, xw, ci):
        """The input at (y, xw) of the padded input: -inf in the padding."""
        inside = tir.all(y >= 0, y < h, xw >= 0, xw < w)
        value = source[ni, co, tir.max(tir.min(y, h - 1), 0), tir.max(tir.min(xw, w - 1), 0), ci]
        return tir.Select(inside, value, floor)

    cols = te.compute(
        (n, blocks, oh, width, lanes),
        lambda ni, co, yo, xw, ci: fold_max([read(ni, co, yo * sh + i * dh - bh, xw - bw, ci) for i in range(kh)],
                                            x.dtype, is_nan),
        name="pool_cols")
    rows = te.compute(
        out_shape,
        lambda ni, c, yo, xo: fold_max([cols[ni, c // lanes, yo, xo * sw + j * dw, c % lanes] for j in range(kw)],
                                       x.dtype, is_nan),
        name="pool_rows")
    # As many channel rows as the NCHW kernel's threshold counts.
    parallel = n * blocks * lanes * oh >= MIN_PARALLEL_ROWS

    def schedule(sch) -> None:
        block = sch.get_sblock("pool_rows")
        batch, channel, row, column = sch.get_loops(block)
        channel_block, lane = sch.split(channel, [None, lanes])
        sch.reorder(batch, channel_block, row, column, lane)
        outer = sch.fuse(batch, channel_block, row)
        if parallel:
            sch.parallel(outer)
        sch.vectorize(lane)
        scratch = sch.get_sblock("pool_cols")
        sch.compute_at(scratch, outer)
        sch.set_scope(scratch, 0, ROW_SCRATCH)
        try_step(lambda: sch.vectorize(sch.get_loops(scratch)[-1]))

    return SelfScheduled([rows], schedule)


def schedule_pool_rows(sch, rows: str, cols: str, out_width: int, parallel: bool):
    """A separable pool's schedule: the output rows `rows` (in parallel when `parallel`), each vectorized, and the
    column pass `cols` computed per row into a scratch row on the thread's stack; returns the `cols` block."""
    batch, channel, row, column = sch.get_loops(sch.get_sblock(rows))
    outer = sch.fuse(batch, channel, row)
    if parallel:
        sch.parallel(outer)
    vectorize_pool_row(sch, column, out_width)
    scratch = sch.get_sblock(cols)
    sch.compute_at(scratch, outer)
    sch.set_scope(scratch, 0, ROW_SCRATCH)
    return scratch


def vectorize_pool_row(sch, loop, extent: int) -> None:
    """Vectorize a row loop: whole up to MAX_WHOLE_ROW lanes, else in LANES-wide pieces where LANES divides it."""
    if extent <= MAX_WHOLE_ROW:
        try_step(lambda: sch.vectorize(loop))
    elif extent % LANES == 0:
        _, lanes = sch.split(loop, [None, LANES])
        try_step(lambda: sch.vectorize(lanes))
