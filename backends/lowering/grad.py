"""The gradient ops of reverse-mode autodiff (ir/grad_ops.py): ConvGradFilter, MaxPoolGrad, AveragePoolGrad.

These are the target-neutral rules; a dense ConvGradFilter on CPU runs as a register-tiled product instead
(backends/cpu/conv_grad_filter.py, chosen in backends/cpu/variants.py). The pool gradients are written as
gathers (each input element sums the windows that cover it), not scatters, so every output element is computed
once and the loops parallelize and vectorize like any reduction.
"""
from __future__ import annotations

from tessel.ir.grad_ops import Window

from ..tvm_env import tvm
from .context import LowerContext
from .reduce import NAN_MAX, lowest

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx


def _dims(tensor) -> list[int]:
    return [int(d) for d in tensor.shape]


def window_of(ctx: LowerContext, in_sizes, out_sizes) -> Window:
    """The op's window geometry over these spatial sizes."""
    return Window(ctx.attrs, in_sizes, out_sizes)


def pad_to_window(x, window: Window, value, name: str):
    """x padded by the window's pads before and, after, to every window's end (ceil_mode's last one included)."""
    after = [p - i - b for p, i, b in zip(window.padded_sizes(), window.in_sizes, window.before)]
    if not any(window.before) and not any(after):
        return x
    return topi.nn.pad(x, [0, 0] + list(window.before), [0, 0] + after, pad_value=value, name=name)


def conv_grad_filter(ctx: LowerContext):
    """dW[o, c, *k] = sum over n and output positions p of dy[n, o, p] * x_padded[n, group(o) * C/group + c, p*s + k*d]."""
    x, dy = ctx.input(0), ctx.input(1)
    window = window_of(ctx, _dims(x)[2:], _dims(dy)[2:])
    padded = pad_to_window(x, window, tir.const(0.0, x.dtype), "grad_filter_pad")
    groups = ctx.attr("group", 1)
    out_channels, group_channels = ctx.out_shape()[:2]
    per_group = out_channels // groups
    n = te.reduce_axis((0, _dims(x)[0]), name="n")
    positions = [te.reduce_axis((0, o), name=f"p{i}") for i, o in enumerate(window.out_sizes)]

    def body(o, c, *taps):
        channel = c if groups == 1 else (o // per_group) * group_channels + c
        at = [p * s + t * d for p, s, t, d in zip(positions, window.strides, taps, window.dilations)]
        return te.sum(dy[(n, o, *positions)].astype(ctx.out_dtype()) * padded[(n, channel, *at)], axis=[n, *positions])

    return [te.compute(ctx.out_shape(), body, name="conv_grad_filter")]


def _covering(window: Window, index, tap):
    """(output position, whether the window there covers `index` with `tap`) per spatial axis."""
    where, positions = [], []
    for i, t, b, s, d, o in zip(index, tap, window.before, window.strides, window.dilations, window.out_sizes):
        offset = i + b - t * d
        position = tir.floordiv(offset, s)
        where.append(tir.all(tir.floormod(offset, s) == 0, position >= 0, position < o))
        positions.append(position)
    return positions, tir.all(*where)


def _first_argmax(x, window: Window, out_shape):
    """Per window, the row-major tap number of its first maximum among its real elements (NaN counts as maximum);
    the kernel size when a window has no real element.

    Two single-value reductions (the maximum, then the first tap holding it): a tuple reduction would not survive
    the generic CPU schedule, which caches one output of a block."""
    taps = 1
    for k in window.kernel:
        taps *= k

    def tap_of(n, c, pos, axes):
        at, real, number = [], [], tir.const(0, "int32")
        for p, s, a, d, b, size, k in zip(pos, window.strides, axes, window.dilations, window.before,
                                          window.in_sizes, window.kernel):
            at.append(p * s + a * d - b)
            real.append(tir.all(at[-1] >= 0, at[-1] < size))
            number = number * k + a
        inside = tir.all(*real)
        return tir.if_then_else(inside, x[(n, c, *at)], lowest(x.dtype)), inside, number

    def peak(n, c, *pos):
        axes = [te.reduce_axis((0, k), name=f"m{i}") for i, k in enumerate(window.kernel)]
        return NAN_MAX(tap_of(n, c, pos, axes)[0], axis=axes)

    peaks = te.compute(out_shape, peak, name="pool_peak")

    def first(n, c, *pos):
        axes = [te.reduce_axis((0, k), name=f"f{i}") for i, k in enumerate(window.kernel)]
        value, inside, number = tap_of(n, c, pos, axes)
        top = peaks[(n, c, *pos)]
        hit = tir.all(inside, tir.any(value == top, tir.all(tir.isnan(value), tir.isnan(top))))
        return te.min(tir.Select(hit, number, tir.const(taps, "int32")), axis=axes)

    return te.compute(out_shape, first, name="pool_first_peak")


def max_pool_grad(ctx: LowerContext):
    """dx: each window's dy goes to its first maximum (row-major), as PyTorch's max_pool backward."""
    x, dy = ctx.input(0), ctx.input(1)
    window = window_of(ctx, _dims(x)[2:], _dims(dy)[2:])
    first = _first_argmax(x, window, _dims(dy))
    axes = [te.reduce_axis((0, k), name=f"t{i}") for i, k in enumerate(window.kernel)]
    zero = tir.const(0.0, dy.dtype)

    def body(n, c, *index):
        positions, covers = _covering(window, index, axes)
        number = tir.const(0, "int32")
        for a, k in zip(axes, window.kernel):
            number = number * k + a
        chosen = tir.all(covers, first[(n, c, *positions)] == number)
        return te.sum(tir.if_then_else(chosen, dy[(n, c, *positions)], zero), axis=axes)

    return [te.compute(_dims(x), body, name="max_pool_grad")]


def _window_count(window: Window, include_pad: bool, position):
    """How many taps of the window at `position` (per axis) count in its average, as PyTorch counts."""
    count = tir.const(1, "int32")
    for o, i, b, a, s, k, d in zip(position, window.in_sizes, window.before, window.after, window.strides,
                                   window.kernel, window.dilations):
        start = o * s - b
        low, high = (-b, i + a) if include_pad else (0, i)
        first = tir.max(tir.min(tir.floordiv(low - start + d - 1, d), k), 0)
        end = tir.max(tir.min(tir.floordiv(high - start + d - 1, d), k), 0)
        count = count * tir.max(end - first, 1)
    return count


def average_pool_grad(ctx: LowerContext):
    """dx: each window's dy divided by its count, summed over the windows that cover the element."""
    dy = ctx.input(0)
    shape = list(ctx.out_shape())
    window = window_of(ctx, shape[2:], _dims(dy)[2:])
    include = bool(ctx.attr("count_include_pad", 0))
    share = te.compute(
        _dims(dy),
        lambda n, c, *o: dy[(n, c, *o)] / _window_count(window, include, o).astype(dy.dtype),
        name="avg_pool_share")
    axes = [te.reduce_axis((0, k), name=f"t{i}") for i, k in enumerate(window.kernel)]
    zero = tir.const(0.0, dy.dtype)

    def body(n, c, *index):
        positions, covers = _covering(window, index, axes)
        return te.sum(tir.if_then_else(covers, share[(n, c, *positions)], zero), axis=axes)

    return [te.compute(shape, body, name="avg_pool_grad")]


RULES = {
    "ConvGradFilter": conv_grad_filter,
    "MaxPoolGrad": max_pool_grad,
    "AveragePoolGrad": average_pool_grad,
}
