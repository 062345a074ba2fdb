"""2-D AveragePool on CPU, separable: the sum over each window's column first, then over its row, times 1/count.

The generic rule (TOPI's pool2d, or lowering/pool.py's window sums) reduces each window on its own, scalar where
the window reads padding: ShuffleNet's 3×3 stride-2 pools with pads of 1 took 0.048, 0.030 and 0.015 ms in the
model, 0.025, 0.022 and 0.010 here (min of 3 runs' 100 calls; OpenVINO's nChw16c pools: 0.006, 0.003, 0.005).
Here each output row is made as max_pool.py makes a MaxPool's:

1. `avg_cols`: the sum of the kh input rows under the output row, element by element over the padded row's width
   (contiguous loads; a position in the padding reads 0 through a select, so no padded copy is made);
2. `avg_rows`: the sum of kw neighbours of that row, one output pixel per lane, divided by the count.

A window's count is the product of its rows' and its columns' counts: the positions inside the input, or inside
input and pads with count_include_pad (a ceil-mode overhang past the pads never counts, as in ONNX's reference),
each a min/max of the window's bounds. The column sums live in a per-row scratch row (stack, per thread).

A pool that is its kernel alone (`LowerContext.whole_kernel`), stride 1 along rows whose padded width fits one
vector, is written by hand (`average_pool_by_rows`): TE's column pass reads the padding through a Select, which TVM
cannot vectorize without loading outside the input, so LLVM ran it as scalars. By hand, each row's scratch is
zeroed (its padding stays 0), then the input rows under the output row are added in, each one vector, and only rows
inside the input are read (a branch per row). inception_v2's 3×3 stride-1 pools took, in the model (min of 2
rounds' per-kernel medians of 100 runs): 0.046 ms in TE and 0.011 by hand over 576 × 14², 0.038 and 0.010 over
1024 × 7². Wider or strided rows measured slower by hand (256 × 28²: 0.045 and 0.055 ms; ShuffleNet's stride-2
pools: 0.004 and 0.009): they keep the TE kernel.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..lowering.pool import pool_window
from ..lowering.rnn import PrimFuncResult
from ..tvm_env import tvm
from .max_pool import LANES, MIN_PARALLEL_ROWS, ROW_SCRATCH, schedule_pool_rows

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.script.ir_builder import tirx as T  # noqa: E402


def applies(ctx: LowerContext) -> bool:
    """Whether the separable kernel runs this AveragePool: CPU, float32, 2-D windows without dilation that read
    padding (or overhang the input in ceil mode).

    A window inside the input keeps the generic rule, which needs no count per window: ShuffleNet's last pool (7×7
    over 7×7 pixels) took 0.003 ms generic and 0.006 separable (in the model, min of 3 runs' 100 calls)."""
    x = ctx.input(0)
    if ctx.gpu or str(x.dtype) != "float32" or len(x.shape) != 4:
        return False
    kernel, strides, dilations, before, _ = pool_window(ctx, x)
    if list(dilations) != [1, 1]:
        return False
    in_dims = [int(d) for d in x.shape[2:]]
    reads = [(o - 1) * s + k for o, s, k in zip(list(ctx.out_shape())[2:], strides, kernel)]
    return any(before) or any(r > i for r, i in zip(reads, in_dims))


def _count(start, kernel: int, low: int, high: int):
    """TIR: how many of the positions start, ..., start + kernel - 1 lie in [low, high)."""
    first = tir.max(start, low)
    last = tir.min(start + kernel, high)
    return tir.max(last - first, 0)


def average_pool_separable(ctx: LowerContext) -> SelfScheduled:
    """AveragePool of x (N, C, H, W) as `avg_cols` then `avg_rows` (see the module docstring), with its schedule."""
    x = ctx.input(0)
    n, c, h, w = (int(d) for d in x.shape)
    (kh, kw), (sh, sw), _, (bh, bw), (ah, aw) = pool_window(ctx, x)
    include = bool(ctx.attr("count_include_pad", 0))
    out_shape = [int(d) for d in ctx.out_shape()]
    oh, ow = out_shape[2:]
    width = (ow - 1) * sw + kw  # the padded input columns the row's windows cover
    zero = tir.const(0.0, x.dtype)
    low_h, high_h = (-bh, h + ah) if include else (0, h)
    low_w, high_w = (-bw, w + aw) if include else (0, w)

    def read(ni, ci, y, xw):
        """x at (y, xw) of the padded input: 0 in the padding (and past a ceil-mode overhang)."""
        conditions = []
        if bh or (oh - 1) * sh + kh - bh > h:
            conditions.append(tir.all(y >= 0, y < h))
        if bw or width - bw > w:
            conditions.append(tir.all(xw >= 0, xw < w))
        if not conditions:
            return x[ni, ci, y, xw]
        value = x[ni, ci, tir.max(tir.min(y, h - 1), 0), tir.max(tir.min(xw, w - 1), 0)]
        return tir.Select(tir.all(*conditions), value, zero)

    def column_sum(ni, ci, yo, xw):
        total = read(ni, ci, yo * sh - bh, xw - bw)
        for i in range(1, kh):
            total = total + read(ni, ci, yo * sh + i - bh, xw - bw)
        return total

    cols = te.compute((n, c, oh, width), column_sum, name="avg_cols")

    def row_mean(ni, ci, yo, xo):
        total = cols[ni, ci, yo, xo * sw]
        for j in range(1, kw):
            total = total + cols[ni, ci, yo, xo * sw + j]
        count = _count(yo * sh - bh, kh, low_h, high_h) * _count(xo * sw - bw, kw, low_w, high_w)
        return total / count.astype(x.dtype)

    rows = te.compute(out_shape, row_mean, name="avg_rows")
    parallel = n * c * oh >= MIN_PARALLEL_ROWS

    def schedule(sch) -> None:
        # The column pass's loop is left to LLVM: TVM's simplifier drops the clamps of the reads under their Selects,
        # and a loop TVM vectorized would then load the padding's positions outside x (a guard page faults); LLVM
        # vectorizes the scalar loop with masked loads.
        schedule_pool_rows(sch, "avg_rows", "avg_cols", ow, parallel)

    return SelfScheduled([rows], schedule)


def runs_by_rows(ctx: LowerContext) -> bool:
    """Whether `average_pool_by_rows` writes this pool (that `applies`): alone in its kernel, stride 1 along the
    rows, the padded row at most one vector (module docstring)."""
    if not ctx.whole_kernel:
        return False
    x = ctx.input(0)
    (_, kw), (_, sw), _, _, _ = pool_window(ctx, x)
    return sw == 1 and int(ctx.out_shape()[3]) - 1 + kw <= LANES


def average_pool_by_rows(ctx: LowerContext) -> PrimFuncResult:
    """The whole kernel of an AveragePool of x (N, C, H, W) that `runs_by_rows`, row by row (module docstring)."""
    x = ctx.input(0)
    n, c, h, w = (int(d) for d in x.shape)
    (kh, kw), (sh, _), _, (bh, bw), (ah, aw) = pool_window(ctx, x)
    include = bool(ctx.attr("count_include_pad", 0))
    oh, ow = (int(d) for d in ctx.out_shape()[2:])
    width = ow - 1 + kw  # the padded input columns the row's windows cover
    cover = min(w, width - bw)  # the input columns they reach
    low_h, high_h = (-bh, h + ah) if include else (0, h)
    low_w, high_w = (-bw, w + aw) if include else (0, w)
    rows = n * c * oh
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("main")
            T.func_attr({"tirx.noalias": True})
            source = T.arg("in0", T.buffer((n, c, h, w), x.dtype))
            result = T.arg("out0", T.buffer((n, c, oh, ow), x.dtype))
            with (T.parallel if rows >= MIN_PARALLEL_ROWS else T.serial)(0, rows) as row:
                plane, yo = row // oh, row % oh
                ni, ci = plane // c, plane % c
                sums = T.alloc_buffer((width,), x.dtype, scope=ROW_SCRATCH)
                with T.vectorized(0, width) as j:
                    T.buffer_store(sums, tir.const(0.0, x.dtype), [j])
                for i in range(kh):
                    y = yo * sh - bh + i
                    with T.If(tir.all(y >= 0, y < h)):
                        with T.Then():
                            with T.vectorized(0, cover) as j:
                                T.buffer_store(sums, sums[bw + j] + source[ni, ci, y, j], [bw + j])
                with T.vectorized(0, ow) as xo:
                    total = sums[xo]
                    for j in range(1, kw):
                        total = total + sums[xo + j]
                    count = _count(yo * sh - bh, kh, low_h, high_h) * _count(xo - bw, kw, low_w, high_w)
                    T.buffer_store(result, total / count.astype(x.dtype), [ni, ci, yo, xo])
    return PrimFuncResult(ib.get())
