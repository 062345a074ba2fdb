"""MaxPoolWithTaps on CPU in one pass: each window's maximum and the tap of its first maximum found together.

The target-neutral rule (lowering/grad.py) pools, then searches every window a second time for the first tap that
holds the maximum (ResNet-18's stem pool at batch 32, one thread: 131 ms, against 86 ms for the plain pool).
Here each output row is made as the separable pool makes it (max_pool.py), the taps riding along:

1. `taps_cols`: per column of the padded row's width, the max of the kh input rows under the output row, and the
   first of those rows that holds it (kh when none is a real element: a column in the padding);
2. `taps_rows`: per output pixel, the max of its kw columns, and its tap: the least row-major number
   (row · kw + column) among the columns that hold the maximum, so the first maximum in row-major order wins
   (PyTorch's rule), ties included.

Both steps are vectorized along the row and live in per-row scratch rows (stack, per thread) under the output
row's loop, so x comes from memory once (the first-row search looks at the kh rows again while they are in L1). NaN counts as the maximum, and the first NaN takes the tap, as in the generic rule.
"""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..lowering.pool import pool_window
from ..lowering.reduce import lowest
from ..tvm_env import tvm
from .max_pool import LANES, MAX_WHOLE_ROW, MIN_PARALLEL_ROWS, ROW_SCRATCH, fold_max, vectorize_pool_row

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx


def applies(ctx: LowerContext) -> bool:
    """Whether this kernel runs the MaxPoolWithTaps: CPU, float32, 2-D windows (else the generic rule)."""
    x = ctx.input(0)
    return not ctx.gpu and str(x.dtype) == "float32" and len(x.shape) == 4


def _holds(value, top):
    """Whether `value` is the maximum `top`: equal, or both NaN."""
    return tir.Or(value == top, tir.And(tir.isnan(value), tir.isnan(top)))


def _first(hits, numbers, none):
    """The number of the first true hit (hits in order), `none` when no hit is true."""
    chosen = none
    for hit, number in zip(reversed(hits), reversed(numbers)):
        chosen = tir.Select(hit, number, chosen)
    return chosen


def max_pool_with_taps(ctx: LowerContext) -> SelfScheduled:
    """(MaxPool of x (N, C, H, W), each window's first-maximum tap as int32) in one pass, with its schedule."""
    x = ctx.input(0)
    n, c, h, w = (int(d) for d in x.shape)
    (kh, kw), (sh, sw), (dh, dw), (bh, bw), _ = pool_window(ctx, x)
    out_shape = [int(d) for d in ctx.out_shape()]
    oh, ow = out_shape[2:]
    width = (ow - 1) * sw + (kw - 1) * dw + 1  # the padded input columns the row's windows cover
    if width > MAX_WHOLE_ROW:
        # Whole vectors: the columns past `width` read as padding and are never used (the stem pool's 113 columns
        # would otherwise be a scalar loop).
        width = -(-width // LANES) * LANES
    floor = lowest(x.dtype)
    none = tir.const(kh, "int32")
    rows_real = bh > 0 or (oh - 1) * sh + (kh - 1) * dh + 1 - bh > h
    cols_real = bw > 0 or width - bw > w

    def column(ni, ci, yo, xw):
        """The kh values under (yo, padded column xw), -inf in the padding, and whether each is a real element."""
        values, real = [], []
        col = xw - bw
        for i in range(kh):
            y = yo * sh + i * dh - bh
            inside = []
            if rows_real:
                inside.append(tir.all(y >= 0, y < h))
            if cols_real:
                inside.append(tir.all(col >= 0, col < w))
            if not inside:
                values.append(x[ni, ci, y, col])
                real.append(tir.const(True, "bool"))
                continue
            value = x[ni, ci, tir.max(tir.min(y, h - 1), 0), tir.max(tir.min(col, w - 1), 0)]
            real.append(tir.all(*inside))
            values.append(tir.Select(real[-1], value, floor))
        return values, real

    def cols_max_body(ni, ci, yo, xw):
        return fold_max(column(ni, ci, yo, xw)[0], x.dtype)

    col_max = te.compute((n, c, oh, width), cols_max_body, name="taps_col_max")

    def cols_row_body(ni, ci, yo, xw):
        values, real = column(ni, ci, yo, xw)
        top = col_max[ni, ci, yo, xw]
        hits = [tir.And(r, _holds(v, top)) for v, r in zip(values, real)]
        return _first(hits, [tir.const(i, "int32") for i in range(kh)], none)

    col_row = te.compute((n, c, oh, width), cols_row_body, name="taps_col_row")
    pooled = te.compute(
        out_shape,
        lambda ni, ci, yo, xo: fold_max([col_max[ni, ci, yo, xo * sw + j * dw] for j in range(kw)], x.dtype),
        name="taps_pooled")
    never = tir.const(kh * kw, "int32")

    def taps_body(ni, ci, yo, xo):
        top = pooled[ni, ci, yo, xo]
        taps = never
        for j in range(kw):
            at = xo * sw + j * dw
            row = col_row[ni, ci, yo, at]
            hit = tir.And(row < none, _holds(col_max[ni, ci, yo, at], top))
            taps = tir.min(taps, tir.Select(hit, row * kw + j, never))
        return taps

    taps = te.compute(out_shape, taps_body, name="taps_first")
    parallel = n * c * oh >= MIN_PARALLEL_ROWS

    def schedule(sch) -> None:
        # The first producer leads, each later block goes under its row loop (compute_at cannot move the pooled
        # output block, reverse_compute_at can): per output row, x is read into the column scratch once.
        block = sch.get_sblock("taps_col_max")
        batch, channel, row, col = sch.get_loops(block)
        outer = sch.fuse(batch, channel, row)
        if parallel:
            sch.parallel(outer)
        vectorize_pool_row(sch, col, width)
        for name, extent in (("taps_col_row", width), ("taps_pooled", ow), ("taps_first", ow)):
            later = sch.get_sblock(name)
            sch.reverse_compute_at(later, outer)
            vectorize_pool_row(sch, sch.get_loops(later)[-1], extent)
        # The column scratch: one row per parallel row, on its thread's stack under 1 KiB (max_pool.ROW_SCRATCH).
        for name in ("taps_col_max", "taps_col_row"):
            sch.set_scope(sch.get_sblock(name), 0, ROW_SCRATCH)

    return SelfScheduled([pooled, taps], schedule)
