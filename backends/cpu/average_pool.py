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
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..lowering.pool import pool_window
from ..tvm_env import tvm
from .max_pool import MIN_PARALLEL_ROWS, schedule_pool_rows

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx


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
