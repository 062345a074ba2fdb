"""A dense 2-D ConvTranspose (group 1) on CPU: its phase products (backends/lowering/conv_transpose.py) as
register tiles of 8 output pixels × 32 output channels, each dy element one broadcast, each weight row of
channels one vector; the interleave writes NCHW a row of pixels at a time."""
from __future__ import annotations

from ..lowering.context import LowerContext, SelfScheduled
from ..lowering.conv_transpose import CHANNEL_TILE, PIXEL_TILE, conv_transpose_operands, interleave, phase_products
from .broadcast_tiles import schedule_copies, schedule_nchw_output, tile_product
from .schedule import MIN_PARALLEL_WORK

# Row tiles run outside the column strips only while the weights' channels-last copy is at most this big (below
# broadcast_tiles' L2 bound, which the forward convolution keeps). Measured, one thread, batch 32, 3x3 stride 1
# (ResNet-18's data gradients; row tiles outer / column strips outer / PyTorch's conv_transpose2d): 64 channels at
# 56x56 (144 KiB of weights) 35.0 / 36.2 / 60.5 ms; 128 at 28x28 (576 KiB) 58.9 / 42.2 / 43.5; 256 at 14x14
# (2.25 MiB) 52.0 / 42.8 / 33.2. Between 144 and 576 KiB nothing was measured.
ROWS_OUTER_WEIGHT_BYTES = 512 << 10


def applies(ctx: LowerContext) -> bool:
    """Whether the tiled kernel runs this ConvTranspose: dense, 2-D, float32, on CPU."""
    return (not ctx.gpu and ctx.attr("group", 1) == 1 and len(ctx.input_types[0].shape) == 4
            and ctx.input_types[0].dtype == "float32" and ctx.input_types[1].dtype == "float32")


def conv_transpose_tiled(ctx: LowerContext):
    """ConvTranspose(x, w[, bias]) as tiled phase products (see the module docstring)."""
    x, w, bias, strides, dilations, before, out_shape = conv_transpose_operands(ctx)
    phases = phase_products(x, w, 1, strides, dilations, before, out_shape, dense_name="deconv_tiles")
    out = interleave(phases, strides, bias, ctx.out_dtype(), name="deconv_out")
    n, channels, h, wd = out_shape
    in_channels, _, kr, ks = (int(d) for d in w.shape)
    weight_bytes = in_channels * kr * ks * -(-channels // CHANNEL_TILE) * CHANNEL_TILE * 4  # the channels-last copy
    big = n * channels * h * wd * in_channels * kr * ks >= MIN_PARALLEL_WORK * 16 * strides[0] * strides[1]

    def schedule(sch) -> None:
        for (a, b), product in phases.products.items():
            if product is not None:
                tile_product(sch, f"deconv_tiles_{a}_{b}", PIXEL_TILE, big,
                             row_tiles_outer=weight_bytes <= ROWS_OUTER_WEIGHT_BYTES)
        schedule_copies(sch, ("deconv_pad", "deconv_weights"), big)
        schedule_nchw_output(sch, "deconv_out", big)

    return SelfScheduled([out], schedule)
