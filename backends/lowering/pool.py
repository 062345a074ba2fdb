"""Window pooling of any spatial rank written out as TE reductions: average pooling where TOPI's pool1d/pool2d
do not apply (3-D, or a ceil-mode window that starts in the padding), LpPool and GlobalLpPool; and the
window pads (explicit or auto_pad) that pools and convolutions share.

A window position is real data when it lies inside the input, padding when it lies inside the explicit pads,
and outside both when ceil mode adds a last window that overhangs the pads; padding counts toward an average's
divisor only with count_include_pad, the overhang never does (as in ONNX's reference).
"""
from __future__ import annotations

from ..tvm_env import tvm
from .context import LowerContext

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx


def _same_pads(auto_pad, in_sizes, out_sizes, kernel, strides, dilations):
    before, after = [], []
    for i, o, k, s, d in zip(in_sizes, out_sizes, kernel, strides, dilations):
        total = max((o - 1) * s + (k - 1) * d + 1 - i, 0)
        small = total // 2
        if auto_pad == "SAME_UPPER":
            before.append(small)
            after.append(total - small)
        else:
            before.append(total - small)
            after.append(small)
    return before, after


def window_pads(ctx: LowerContext, in_sizes, out_sizes, kernel, strides, dilations):
    """(pads before, pads after) per spatial axis, from `pads` or `auto_pad`."""
    n = len(in_sizes)
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return _same_pads(auto_pad, in_sizes, out_sizes, kernel, strides, dilations)
    if auto_pad == "VALID":
        return [0] * n, [0] * n
    pads = list(ctx.attr("pads") or [0] * (2 * n))
    return pads[:n], pads[n:]


def pool_window(ctx: LowerContext, x):
    """(kernel, strides, dilations, pads before, pads after) of a pooling op's window over x's spatial axes."""
    spatial = len(x.shape) - 2
    kernel = list(ctx.attr("kernel_shape"))
    strides = list(ctx.attr("strides") or [1] * spatial)
    dilations = list(ctx.attr("dilations") or [1] * spatial)
    before, after = window_pads(ctx, [int(d) for d in x.shape[2:]], list(ctx.out_shape())[2:], kernel, strides,
                                dilations)
    return kernel, strides, dilations, before, after


def _inside(positions, low, high):
    conditions = [tir.all(p >= lo, p < hi) for p, lo, hi in zip(positions, low, high)]
    return tir.all(*conditions) if len(conditions) > 1 else conditions[0]


def _window_sum(x, kernel, strides, dilations, before, out_shape, value, name: str):
    """Σ value(x) over each window, reading only positions inside the input."""
    in_dims = [int(d) for d in x.shape[2:]]
    window = [te.reduce_axis((0, k), name=f"w{i}") for i, k in enumerate(kernel)]
    zero = tir.const(0, x.dtype)

    def body(n, c, *pos):
        at = [p * s + w * d - b for p, s, w, d, b in zip(pos, strides, window, dilations, before)]
        clamped = [tir.max(tir.min(a, size - 1), 0) for a, size in zip(at, in_dims)]
        inside = _inside(at, [0] * len(at), in_dims)
        return te.sum(tir.Select(inside, value(x[(n, c, *clamped)]), zero), axis=window)

    return te.compute(out_shape, body, name=name)


def _window_count(kernel, strides, dilations, before, low, high, out_shape, dtype):
    """How many positions of each window lie in [low, high) per axis (positions relative to the input)."""
    window = [te.reduce_axis((0, k), name=f"c{i}") for i, k in enumerate(kernel)]

    def body(n, c, *pos):
        at = [p * s + w * d - b for p, s, w, d, b in zip(pos, strides, window, dilations, before)]
        return te.sum(tir.Select(_inside(at, low, high), tir.const(1, dtype), tir.const(0, dtype)), axis=window)

    return te.compute(out_shape, body, name="window_count")


def average_pool(x, kernel, strides, dilations, before, after, out_shape, include_pad: bool):
    """AveragePool over the trailing axes of (N, C, ...)."""
    in_dims = [int(d) for d in x.shape[2:]]
    total = _window_sum(x, kernel, strides, dilations, before, out_shape, lambda v: v, "avg_pool_sum")
    low = [-b for b in before] if include_pad else [0] * len(in_dims)
    high = [n + a for n, a in zip(in_dims, after)] if include_pad else in_dims
    count = _window_count(kernel, strides, dilations, before, low, high, out_shape, x.dtype)
    return topi.divide(total, count)


def _lp_root(total, p: int, dtype):
    if p == 1:
        return total
    if p == 2:
        return topi.sqrt(total)
    return topi.power(total, tir.const(1.0 / p, dtype))


def _power(v, p: int):
    magnitude = tir.abs(v)
    if p == 1:
        return magnitude
    if p == 2:
        return magnitude * magnitude
    return tir.power(magnitude, tir.const(float(p), v.dtype))


def _lp_pool(ctx: LowerContext):
    """(Σ |x|^p)^(1/p) over each window; padding is zero."""
    x = ctx.input(0)
    kernel, strides, dilations, before, _ = pool_window(ctx, x)
    out_shape = list(ctx.out_shape())
    p = ctx.attr("p", 2)
    total = _window_sum(x, kernel, strides, dilations, before, out_shape, lambda v: _power(v, p), "lp_pool_sum")
    return [_lp_root(total, p, x.dtype)]


def _global_lp_pool(ctx: LowerContext):
    """(Σ |x|^p)^(1/p) over all spatial axes."""
    x = ctx.input(0)
    p = ctx.attr("p", 2)
    powered = te.compute(x.shape, lambda *i: _power(x[i], p), name="lp_power")
    return [_lp_root(topi.sum(powered, list(range(2, len(x.shape))), True), p, x.dtype)]


RULES = {
    "LpPool": _lp_pool,
    "GlobalLpPool": _global_lp_pool,
}
