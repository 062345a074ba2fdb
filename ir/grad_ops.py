"""Tessel's gradient ops (domain "tessel"): the ops reverse-mode autodiff and training need that ONNX does not
define.

- `ConvGradFilter(x[N, C, *S], dy[N, O, *So])` -> dW[O, C/group, *kernel_shape]: the gradient of a Conv's
  filter (attrs kernel_shape, strides, pads, dilations, group as the Conv's; pads explicit, no auto_pad).
- `MaxPoolGrad(x, dy)` -> dx like x: each window's gradient goes to its FIRST maximum in row-major order among
  the window's real (not padding) elements, as PyTorch does (attrs as MaxPool's: kernel_shape, strides, pads,
  dilations, ceil_mode).
- `MaxPoolWithTaps(x)` -> (y, taps): MaxPool's output and, per window, the row-major tap number (int32) of the
  first maximum that MaxPoolGrad gives the gradient to (the kernel size when the window has no real element);
  attrs as MaxPoolGrad's. A training step's forward pool makes both, so the backward reads taps, a quarter of
  x's bytes for a 3x3 stride-2 pool, instead of searching x again (passes/pool_taps.py).
- `MaxPoolTapsGrad(taps, dy)` -> dx of shape `input_shape`: each window's dy added at its tap (attrs as
  MaxPoolGrad's plus `input_shape`), MaxPoolGrad's result.
- `BatchStats(x)` -> (mean, var): the batch mean and biased variance of each channel (axis 1) of (N, C, ...), kept
  as (1, C, 1, ...), the variance of the centred values (two passes, as ReduceMean then the mean of squares); a
  training-mode BatchNormalization's statistics (passes/training_mode.py). Its gradient rule
  (passes/gradients/nn.py) is the closed form, dx = (dmean + 2 (x - mean) dvar) / count.
- `AveragePoolGrad(dy)` -> dx of shape `input_shape`: attrs as AveragePool's (kernel_shape, strides, pads,
  dilations, ceil_mode, count_include_pad) plus `input_shape`. Divisors follow PyTorch: with count_include_pad a
  window counts its padding but not what ceil_mode adds beyond it; without, only its real elements.

Type inference runs the forward op's inference and checks that dy has the forward output's type, so a gradient
node always matches the node it differentiates. `REFERENCE` maps each op type to a numpy implementation,
`(attrs, inputs) -> outputs`, used by the IR interpreter (ir/interpret.py) to check gradient rules against finite
differences.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .attributes import AttrSpec, Attributes
from .errors import InferenceFailure
from .types import TensorType

# The schema of a default-domain op by its type (ir/schema.get_schema).
ForwardSchema = Callable[[str], Any]
Reference = Callable[[Attributes, Sequence[np.ndarray]], list[np.ndarray]]

_WINDOW_ATTRS = {
    "kernel_shape": AttrSpec("kernel_shape", "ints", True),
    "strides": AttrSpec("strides", "ints"),
    "pads": AttrSpec("pads", "ints"),
    "dilations": AttrSpec("dilations", "ints"),
}
CONV_GRAD_FILTER_ATTRS = {**_WINDOW_ATTRS, "group": AttrSpec("group", "int", False, 1)}
MAX_POOL_GRAD_ATTRS = {**_WINDOW_ATTRS, "ceil_mode": AttrSpec("ceil_mode", "int", False, 0)}
MAX_POOL_TAPS_GRAD_ATTRS = {**MAX_POOL_GRAD_ATTRS, "input_shape": AttrSpec("input_shape", "ints", True)}
AVERAGE_POOL_GRAD_ATTRS = {
    **MAX_POOL_GRAD_ATTRS,
    "count_include_pad": AttrSpec("count_include_pad", "int", False, 0),
    "input_shape": AttrSpec("input_shape", "ints", True),
}


class Window:
    """The sliding-window geometry of a conv or pool over the spatial axes of (N, C, *S)."""

    def __init__(self, attrs: Mapping[str, object], in_sizes: Sequence[int], out_sizes: Sequence[int]):
        rank = len(in_sizes)
        self.kernel = tuple(attrs["kernel_shape"])
        self.strides = tuple(attrs.get("strides") or (1,) * rank)
        self.dilations = tuple(attrs.get("dilations") or (1,) * rank)
        pads = tuple(attrs.get("pads") or (0,) * (2 * rank))
        self.before, self.after = pads[:rank], pads[rank:]
        self.in_sizes, self.out_sizes = tuple(in_sizes), tuple(out_sizes)

    def padded_sizes(self) -> tuple[int, ...]:
        """Sizes of the input padded so that every window (ceil_mode's last one included) lies inside it."""
        return tuple(max(i + b + a, (o - 1) * s + (k - 1) * d + 1)
                     for i, b, a, o, s, k, d in zip(self.in_sizes, self.before, self.after, self.out_sizes,
                                                    self.strides, self.kernel, self.dilations))

    def offsets(self):
        """Each kernel tap (row-major) with the strided slices of the padded input its windows read."""
        for tap in itertools.product(*(range(k) for k in self.kernel)):
            yield tap, tuple(slice(t * d, t * d + (o - 1) * s + 1, s)
                             for t, d, o, s in zip(tap, self.dilations, self.out_sizes, self.strides))

    def crop(self) -> tuple[slice, ...]:
        """The real input inside the padded one."""
        return tuple(slice(b, b + i) for b, i in zip(self.before, self.in_sizes))


def _pad(x: np.ndarray, window: Window, value: float) -> np.ndarray:
    out = np.full(x.shape[:2] + window.padded_sizes(), value, dtype=x.dtype)
    out[(slice(None), slice(None)) + window.crop()] = x
    return out


def conv_grad_filter(attrs: Attributes, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """dW[o, c, *k] = sum over n and output positions p of dy[n, o, p] * x_padded[n, g(o)*C/group + c, p*s + k*d]."""
    x, dy = inputs
    window = Window(attrs, x.shape[2:], dy.shape[2:])
    groups = attrs.get("group", 1)
    padded = _pad(x, window, 0.0)
    n, channels, out_channels = x.shape[0], x.shape[1], dy.shape[1]
    cg, og = channels // groups, out_channels // groups
    grad = np.zeros((out_channels, cg) + window.kernel, dtype=np.result_type(x, dy))
    dy_groups = dy.reshape(n, groups, og, -1)
    for tap, where in window.offsets():
        taps = padded[(slice(None), slice(None)) + where].reshape(n, groups, cg, -1)
        grad[(slice(None), slice(None)) + tap] = np.einsum("ngop,ngcp->goc", dy_groups, taps).reshape(out_channels, cg)
    return [grad.astype(x.dtype)]


def _first_taps(x: np.ndarray, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """(each window's maximum, the row-major tap number of its first maximum among its real elements; the kernel
    size where it has none); NaN counts as maximum."""
    padded = _pad(x, window, -np.inf)
    real = _pad(np.ones(x.shape, bool), window, False)
    lead = (slice(None), slice(None))
    values = np.stack([padded[lead + where] for _, where in window.offsets()])
    valid = np.stack([real[lead + where] for _, where in window.offsets()])
    peak = np.where(valid, values, -np.inf).max(axis=0)
    hit = valid & ((values == peak) | (np.isnan(values) & np.isnan(peak)))
    first = np.where(hit.any(axis=0), hit.argmax(axis=0), len(values))
    return peak, first.astype(np.int32)


def _scatter_taps(taps: np.ndarray, dy: np.ndarray, window: Window, shape: Sequence[int]) -> np.ndarray:
    """dx of `shape`: each window's dy added at the input element under its tap."""
    lead = (slice(None), slice(None))
    grad = np.zeros(tuple(shape[:2]) + window.padded_sizes(), dtype=dy.dtype)
    for index, (_, where) in enumerate(window.offsets()):
        grad[lead + where] += np.where(taps == index, dy, 0)
    return grad[lead + window.crop()]


def max_pool_grad(attrs: Attributes, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """dx: each window's dy added at its first maximum (row-major) among its real elements; NaN counts as maximum."""
    x, dy = inputs
    window = Window(attrs, x.shape[2:], dy.shape[2:])
    _, taps = _first_taps(x, window)
    return [_scatter_taps(taps, dy.astype(np.result_type(x, dy)), window, x.shape).astype(x.dtype)]


def max_pool_with_taps(attrs: Attributes, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """(MaxPool's output, each window's first-maximum tap as int32)."""
    (x,) = inputs
    sizes = _pool_out_sizes(attrs, x.shape[2:])
    peak, taps = _first_taps(x, Window(attrs, x.shape[2:], sizes))
    return [peak.astype(x.dtype), taps]


def max_pool_taps_grad(attrs: Attributes, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """dx: each window's dy added at its tap."""
    taps, dy = inputs
    shape = tuple(attrs["input_shape"])
    return [_scatter_taps(taps, dy, Window(attrs, shape[2:], dy.shape[2:]), shape).astype(dy.dtype)]


def _pool_out_sizes(attrs: Mapping[str, object], in_sizes: Sequence[int]) -> tuple[int, ...]:
    """A pool's output spatial sizes (explicit pads; ceil_mode's last window starts inside the input or its
    leading pad, as ONNX and PyTorch count)."""
    window = Window(attrs, in_sizes, in_sizes)
    sizes = []
    for i, b, a, s, k, d in zip(in_sizes, window.before, window.after, window.strides, window.kernel,
                                window.dilations):
        span = i + b + a - (k - 1) * d - 1
        if attrs.get("ceil_mode", 0):
            out = -(-span // s) + 1
            if (out - 1) * s >= i + b:
                out -= 1
        else:
            out = span // s + 1
        sizes.append(out)
    return tuple(sizes)


def batch_stats(attrs: Attributes, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """(mean, biased variance) over every axis but 1, kept."""
    (x,) = inputs
    axes = (0,) + tuple(range(2, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    centred = x - mean
    return [mean.astype(x.dtype), (centred * centred).mean(axis=axes, keepdims=True).astype(x.dtype)]


def window_counts(window: Window, include_pad: bool) -> np.ndarray:
    """The divisor of each average-pool window (shape So), as PyTorch counts it."""
    per_axis = []
    for i, b, a, o, s, k, d in zip(window.in_sizes, window.before, window.after, window.out_sizes,
                                   window.strides, window.kernel, window.dilations):
        start = np.arange(o) * s - b
        taps = start[:, None] + np.arange(k)[None, :] * d
        low, high = (-b, i + a) if include_pad else (0, i)
        per_axis.append(((taps >= low) & (taps < high)).sum(axis=1))
    counts = np.ones((), np.int64)
    for c in per_axis:
        counts = np.multiply.outer(counts, c)
    return counts


def average_pool_grad(attrs: Attributes, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """dx: each window's dy divided by the window's count, added to every real element of the window."""
    (dy,) = inputs
    shape = tuple(attrs["input_shape"])
    window = Window(attrs, shape[2:], dy.shape[2:])
    share = dy / np.maximum(window_counts(window, bool(attrs.get("count_include_pad", 0))), 1)
    lead = (slice(None), slice(None))
    grad = np.zeros(shape[:2] + window.padded_sizes(), dtype=share.dtype)
    for _, where in window.offsets():
        grad[lead + where] += share
    return [grad[lead + window.crop()].astype(dy.dtype)]


def _forward_check(forward_schema: ForwardSchema, op_type: str, attrs: Mapping[str, object],
                   input_types: Sequence[TensorType], dy: TensorType) -> None:
    """Raise InferenceFailure unless `dy` has the type of `op_type`'s output for these inputs and attributes."""
    schema = forward_schema(op_type)
    forward = schema.make_attributes({k: v for k, v in attrs.items() if k in schema.attributes}, op_type)
    expected = schema.infer(forward, input_types, [None] * len(input_types), 1)[0]
    if expected != dy:
        raise InferenceFailure(f"dy is {dy}, but {op_type} with these attributes gives {expected}")


def _check_window_rank(attrs: Mapping[str, object], rank: int) -> None:
    if rank < 3:
        raise InferenceFailure(f"input must be (N, C, spatial...), has rank {rank}")
    if len(attrs["kernel_shape"]) != rank - 2:
        raise InferenceFailure(f"kernel_shape has {len(attrs['kernel_shape'])} axes for {rank - 2} spatial axes")


def _infer_conv_grad_filter(forward_schema, attrs, input_types, input_data, num_outputs):
    x, dy = input_types
    _check_window_rank(attrs, x.rank)
    groups = attrs.get("group", 1)
    channels, out_channels = x.shape[1], dy.shape[1]
    if groups < 1 or channels % groups or out_channels % groups:
        raise InferenceFailure(f"group {groups} must divide the {channels} input and {out_channels} output channels")
    weight = TensorType(x.dtype, (out_channels, channels // groups) + tuple(attrs["kernel_shape"]))
    _forward_check(forward_schema, "Conv", attrs, [x, weight], dy)
    return [weight]


def _infer_max_pool_grad(forward_schema, attrs, input_types, input_data, num_outputs):
    x, dy = input_types
    _check_window_rank(attrs, x.rank)
    _forward_check(forward_schema, "MaxPool", attrs, [x], dy)
    return [x]


def _infer_max_pool_with_taps(forward_schema, attrs, input_types, input_data, num_outputs):
    (x,) = input_types
    _check_window_rank(attrs, x.rank)
    schema = forward_schema("MaxPool")
    forward = schema.make_attributes({k: v for k, v in attrs.items() if k in schema.attributes}, "MaxPool")
    y = schema.infer(forward, [x], [None], 1)[0]
    return [y, TensorType("int32", y.shape)]


def _infer_max_pool_taps_grad(forward_schema, attrs, input_types, input_data, num_outputs):
    taps, dy = input_types
    x = TensorType(dy.dtype, tuple(attrs["input_shape"]))
    _check_window_rank(attrs, x.rank)
    _forward_check(forward_schema, "MaxPool", attrs, [x], dy)
    if taps.dtype != "int32" or taps.shape != dy.shape:
        raise InferenceFailure(f"taps must be int32 of dy's shape {dy.shape}, is {taps}")
    return [x]


def _infer_batch_stats(forward_schema, attrs, input_types, input_data, num_outputs):
    (x,) = input_types
    if x.rank < 2 or not x.dtype.startswith("float"):
        raise InferenceFailure(f"x must be a float tensor (N, C, ...), is {x}")
    stat = TensorType(x.dtype, (1, x.shape[1]) + (1,) * (x.rank - 2))
    return [stat, stat]


def _infer_average_pool_grad(forward_schema, attrs, input_types, input_data, num_outputs):
    (dy,) = input_types
    x = TensorType(dy.dtype, tuple(attrs["input_shape"]))
    _check_window_rank(attrs, x.rank)
    _forward_check(forward_schema, "AveragePool", attrs, [x], dy)
    return [x]


# op type -> (number of inputs, number of outputs, attributes, type inference); ir/schema.py makes them Tessel-domain
# schemas, giving each inference its first argument: the lookup of a forward op's schema (this module cannot import
# ir/schema.py, which imports it).
GRAD_OPS = {
    "ConvGradFilter": (2, 1, CONV_GRAD_FILTER_ATTRS, _infer_conv_grad_filter),
    "MaxPoolGrad": (2, 1, MAX_POOL_GRAD_ATTRS, _infer_max_pool_grad),
    "MaxPoolWithTaps": (1, 2, MAX_POOL_GRAD_ATTRS, _infer_max_pool_with_taps),
    "MaxPoolTapsGrad": (2, 1, MAX_POOL_TAPS_GRAD_ATTRS, _infer_max_pool_taps_grad),
    "AveragePoolGrad": (1, 1, AVERAGE_POOL_GRAD_ATTRS, _infer_average_pool_grad),
    "BatchStats": (1, 2, {}, _infer_batch_stats),
}

REFERENCE: dict[str, Reference] = {
    "ConvGradFilter": conv_grad_filter,
    "MaxPoolGrad": max_pool_grad,
    "MaxPoolWithTaps": max_pool_with_taps,
    "MaxPoolTapsGrad": max_pool_taps_grad,
    "AveragePoolGrad": average_pool_grad,
    "BatchStats": batch_stats,
}
