"""Neural-network ops: convolutions, pooling, normalisations, matrix products.

The generic rules of every target; the conv and matmul algorithms a kernel spec can choose instead
(packed, im2col, Winograd) are in backends/cpu/.
"""
from __future__ import annotations

from ..tvm_env import tvm
from .context import LowerContext
from .pool import average_pool, pool_window, window_pads
from .reduce import NAN_MAX, lowest, nan_reduce

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx


def _dims(tensor) -> list[int]:
    return [int(d) for d in tensor.shape]


def _as_2d(x, name: str):
    """View an (N, C, W) tensor as (N, C, 1, W)."""
    n, c, w = _dims(x)
    return te.compute((n, c, 1, w), lambda a, b, _h, d: x[a, b, d], name=name)


def _conv_operands(ctx: LowerContext, what: str):
    """(data, weight, bias, spatial rank, kernel, strides, dilations) of a 1-D or 2-D (transposed) conv."""
    x, w, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    spatial = len(x.shape) - 2
    if spatial not in (1, 2):
        raise ctx.fail(f"{spatial}-D {what} is not supported (1-D and 2-D are)")
    kernel = _dims(w)[2:]
    strides = list(ctx.attr("strides") or [1] * spatial)
    dilations = list(ctx.attr("dilations") or [1] * spatial)
    return x, w, bias, spatial, kernel, strides, dilations


def conv_pads(ctx: LowerContext) -> tuple[list[int], list[int]]:
    """(pads before, pads after) per spatial axis of a 1-D or 2-D Conv, from `pads` or `auto_pad`."""
    x, _, _, _, kernel, strides, dilations = _conv_operands(ctx, "convolution")
    return window_pads(ctx, _dims(x)[2:], list(ctx.out_shape())[2:], kernel, strides, dilations)


def _conv(ctx: LowerContext):
    x, w, bias, spatial, kernel, strides, dilations = _conv_operands(ctx, "convolution")
    out_shape = list(ctx.out_shape())
    before, after = conv_pads(ctx)
    if spatial == 1:
        x, w = _as_2d(x, "data_2d"), _as_2d(w, "weight_2d")
        kernel, strides, dilations = [1] + kernel, [1] + strides, [1] + dilations
        before, after, out_shape = [0] + before, [0] + after, out_shape[:2] + [1] + out_shape[2:]
    if any(before) or any(after):
        x = topi.nn.pad(x, [0, 0] + before, [0, 0] + after, name="conv_pad")
    out_channels, group_channels = _dims(w)[:2]
    groups = ctx.attr("group", 1)
    per_group = out_channels // groups
    rc = te.reduce_axis((0, group_channels), name="rc")
    ry = te.reduce_axis((0, kernel[0]), name="ry")
    rx = te.reduce_axis((0, kernel[1]), name="rx")
    (sh, sw), (dh, dw) = strides, dilations

    def channel(k):
        return rc if groups == 1 else (k // per_group) * group_channels + rc

    out = te.compute(
        out_shape,
        lambda n, k, h, q: te.sum(x[n, channel(k), h * sh + ry * dh, q * sw + rx * dw] * w[k, rc, ry, rx], axis=[rc, ry, rx]),
        name="conv",
    )
    if bias is not None:
        out = te.compute(out_shape, lambda n, k, h, q: out[n, k, h, q] + bias[k], name="conv_bias")
    if spatial == 1:
        flat = out
        out = te.compute(ctx.out_shape(), lambda n, k, q: flat[n, k, 0, q], name="conv_1d")
    return [out]


def _pool(kind: str):
    def rule(ctx: LowerContext):
        x = ctx.input(0)
        spatial = len(x.shape) - 2
        kernel, strides, dilations, before, after = pool_window(ctx, x)
        ceil = bool(ctx.attr("ceil_mode", 0))
        include = bool(ctx.attr("count_include_pad", 0))
        out_shape = list(ctx.out_shape())
        if kind == "max":
            out = nan_max_pool(x, kernel, strides, dilations, before, out_shape)
        elif spatial == 1:
            out = topi.nn.pool1d(x, kernel, strides, dilations, before + after, kind, ceil, "NCW", include)
        elif spatial == 2:
            out = topi.nn.pool2d(x, kernel, strides, dilations, before + after, kind, ceil, "NCHW", include)
        if kind != "max" and (spatial > 2 or _dims(out) != out_shape):
            # TOPI pools 1-D and 2-D only, and drops a ceil-mode last window that starts in the padding.
            out = average_pool(x, kernel, strides, dilations, before, after, out_shape, include)
        if kind == "max" and len(ctx.output_types) > 1 and ctx.output_types[1] is not None:
            column_major = bool(ctx.attr("storage_order", 0))
            return [out, _max_pool_indices(x, out, kernel, strides, dilations, before, column_major)]
        return [out] + [None] * (len(ctx.output_types) - 1)

    return rule


def _max_pool_indices(x, pooled, kernel, strides, dilations, before, column_major: bool):
    """MaxPool's Indices: the flat index into x of each window's first maximum (padding never wins); the spatial
    axes flatten row-major, or column-major (first axis fastest) with storage_order=1."""
    dims = _dims(x)
    window = [te.reduce_axis((0, k), name=f"i{i}") for i, k in enumerate(kernel)]
    none = tir.const(2**62, "int64")

    def body(n, c, *pos):
        at = [p * s + w * d - b for p, s, w, d, b in zip(pos, strides, window, dilations, before)]
        inside = tir.all(*[tir.all(a >= 0, a < size) for a, size in zip(at, dims[2:])])
        clamped = [tir.max(tir.min(a, size - 1), 0) for a, size in zip(at, dims[2:])]
        spatial = list(zip(clamped, dims[2:]))
        flat = tir.Cast("int64", n) * dims[1] + c
        for a, size in (spatial[::-1] if column_major else spatial):
            flat = flat * size + a
        hit = tir.all(inside, x[(n, c, *clamped)] == pooled[(n, c, *pos)])
        return te.min(tir.Select(hit, flat, none), axis=window)

    return te.compute(pooled.shape, body, name="max_pool_indices")


def nan_max_pool(x, kernel, strides, dilations, before, out_shape):
    """MaxPool over the trailing axes of (N, C, ...) that is NaN when its window holds a NaN (TOPI's kept or dropped
    it by its place in the window): one reduction whose combine is a compare and a select per lane, so it vectorizes
    as TOPI's does. Padding is -inf (TOPI pads the type's finite minimum, which beat a window of -inf); the block
    carries TOPI's pooling schedule rule, so the CPU schedule treats it as the pooling it is."""
    in_dims = _dims(x)[2:]
    needed = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(out_shape[2:], strides, kernel, dilations)]
    pad_after = [max(n - i - b, 0) for n, i, b in zip(needed, in_dims, before)]
    if any(before) or any(pad_after):
        x = topi.nn.pad(x, [0, 0] + list(before), [0, 0] + pad_after, pad_value=lowest(x.dtype), name="pool_pad")
    window = [te.reduce_axis((0, k), name=f"k{i}") for i, k in enumerate(kernel)]

    def body(n, c, *pos):
        at = [p * s + w * d for p, s, w, d in zip(pos, strides, window, dilations)]
        return NAN_MAX(x[(n, c, *at)], axis=window)

    return te.compute(out_shape, body, name="nan_max_pool", tag="pool_max",
                      attrs={"schedule_rule": "meta_schedule.pool_max"})


def _global_pool(kind: str):
    def rule(ctx: LowerContext):
        x = ctx.input(0)
        axes = list(range(2, len(x.shape)))
        if kind == "max":
            return [nan_reduce(NAN_MAX, x, axes, True)]
        count = 1
        for d in _dims(x)[2:]:
            count *= d
        return [topi.divide(topi.sum(x, axes, True), tir.const(count, x.dtype))]

    return rule


def _lrn(ctx: LowerContext):
    x = ctx.input(0)
    size = ctx.attr("size")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    shape = _dims(x)
    square = topi.multiply(x, x)
    padded = topi.nn.pad(square, [0, (size - 1) // 2] + [0] * (len(shape) - 2),
                         [0, size - 1 - (size - 1) // 2] + [0] * (len(shape) - 2), name="lrn_pad")
    r = te.reduce_axis((0, size), name="r")
    total = te.compute(shape, lambda n, c, *rest: te.sum(padded[(n, c + r, *rest)], axis=r), name="lrn_sum")
    scale = topi.add(tir.const(bias, x.dtype), topi.multiply(tir.const(alpha / size, x.dtype), total))
    return [topi.divide(x, topi.power(scale, tir.const(beta, x.dtype)))]


def _channel(v, rank: int):
    """Broadcast a per-channel vector against an (N, C, ...) tensor."""
    return topi.reshape(v, [int(v.shape[0])] + [1] * (rank - 2))


def _batch_norm(ctx: LowerContext):
    x, scale, shift, mean, var = (ctx.input(i) for i in range(5))
    rank = len(x.shape)
    eps = tir.const(ctx.attr("epsilon", 1e-5), x.dtype)
    factor = topi.divide(_channel(scale, rank), topi.sqrt(topi.add(_channel(var, rank), eps)))
    return [topi.add(topi.multiply(topi.subtract(x, _channel(mean, rank)), factor), _channel(shift, rank))]


def _moments(x, axes, eps, count):
    """(centered x, mean, 1/sqrt(var + eps)) over `axes`, kept as size-1 dimensions."""
    total = tir.const(count, x.dtype)
    mean = topi.divide(topi.sum(x, axes, True), total)
    centered = topi.subtract(x, mean)
    var = topi.divide(topi.sum(topi.multiply(centered, centered), axes, True), total)
    inv_std = topi.divide(tir.const(1.0, x.dtype), topi.sqrt(topi.add(var, tir.const(eps, x.dtype))))
    return centered, mean, inv_std


def _normalize(x, axes, eps, count):
    centered, _, inv_std = _moments(x, axes, eps, count)
    return topi.multiply(centered, inv_std)


def _instance_norm(ctx: LowerContext):
    x, scale, shift = ctx.input(0), ctx.input(1), ctx.input(2)
    rank = len(x.shape)
    count = 1
    for d in _dims(x)[2:]:
        count *= d
    y = _normalize(x, list(range(2, rank)), ctx.attr("epsilon", 1e-5), count)
    return [topi.add(topi.multiply(y, _channel(scale, rank)), _channel(shift, rank))]


def _layer_norm(ctx: LowerContext):
    x, scale, shift = ctx.input(0), ctx.input(1), ctx.input(2)
    rank = len(x.shape)
    axis = ctx.attr("axis", -1)
    axis = axis + rank if axis < 0 else axis
    count = 1
    for d in _dims(x)[axis:]:
        count *= d
    centered, mean, inv_std = _moments(x, list(range(axis, rank)), ctx.attr("epsilon", 1e-5), count)
    y = topi.multiply(topi.multiply(centered, inv_std), scale)
    if shift is not None:
        y = topi.add(y, shift)
    extra = [mean, inv_std]
    return [y] + [extra[i] if t is not None else None for i, t in enumerate(ctx.output_types[1:3])]


def _matmul(ctx: LowerContext):
    a, b = ctx.input(0), ctx.input(1)
    a_vec, b_vec = len(a.shape) == 1, len(b.shape) == 1
    if a_vec:
        flat_a = a
        a = te.compute((1, int(a.shape[0])), lambda _i, k: flat_a[k], name="a_row")
    if b_vec:
        flat_b = b
        b = te.compute((int(b.shape[0]), 1), lambda k, _j: flat_b[k], name="b_col")
    a_dims, b_dims = _dims(a), _dims(b)
    batch_a, batch_b = a_dims[:-2], b_dims[:-2]
    batch_rank = max(len(batch_a), len(batch_b))
    batch = [max(x, y) for x, y in zip([1] * (batch_rank - len(batch_a)) + batch_a, [1] * (batch_rank - len(batch_b)) + batch_b)]
    m, depth, n = a_dims[-2], a_dims[-1], b_dims[-1]
    k = te.reduce_axis((0, depth), name="k")

    def pick(index, own):
        offset = batch_rank - len(own)
        return [0 if own[d] == 1 else index[offset + d] for d in range(len(own))]

    full = te.compute(
        batch + [m, n],
        lambda *i: te.sum(a[(*pick(i, batch_a), i[-2], k)] * b[(*pick(i, batch_b), k, i[-1])], axis=k),
        name="matmul",
    )
    if not (a_vec or b_vec):
        return [full]

    def squeeze(*i):
        index = list(i)
        if b_vec:
            index.append(0)
        if a_vec:
            index.insert(len(index) - 1, 0)
        return full[tuple(index)]

    return [te.compute(ctx.out_shape(), squeeze, name="matmul_vec")]


def _gemm(ctx: LowerContext):
    a, b, c = ctx.input(0), ctx.input(1), ctx.input(2)
    trans_a, trans_b = ctx.attr("transA", 0), ctx.attr("transB", 0)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    depth = int(a.shape[0] if trans_a else a.shape[1])
    k = te.reduce_axis((0, depth), name="k")
    m, n = ctx.out_shape()
    product = te.compute(
        (m, n),
        lambda i, j: te.sum((a[k, i] if trans_a else a[i, k]) * (b[j, k] if trans_b else b[k, j]), axis=k),
        name="gemm",
    )
    if alpha != 1.0:
        product = topi.multiply(product, tir.const(alpha, product.dtype))
    if c is not None:
        product = topi.add(product, c if beta == 1.0 else topi.multiply(c, tir.const(beta, c.dtype)))
    return [product]


RULES = {
    "Conv": _conv,
    "MaxPool": _pool("max"),
    "AveragePool": _pool("avg"),
    "GlobalAveragePool": _global_pool("avg"),
    "GlobalMaxPool": _global_pool("max"),
    "LRN": _lrn,
    "BatchNormalization": _batch_norm,
    "InstanceNormalization": _instance_norm,
    "LayerNormalization": _layer_norm,
    "MatMul": _matmul,
    "Gemm": _gemm,
}
