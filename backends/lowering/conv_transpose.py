"""ConvTranspose (any group, stride, dilation, pads, output padding; 1-D and 2-D) as one product per output phase.

Output row i receives dy row y through tap r when i + pad = y·stride + r·dilation. Output rows of one phase
(i mod stride) are reached by a fixed arithmetic progression of taps, each at a fixed row offset, so per phase
(ph_h, ph_w) the op is a plain correlation with a subset of the taps and no zeros multiplied:

    G[p, c] = Σ_{o in c's group, th, tw} dy_padded[n, o, i0 + off_h(th), k0 + off_w(tw)] · Wt[o, r(th), s(tw), c]

with p = (n, i0, k0) the phase's flattened pixels (padded to whole tiles) and Wt the weights channels-last. A
final stage interleaves the phases into NCHW and adds the bias. The product's layout (pixels × channels,
channels innermost) is what the CPU tiles vectorize (backends/cpu/conv_transpose.py); the generic schedule
vectorizes its channels too. Autodiff's data gradient of a Conv is this op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..tvm_env import tvm
from .context import LowerContext

_tvm = tvm()
te, tir = _tvm.te, _tvm.tirx

# Pixels and channels of a product are padded to whole tiles of these (the CPU schedule's register tile).
PIXEL_TILE = 8
CHANNEL_TILE = 16


@dataclass(frozen=True)
class Taps:
    """The taps reaching one output phase along one axis: r = first + t·step for t < count, read at input offset
    base - t·shift from the phase's own index."""

    first: int
    step: int
    count: int
    base: int
    shift: int

    def tap(self, t):
        """The kernel index of tap number t."""
        return self.first + t * self.step

    def offset(self, t):
        """The input offset of tap number t."""
        return self.base - t * self.shift


def axis_taps(phase: int, pad: int, stride: int, dilation: int, kernel: int) -> Taps:
    """The taps that reach output index ≡ `phase` (mod stride) along one axis."""
    step = stride // math.gcd(dilation, stride)
    first = next((r for r in range(min(kernel, step)) if (phase + pad - r * dilation) % stride == 0), None)
    if first is None:
        return Taps(0, step, 0, 0, 0)
    return Taps(first, step, len(range(first, kernel, step)), (phase + pad - first * dilation) // stride,
                step * dilation // stride)


def deconv_pads(ctx: LowerContext, in_sizes, kernel, strides) -> list[int]:
    """Pads before each spatial axis, from `pads`, or from `auto_pad` / `output_shape` as ONNX defines them."""
    spatial = len(in_sizes)
    pads = ctx.attr("pads")
    if pads and ctx.attr("auto_pad", "NOTSET") == "NOTSET" and not ctx.attr("output_shape"):
        return list(pads[:spatial])
    output_padding = list(ctx.attr("output_padding") or [0] * spatial)
    dilations = list(ctx.attr("dilations") or [1] * spatial)
    before = []
    for i, o, k, s, d, op in zip(in_sizes, ctx.out_shape()[2:], kernel, strides, dilations, output_padding):
        total = s * (i - 1) + op + (k - 1) * d + 1 - o
        # ONNX: SAME_UPPER puts the smaller half first; SAME_LOWER and an output_shape without auto_pad the larger.
        upper = ctx.attr("auto_pad", "NOTSET") == "SAME_UPPER"
        before.append(total // 2 if upper else total - total // 2)
    return before


@dataclass
class PhaseProducts:
    """The per-phase products of a transposed conv: `products[(ph_h, ph_w)]` is G (pixels × channels) or None
    where no tap reaches the phase; `sizes[(ph_h, ph_w)]` its (rows, columns) of output pixels per image."""

    products: dict
    sizes: dict
    channels: int
    out_shape: tuple


def phase_products(x, w, groups: int, strides, dilations, before, out_shape, dense_name: str = "deconv_phase"):
    """The products of every output phase of ConvTranspose(x[N, O, H, W], w[O, C/groups, R, S]) (2-D)."""
    n, in_channels, h, wd = (int(d) for d in x.shape)
    _, per_group, kr, ks = (int(d) for d in w.shape)
    out_channels = per_group * groups
    in_per_group = in_channels // groups
    channels = -(-out_channels // CHANNEL_TILE) * CHANNEL_TILE
    (sh, sw), (dh, dw), (pt, pl) = strides, dilations, before
    oh, ow = out_shape[2:]
    rows_taps = {ph: axis_taps(ph, pt, sh, dh, kr) for ph in range(sh)}
    cols_taps = {ph: axis_taps(ph, pl, sw, dw, ks) for ph in range(sw)}
    sizes = {(a, b): (len(range(a, oh, sh)), len(range(b, ow, sw))) for a in range(sh) for b in range(sw)}
    # One zero-padded dy serves every phase: each tap's rows must fall inside it.
    reach_h = [(t.base - (t.count - 1) * t.shift, t.base + sizes[(a, 0)][0] - 1) for a, t in rows_taps.items() if t.count]
    reach_w = [(t.base - (t.count - 1) * t.shift, t.base + sizes[(0, b)][1] - 1) for b, t in cols_taps.items() if t.count]
    top = max([0] + [-lo for lo, _ in reach_h])
    left = max([0] + [-lo for lo, _ in reach_w])
    bottom = max([0] + [hi - (h - 1) for _, hi in reach_h])
    right = max([0] + [hi - (wd - 1) for _, hi in reach_w])
    zero = tir.const(0.0, x.dtype)

    def pad(ni, o, y, q):
        inside = tir.all(y >= top, y < top + h, q >= left, q < left + wd)
        return tir.if_then_else(inside, x[ni, o, y - top, q - left], zero)

    padded = te.compute((n, in_channels, h + top + bottom, wd + left + right), pad, name="deconv_pad")

    def transpose(o, r, s, c):
        return tir.if_then_else(c < out_channels, w[o, tir.min(c, out_channels - 1) % per_group, r, s], zero)

    weights = te.compute((in_channels, kr, ks, channels), transpose, name="deconv_weights")
    def phase(a: int, b: int, taps_h: Taps, taps_w: Taps, rows: int, cols: int):
        pixels = n * rows * cols
        o = te.reduce_axis((0, in_per_group), "o")
        th = te.reduce_axis((0, taps_h.count), "th")
        tw = te.reduce_axis((0, taps_w.count), "tw")

        def product(p, c):
            pp = tir.min(p, pixels - 1)  # pixels past the last repeat it; the interleave drops them
            ni, i0, k0 = pp // (rows * cols), (pp // cols) % rows, pp % cols
            channel = o if groups == 1 else (tir.min(c, out_channels - 1) // per_group) * in_per_group + o
            value = padded[ni, channel, i0 + taps_h.offset(th) + top, k0 + taps_w.offset(tw) + left]
            return te.sum(value * weights[channel, taps_h.tap(th), taps_w.tap(tw), c], axis=[o, th, tw])

        padded_pixels = -(-pixels // PIXEL_TILE) * PIXEL_TILE
        return te.compute((padded_pixels, channels), product, name=f"{dense_name}_{a}_{b}")

    products = {}
    for (a, b), (rows, cols) in sizes.items():
        taps_h, taps_w = rows_taps[a], cols_taps[b]
        reached = rows and cols and taps_h.count and taps_w.count
        products[(a, b)] = phase(a, b, taps_h, taps_w, rows, cols) if reached else None
    return PhaseProducts(products, sizes, out_channels, tuple(out_shape))


def interleave(phases: PhaseProducts, strides, bias, dtype, name: str = "deconv_out"):
    """dx[n, c, i, k] = the product of phase (i mod sh, k mod sw) at pixel (n, i // sh, k // sw), plus bias[c]."""
    sh, sw = strides

    def value(ni, c, i, k):
        result = tir.const(0.0, dtype)
        for (a, b), product in phases.products.items():
            if product is None:
                continue
            rows, cols = phases.sizes[(a, b)]
            here = product[(ni * rows + i // sh) * cols + k // sw, c]
            result = here if sh * sw == 1 else tir.Select(tir.all(i % sh == a, k % sw == b), here, result)
        return result + bias[c] if bias is not None else result

    return te.compute(phases.out_shape, value, name=name)


def _as_2d(tensor, name: str):
    n, c, w = (int(d) for d in tensor.shape)
    return te.compute((n, c, 1, w), lambda a, b, _h, d: tensor[a, b, d], name=name)


def conv_transpose_operands(ctx: LowerContext):
    """(x, w, bias, strides, dilations, pads before, 2-D output shape) with a 1-D op viewed as 2-D (height 1)."""
    x, w, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    spatial = len(x.shape) - 2
    if spatial not in (1, 2):
        raise ctx.fail(f"{spatial}-D transposed convolution is not supported (1-D and 2-D are)")
    kernel = [int(d) for d in w.shape[2:]]
    strides = list(ctx.attr("strides") or [1] * spatial)
    dilations = list(ctx.attr("dilations") or [1] * spatial)
    before = deconv_pads(ctx, [int(d) for d in x.shape[2:]], kernel, strides)
    out_shape = list(ctx.out_shape())
    if spatial == 1:
        x, w = _as_2d(x, "deconv_data_2d"), _as_2d(w, "deconv_weight_2d")
        strides, dilations, before = [1] + strides, [1] + dilations, [0] + before
        out_shape = out_shape[:2] + [1] + out_shape[2:]
    return x, w, bias, strides, dilations, before, out_shape


def conv_transpose(ctx: LowerContext):
    """ConvTranspose through its phase products (module docstring), scheduled by the target's generic schedule."""
    x, w, bias, strides, dilations, before, out_shape = conv_transpose_operands(ctx)
    phases = phase_products(x, w, ctx.attr("group", 1), strides, dilations, before, out_shape)
    out = interleave(phases, strides, bias, ctx.out_dtype())
    if len(ctx.out_shape()) == 3:
        flat = out
        out = te.compute(ctx.out_shape(), lambda n, c, q: flat[n, c, 0, q], name="deconv_1d")
    return [out]


RULES = {"ConvTranspose": conv_transpose}
