"""The gradient ops of reverse-mode autodiff and the training rewrites (ir/grad_ops.py): ConvGradFilter, MaxPoolGrad,
MaxPoolWithTaps and MaxPoolTapsGrad, AveragePoolGrad, BatchStats.

These are the target-neutral rules; a dense ConvGradFilter on CPU runs as a register-tiled product instead
(backends/cpu/conv_grad_filter.py, chosen in backends/cpu/variants.py), and a 2-D MaxPoolWithTaps and a BatchStats
read x once there (backends/cpu/max_pool_taps.py, backends/cpu/batch_stats.py). The pool gradients are written as
gathers (each input element sums the windows that cover it), not scatters, so every output element is computed
once and the loops parallelize and vectorize like any reduction.
"""
from __future__ import annotations

import itertools

from tessel.ir.grad_ops import Window

from ..tvm_env import tvm
from .context import LowerContext
from .conv_transpose import axis_taps
from .nn import nan_max_pool
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


def _phase_gather(window: Window, sources, contribution, shape, dtype, name: str):
    """dx[n, c, *i] = Σ over the windows covering i of contribution(values, tap), computed per phase (i mod stride).

    Within one phase the taps that reach an input element are a fixed progression at fixed window offsets
    (lowering/conv_transpose.py's axis_taps), so no tap is tried and rejected; `sources` (per-window tensors
    (N, C, *So) with their padding values) are padded so every reach lands inside them. `contribution` gets each
    source's value at the window and the window's row-major tap number."""
    rank = len(window.kernel)
    per_axis = [{ph: axis_taps(ph, b, s, d, k) for ph in range(s)}
                for b, s, d, k in zip(window.before, window.strides, window.dilations, window.kernel)]
    phases = list(itertools.product(*(range(s) for s in window.strides)))

    def phase_size(axis, ph):
        return len(range(ph, window.in_sizes[axis], window.strides[axis]))

    low, high = [0] * rank, [0] * rank
    for axis in range(rank):
        for ph, taps in per_axis[axis].items():
            if taps.count and phase_size(axis, ph):
                low[axis] = max(low[axis], (taps.count - 1) * taps.shift - taps.base)
                high[axis] = max(high[axis], phase_size(axis, ph) - 1 + taps.base - (window.out_sizes[axis] - 1))
    padded = [topi.nn.pad(t, [0, 0] + low, [0, 0] + high, pad_value=v, name=f"{name}_pad{k}") if any(low + high)
              else t for k, (t, v) in enumerate(sources)]
    def part(phase, taps, sizes):
        axes = [te.reduce_axis((0, t.count), name=f"t{i}") for i, t in enumerate(taps)]

        def body(n, c, *i0):
            at = [p + t.offset(a) + lo for p, t, a, lo in zip(i0, taps, axes, low)]
            number = tir.const(0, "int32")
            for t, a, k in zip(taps, axes, window.kernel):
                number = number * k + t.tap(a)
            return te.sum(contribution([src[(n, c, *at)] for src in padded], number), axis=axes)

        return te.compute(shape[:2] + sizes, body, name=f"{name}_{'_'.join(map(str, phase))}")

    results = {}
    for phase in phases:
        taps = [per_axis[axis][ph] for axis, ph in enumerate(phase)]
        sizes = [phase_size(axis, ph) for axis, ph in enumerate(phase)]
        results[phase] = part(phase, taps, sizes) if all(sizes) and all(t.count for t in taps) else None

    def gather(n, c, *i):
        value = tir.const(0.0, dtype)
        for phase, part in results.items():
            if part is None:
                continue
            here = part[(n, c, *(x // s for x, s in zip(i, window.strides)))]
            if len(phases) == 1:
                return here
            value = tir.Select(tir.all(*(x % s == ph for x, s, ph in zip(i, window.strides, phase))), here, value)
        return value

    return te.compute(shape, gather, name=name)


def _first_argmax(x, window: Window, out_shape, peaks=None):
    """Per window, the row-major tap number of its first maximum among its real elements (NaN counts as maximum);
    the kernel size when a window has no real element. `peaks`: each window's maximum, when already made.

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

    if peaks is None:
        peaks = te.compute(out_shape, peak, name="pool_peak")

    def first(n, c, *pos):
        axes = [te.reduce_axis((0, k), name=f"f{i}") for i, k in enumerate(window.kernel)]
        value, inside, number = tap_of(n, c, pos, axes)
        top = peaks[(n, c, *pos)]
        hit = tir.all(inside, tir.any(value == top, tir.all(tir.isnan(value), tir.isnan(top))))
        return te.min(tir.Select(hit, number, tir.const(taps, "int32")), axis=axes)

    return te.compute(out_shape, first, name="pool_first_peak")


def _taps_gather(window: Window, taps, dy, shape):
    """dx of `shape`: each window's dy added at the input element under its tap (int32, per window)."""
    count = 1
    for k in window.kernel:
        count *= k
    zero = tir.const(0.0, dy.dtype)

    def contribution(values, number):
        chosen, grad = values
        return tir.Select(chosen == number, grad, zero)

    sources = [(taps, tir.const(count, "int32")), (dy, zero)]
    return _phase_gather(window, sources, contribution, shape, dy.dtype, "max_pool_grad")


def max_pool_grad(ctx: LowerContext):
    """dx: each window's dy goes to its first maximum (row-major), as PyTorch's max_pool backward."""
    x, dy = ctx.input(0), ctx.input(1)
    window = window_of(ctx, _dims(x)[2:], _dims(dy)[2:])
    return [_taps_gather(window, _first_argmax(x, window, _dims(dy)), dy, _dims(x))]


def max_pool_with_taps(ctx: LowerContext):
    """(MaxPool's output, each window's first-maximum tap): the pool, then the first tap that holds its value."""
    x = ctx.input(0)
    out_shape = list(ctx.output_types[0].shape)
    window = window_of(ctx, _dims(x)[2:], out_shape[2:])
    pooled = nan_max_pool(x, window.kernel, window.strides, window.dilations, window.before, out_shape)
    return [pooled, _first_argmax(x, window, out_shape, pooled)]


def max_pool_taps_grad(ctx: LowerContext):
    """dx: each window's dy goes to the input element under its tap, as PyTorch's backward through indices."""
    taps, dy = ctx.input(0), ctx.input(1)
    shape = list(ctx.out_shape())
    return [_taps_gather(window_of(ctx, shape[2:], _dims(dy)[2:]), taps, dy, shape)]


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
    return [_phase_gather(window, [(share, tir.const(0.0, dy.dtype))], lambda values, _: values[0], shape,
                          dy.dtype, "avg_pool_grad")]


def batch_stats(ctx: LowerContext):
    """(mean, biased variance) per channel, kept: the sum, then the sum of squares around the mean, in one kernel."""
    x = ctx.input(0)
    axes = [0] + list(range(2, len(x.shape)))
    count = 1
    for a in axes:
        count *= int(x.shape[a])
    scale = tir.const(1.0 / count, x.dtype)
    total = topi.sum(x, axes, True)
    mean = te.compute(total.shape, lambda *i: total[i] * scale, name="batch_mean")
    squares = te.compute(x.shape, lambda n, c, *rest: _square(x[(n, c, *rest)] - mean[(0, c) + (0,) * len(rest)]),
                         name="batch_centred_square")
    spread = topi.sum(squares, axes, True)
    return [mean, te.compute(spread.shape, lambda *i: spread[i] * scale, name="batch_var")]


def _square(v):
    return v * v


RULES = {
    "ConvGradFilter": conv_grad_filter,
    "MaxPoolGrad": max_pool_grad,
    "MaxPoolWithTaps": max_pool_with_taps,
    "MaxPoolTapsGrad": max_pool_taps_grad,
    "AveragePoolGrad": average_pool_grad,
    "BatchStats": batch_stats,
}
