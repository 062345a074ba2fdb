"""Data movement ops: transpose, concat, split, slice, gathers, one-hot, expand, tile, pad, resize, fills.

Gathers read through `index_checks`: an index out of range fails the run (or, where the kernel cannot
check it, is clamped), never a read outside the tensor.
"""
from __future__ import annotations

import numpy as np

from ..tvm_env import tvm
from .context import LowerContext
from .index_checks import check_attrs, checked_indices, position

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _transpose(ctx: LowerContext):
    x = ctx.input(0)
    perm = ctx.attr("perm") or tuple(reversed(range(len(x.shape))))
    return [topi.transpose(x, list(perm))]


def _concat(ctx: LowerContext):
    """The inputs side by side along the axis: each element picks its part by comparing its index with the parts'
    starts, the comparisons marked `likely` so that a loop over the axis (or blocks of it) which asks for it is cut
    into one loop per part, each reading its part directly (a conv reducing over a concat's channels:
    backends/cpu/packed_kernels.py)."""
    xs = [x for x in ctx.inputs if x is not None and int(np.prod([int(d) for d in x.shape])) > 0]
    axis = _axis(ctx.attr("axis"), len(ctx.out_shape()))
    if len(xs) == 1:
        return [topi.identity(xs[0])]
    starts = [0]
    for x in xs[:-1]:
        starts.append(starts[-1] + int(x.shape[axis]))

    def part(k, index):
        moved = list(index)
        moved[axis] = index[axis] - starts[k]
        return xs[k][tuple(moved)]

    def element(*index):
        value = part(len(xs) - 1, index)
        for k in range(len(xs) - 2, -1, -1):
            value = tir.if_then_else(tir.likely(index[axis] < starts[k + 1]), part(k, index), value)
        return value

    return [te.compute(ctx.out_shape(), element, name="concat")]


def _split(ctx: LowerContext):
    x = ctx.input(0)
    axis = _axis(ctx.attr("axis", 0), len(x.shape))
    outputs, start = [], 0
    for index, out_type in enumerate(ctx.output_types):
        size = out_type.shape[axis] if out_type is not None else _split_size(ctx, index)
        if out_type is not None:
            outputs.append(_window(x, axis, start, out_type.shape, f"split{index}"))
        else:
            outputs.append(None)
        start += size
    return outputs


def _split_size(ctx: LowerContext, index: int) -> int:
    sizes = ctx.data(1)
    if sizes is not None:
        return int(sizes[index])
    raise ctx.fail("an omitted Split output needs explicit split sizes")


def _window(x, axis: int, start: int, shape, name: str):
    def index(*i):
        src = list(i)
        src[axis] = src[axis] + start
        return x[tuple(src)]

    return te.compute(shape, index, name=name)


def _slice(ctx: LowerContext):
    x = ctx.input(0)
    rank = len(x.shape)
    dims = [int(d) for d in x.shape]
    starts = ctx.require_data(1).tolist()
    axes = ctx.data(3).tolist() if ctx.data(3) is not None else list(range(len(starts)))
    steps = ctx.data(4).tolist() if ctx.data(4) is not None else [1] * len(starts)
    # The output shape, known from the IR, already says where each axis ends: only starts and steps matter.
    begin, stride = [0] * rank, [1] * rank
    for s, axis, step in zip(starts, axes, steps):
        axis = _axis(axis, rank)
        dim = dims[axis]
        s = s + dim if s < 0 else s
        begin[axis] = min(max(s, 0), dim) if step > 0 else min(max(s, 0), dim - 1)
        stride[axis] = step
    return [te.compute(ctx.out_shape(), lambda *i: x(*[b + k * st for b, k, st in zip(begin, i, stride)]), name="slice")]


def _gather(ctx: LowerContext):
    data, indices = ctx.input(0), ctx.input(1)
    axis = _axis(ctx.attr("axis", 0), len(data.shape))
    dim = int(data.shape[axis])
    index_rank = len(indices.shape)
    check, indices = checked_indices(ctx, indices, (dim,), axis, data)

    def compute(*i):
        at = position(indices, i[axis:axis + index_rank], dim, check)
        return data[(*i[:axis], at, *i[axis + index_rank:])]

    return [te.compute(ctx.out_shape(), compute, name="gather", attrs=check_attrs(check))]


def _gather_elements(ctx: LowerContext):
    data, indices = ctx.input(0), ctx.input(1)
    axis = _axis(ctx.attr("axis", 0), len(data.shape))
    dim = int(data.shape[axis])
    check, indices = checked_indices(ctx, indices, (dim,), axis, data)

    def compute(*i):
        return data[(*i[:axis], position(indices, i, dim, check), *i[axis + 1:])]

    return [te.compute(ctx.out_shape(), compute, name="gather_elements", attrs=check_attrs(check))]


def _gather_nd(ctx: LowerContext):
    """out[i..., rest...] = data[batch..., indices[i..., 0], ..., indices[i..., k-1], rest...]."""
    data, indices = ctx.input(0), ctx.input(1)
    batch = ctx.attr("batch_dims", 0)
    dims = [int(d) for d in data.shape]
    width = int(indices.shape[-1])
    positions = len(indices.shape) - 1
    bounds = tuple(dims[batch:batch + width])
    check, indices = checked_indices(ctx, indices, bounds, batch, data)

    def compute(*o):
        at = [position(indices, (*o[:positions], j), bounds[j], check) for j in range(width)]
        return data[(*o[:batch], *at, *o[positions:])]

    return [te.compute(ctx.out_shape(), compute, name="gather_nd", attrs=check_attrs(check))]


def _one_hot(ctx: LowerContext):
    """`on` where the (wrapped) index equals the position along `axis`, else `off`; an index outside
    [-depth, depth-1] gives a row of `off` (ONNX), so nothing is read by index."""
    indices, values = ctx.input(0), ctx.input(2)
    out_shape = ctx.out_shape()
    axis = _axis(ctx.attr("axis", -1), len(out_shape))
    depth = out_shape[axis]
    dtype = ctx.out_dtype()
    zero = (0,) * len(values.shape[:-1])

    def compute(*o):
        index = indices[(*o[:axis], *o[axis + 1:])]
        wrapped = tir.Select(index < 0, index + tir.const(depth, indices.dtype), index)
        hit = wrapped == tir.Cast(indices.dtype, o[axis])
        return tir.Select(hit, tir.Cast(dtype, values[(*zero, 1)]), tir.Cast(dtype, values[(*zero, 0)]))

    return [te.compute(out_shape, compute, name="one_hot")]


def _expand(ctx: LowerContext):
    return [topi.broadcast_to(ctx.input(0), ctx.out_shape())]


def _tile(ctx: LowerContext):
    return [topi.tile(ctx.input(0), [int(r) for r in ctx.require_data(1)])]


def _pad(ctx: LowerContext):
    x = ctx.input(0)
    rank = len(x.shape)
    dims = [int(d) for d in x.shape]
    pads = ctx.require_data(1).tolist()
    axes = ctx.data(3).tolist() if ctx.data(3) is not None else list(range(rank))
    before = [0] * rank
    for k, axis in enumerate(axes):
        before[_axis(axis, rank)] = pads[k]
    mode = ctx.attr("mode", "constant")
    value = ctx.input(2)
    fill = (value[tuple([0] * len(value.shape))] if value is not None else tir.const(0, x.dtype))

    def source(i, axis):
        j = i - before[axis]
        if mode == "edge":
            return tir.max(tir.min(j, dims[axis] - 1), 0)
        if mode == "reflect":
            period = 2 * (dims[axis] - 1) if dims[axis] > 1 else 1
            j = tir.floormod(j, period)
            return tir.Select(j < dims[axis], j, period - j)
        if mode == "wrap":
            return tir.floormod(j, dims[axis])
        return j

    def compute(*i):
        src = [source(k, a) for a, k in enumerate(i)]
        if mode != "constant":
            return x[tuple(src)]
        inside = tir.all(*[tir.all(s >= 0, s < dims[a]) for a, s in enumerate(src)]) if rank else tir.const(True, "bool")
        clamped = [tir.max(tir.min(s, dims[a] - 1), 0) for a, s in enumerate(src)]
        return tir.Select(inside, x[tuple(clamped)], fill)

    return [te.compute(ctx.out_shape(), compute, name="pad")]


def _constant_of_shape(ctx: LowerContext):
    value = ctx.attr("value")
    scalar = value.reshape(-1)[0].item() if value is not None else 0.0
    dtype = ctx.out_dtype()
    return [te.compute(ctx.out_shape(), lambda *i: tir.const(scalar, dtype), name="fill")]


def _source_coordinate(mode: str, x, scale: float, length_in: int, length_out: int, roi: tuple[float, float]):
    """Where output coordinate `x` samples the input, per ONNX's coordinate_transformation_mode."""
    f32 = "float32"
    xf = tir.Cast(f32, x)
    if mode == "half_pixel":
        return (xf + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = length_in / 2 * (1 - length_out / (scale * length_in))
        return offset + (xf + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (xf + 0.5) / scale - 0.5 if length_out > 1 else tir.const(0.0, f32)
    # ONNX's reference divides by the unrounded output length (scale × input length) where it differs.
    if mode == "align_corners":
        span = scale * length_in
        return xf * ((length_in - 1) / (span - 1)) if length_out > 1 else tir.const(0.0, f32)
    if mode == "asymmetric":
        return xf / scale
    if mode == "tf_crop_and_resize":
        start, end = roi
        if length_out > 1:
            return start * (length_in - 1) + xf * ((end - start) * (length_in - 1) / (scale * length_in - 1))
        return tir.const(0.5 * (start + end) * (length_in - 1), f32)
    raise ValueError(mode)


def _nearest(value, mode: str):
    if mode == "round_prefer_ceil":
        return tir.floor(value + 0.5)
    if mode == "floor":
        return tir.floor(value)
    if mode == "ceil":
        return tir.ceil(value)
    return tir.ceil(value - 0.5)  # round_prefer_floor


def _all_axes(values, axes, rank: int, fill):
    """Resize's scales (fill 1) or roi (fill: the whole axis) given for `axes` only, spread over every axis."""
    if values is None or not axes or values.size == 0:
        return values
    count = len(axes)
    axes = [a + rank if a < 0 else a for a in axes]
    if fill is not None:
        full = np.full(rank, fill, dtype=np.float64)
        full[axes] = values.reshape(-1)[:count]
        return full
    full = np.concatenate([np.zeros(rank), np.ones(rank)])
    full[axes] = values.reshape(-1)[:count]
    full[[a + rank for a in axes]] = values.reshape(-1)[count:]
    return full


def _taps(mode: str, c, length: int, ctx: LowerContext):
    """(index, weight) pairs that interpolate coordinate `c` along an axis of `length`: linear's two
    neighbours (the coordinate clamped to the axis), or cubic's four (indices clamped to the edge; with
    exclude_outside, taps outside the axis weigh 0 and the rest are renormalized)."""
    f32 = lambda v: tir.const(v, "float32")  # noqa: E731
    if mode == "linear":
        c = tir.max(tir.min(c, f32(length - 1)), f32(0.0))
        low = tir.Cast("int32", tir.floor(c))
        frac = c - tir.Cast("float32", low)
        return [(low, f32(1.0) - frac), (tir.min(low + 1, length - 1), frac)]
    a = f32(ctx.attr("cubic_coeff_a", -0.75))
    floor = tir.floor(c)
    t = c - floor
    base = tir.Cast("int32", floor)

    def far(d):  # 1 < |d| < 2
        return ((a * d - f32(5.0) * a) * d + f32(8.0) * a) * d - f32(4.0) * a

    def near(d):  # |d| <= 1
        return ((a + f32(2.0)) * d - (a + f32(3.0))) * d * d + f32(1.0)

    weights = [far(t + f32(1.0)), near(t), near(f32(1.0) - t), far(f32(2.0) - t)]
    positions = [base - 1, base, base + 1, base + 2]
    if ctx.attr("exclude_outside", 0):
        weights = [tir.Select(tir.all(p >= 0, p < length), w, f32(0.0)) for p, w in zip(positions, weights)]
        total = weights[0] + weights[1] + weights[2] + weights[3]
        weights = [w / total for w in weights]
    return [(tir.max(tir.min(p, length - 1), 0), w) for p, w in zip(positions, weights)]


def _resize(ctx: LowerContext):
    x = ctx.input(0)
    in_shape, out_shape = [int(d) for d in x.shape], list(ctx.out_shape())
    rank = len(in_shape)
    mode = ctx.attr("mode", "nearest")
    transform = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if ctx.attr("antialias", 0):
        raise ctx.fail(f"mode {mode} with {transform}{' and antialias' if ctx.attr('antialias', 0) else ''} is not supported")
    scales, roi = _all_axes(ctx.data(2), ctx.attr("axes"), rank, 1.0), _all_axes(ctx.data(1), ctx.attr("axes"), rank, None)
    if scales is not None and scales.size == rank:
        factors = [float(v) for v in scales]
    else:
        factors = [o / i for o, i in zip(out_shape, in_shape)]
    spans = [(float(roi[a]), float(roi[a + rank])) if roi is not None and roi.size == 2 * rank else (0.0, 1.0) for a in range(rank)]
    resized = [a for a in range(rank) if in_shape[a] != out_shape[a] or factors[a] != 1.0]
    nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
    fill = tir.const(ctx.attr("extrapolation_value", 0.0), "float32")

    def compute(*index):
        coords = {a: _source_coordinate(transform, index[a], factors[a], in_shape[a], out_shape[a], spans[a]) for a in resized}
        outside = [tir.any(c < 0, c > in_shape[a] - 1) for a, c in coords.items()] if transform == "tf_crop_and_resize" else []
        if mode == "nearest":
            src = list(index)
            for a, c in coords.items():
                src[a] = tir.max(tir.min(tir.Cast("int32", _nearest(c, nearest_mode)), in_shape[a] - 1), 0)
            value = x[tuple(src)]
        else:
            corners = [(list(index), tir.const(1.0, "float32"))]
            for a, c in coords.items():
                expanded = []
                for src, weight in corners:
                    for tap, w in _taps(mode, c, in_shape[a], ctx):
                        moved = list(src)
                        moved[a] = tap
                        expanded.append((moved, weight * w))
                corners = expanded
            value = sum((tir.Cast("float32", x[tuple(src)]) * w for src, w in corners[1:]),
                        tir.Cast("float32", x[tuple(corners[0][0])]) * corners[0][1])
            value = tir.Cast(x.dtype, value)
        if outside:
            value = tir.Select(tir.any(*outside) if len(outside) > 1 else outside[0], tir.Cast(x.dtype, fill), value)
        return value

    return [te.compute(out_shape, compute, name="resize")]


def _depth_to_space(ctx: LowerContext):
    x = ctx.input(0)
    b = ctx.attr("blocksize")
    n, c, h, w = (int(d) for d in x.shape)
    crd = ctx.attr("mode", "DCR") == "CRD"
    oc = c // (b * b)

    def compute(ni, ci, hi, wi):
        bh, bw = hi % b, wi % b
        src_c = ci * b * b + bh * b + bw if crd else (bh * b + bw) * oc + ci
        return x[ni, src_c, hi // b, wi // b]

    return [te.compute(ctx.out_shape(), compute, name="depth_to_space")]


def _space_to_depth(ctx: LowerContext):
    """The inverse of DepthToSpace: each b×b block of pixels becomes b*b channels (DCR order, or CRD for mode)."""
    x = ctx.input(0)
    b = ctx.attr("blocksize")
    c = int(x.shape[1])
    crd = ctx.attr("mode", "DCR") == "CRD"

    def compute(ni, ci, hi, wi):
        if crd:
            src_c, block = ci // (b * b), ci % (b * b)
        else:
            src_c, block = ci % c, ci // c
        return x[ni, src_c, hi * b + block // b, wi * b + block % b]

    return [te.compute(ctx.out_shape(), compute, name="space_to_depth")]


def _center_crop_pad(ctx: LowerContext):
    """Each listed axis cropped or zero-padded to its new size around the centre (the extra element of an
    odd difference goes to the end, as ONNX's reference puts it)."""
    x = ctx.input(0)
    in_shape, out_shape = [int(d) for d in x.shape], list(ctx.out_shape())
    offsets = [(i - o) // 2 if i >= o else -((o - i) // 2) for i, o in zip(in_shape, out_shape)]

    def compute(*index):
        src = [p + off for p, off in zip(index, offsets)]
        padded = [n < o for n, o in zip(in_shape, out_shape)]
        inside = [tir.all(s >= 0, s < n) for s, n, pad in zip(src, in_shape, padded) if pad]
        clamped = tuple(tir.max(tir.min(s, n - 1), 0) if pad else s for s, n, pad in zip(src, in_shape, padded))
        if not inside:
            return x[clamped]
        return tir.Select(tir.all(*inside) if len(inside) > 1 else inside[0], x[clamped], tir.const(0, x.dtype))

    return [te.compute(out_shape, compute, name="center_crop_pad")]


def _trilu(ctx: LowerContext):
    x = ctx.input(0)
    k = int(ctx.data(1).reshape(-1)[0]) if ctx.data(1) is not None else 0
    upper = ctx.attr("upper", 1)

    def compute(*i):
        row, col = i[-2], i[-1]
        keep = (col - row >= k) if upper else (col - row <= k)
        return tir.Select(keep, x[tuple(i)], tir.const(0, x.dtype))

    return [te.compute(ctx.out_shape(), compute, name="trilu")]


def _grid_sample(ctx: LowerContext):
    """ONNX's grid is (N, *out, rank) with x first; TOPI's is (N, rank, *out)."""
    x, grid = ctx.input(0), ctx.input(1)
    rank = len(grid.shape) - 2
    mode = {"linear": "bilinear", "cubic": "bicubic"}.get(ctx.attr("mode", "linear"), ctx.attr("mode", "linear"))
    channels_first = topi.transpose(grid, [0, rank + 1] + list(range(1, rank + 1)))
    return [topi.image.grid_sample(x, channels_first, mode, "NCHW" if rank == 2 else "NCDHW",
                                   ctx.attr("padding_mode", "zeros"), bool(ctx.attr("align_corners", 0)))]


def _affine_grid(ctx: LowerContext):
    """grid[n, *pos, :] = theta[n] · (x, y[, z], 1), the base coordinates spanning [-1, 1] over the output size
    (pixel centres unless align_corners)."""
    theta = ctx.input(0)
    out_shape = list(ctx.out_shape())
    spatial = out_shape[1:-1]  # (H, W) or (D, H, W)
    align = bool(ctx.attr("align_corners", 0))
    dtype = theta.dtype

    def base(i, size: int):
        i = tir.Cast(dtype, i)
        if align:
            return i * tir.const(2.0 / (size - 1), dtype) - tir.const(1.0, dtype) if size > 1 else tir.const(0.0, dtype)
        return (i * tir.const(2.0, dtype) + tir.const(1.0, dtype)) / tir.const(size, dtype) - tir.const(1.0, dtype)

    def compute(n, *rest):
        pos, row = rest[:-1], rest[-1]
        coords = [base(p, size) for p, size in zip(reversed(pos), reversed(spatial))]  # x first
        total = theta[n, row, len(coords)]
        for column, value in enumerate(coords):
            total = total + theta[n, row, column] * value
        return total

    return [te.compute(out_shape, compute, name="affine_grid")]


def _eye_like(ctx: LowerContext):
    """Ones on the k-th diagonal of the output's 2-D shape."""
    k, dtype = ctx.attr("k", 0), ctx.out_dtype()
    one, zero = tir.const(1, dtype), tir.const(0, dtype)
    return [te.compute(ctx.out_shape(), lambda i, j: tir.Select(j - i == k, one, zero), name="eye_like")]


def _reverse_sequence(ctx: LowerContext):
    return [topi.reverse_sequence(ctx.input(0), ctx.input(1), ctx.attr("time_axis", 0), ctx.attr("batch_axis", 1))]


def _einsum(ctx: LowerContext):
    return [topi.einsum(ctx.attr("equation").replace(" ", ""), *[x for x in ctx.inputs if x is not None])]


def _view(ctx: LowerContext):
    """Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout: the same elements in the output's shape.

    Alone they run as zero-copy views; inside a fused kernel they are index arithmetic.
    """
    return [topi.reshape(ctx.input(0), ctx.out_shape())]


def _dropout(ctx: LowerContext):
    """Dropout at inference (or with ratio 0) passes its input through; its mask, when asked for, is all true."""
    training, ratio = ctx.data(2), ctx.data(1)
    if training is not None and bool(training.reshape(-1)[0]) and (ratio is None or float(ratio.reshape(-1)[0]) > 0):
        raise ctx.fail("training-mode Dropout drops at random, which Tessel's kernels do not")
    outputs = _view(ctx)
    if len(ctx.output_types) > 1 and ctx.output_types[1] is not None:
        outputs.append(te.compute(ctx.out_shape(1), lambda *i: tir.const(True, "bool"), name="dropout_mask"))
    return outputs


RULES = {
    **{op: _view for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")},
    "Dropout": _dropout,
    "Transpose": _transpose,
    "Concat": _concat,
    "Split": _split,
    "Slice": _slice,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "GatherND": _gather_nd,
    "OneHot": _one_hot,
    "Expand": _expand,
    "Tile": _tile,
    "Pad": _pad,
    "ConstantOfShape": _constant_of_shape,
    "Resize": _resize,
    "DepthToSpace": _depth_to_space,
    "Trilu": _trilu,
    "GridSample": _grid_sample,
    "SpaceToDepth": _space_to_depth,
    "CenterCropPad": _center_crop_pad,
    "EyeLike": _eye_like,
    "AffineGrid": _affine_grid,
    "ReverseSequence": _reverse_sequence,
    "Einsum": _einsum,
}

# Inputs each op needs as compile-time data.
STATIC_INPUTS = {
    "Reshape": {1},
    "Squeeze": {1},
    "Unsqueeze": {1},
    "Dropout": {1, 2},
    "Split": {1},
    "Slice": {1, 2, 3, 4},
    "Tile": {1},
    "Pad": {1, 3},
    "Resize": {1, 2, 3},
    "Trilu": {1},
    "Expand": {1},
    "ConstantOfShape": {0},
    "OneHot": {1},
    "CenterCropPad": {1, 2},
    "AffineGrid": {1},
}
