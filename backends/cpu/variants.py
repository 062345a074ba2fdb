"""The lowering rules of the conv and matmul algorithms a kernel spec can choose instead of the generic rule.

A spec chooses through its attributes: the packed layouts that `plan_packing`
recorded (conv "nchwc" and "direct", matmul "packed"; depthwise conv "nchwc", grouped conv
"grouped_gemm"), or the ALGORITHM
attribute (conv "im2col" and "winograd"). Without them the op's
target-neutral rule (backends/lowering/) lowers it. Dense 2-D ConvTranspose and ConvGradFilter (the backward
convolutions) and a dense 2-D Conv left unpacked (its weights known only at run time: a training step's
parameters) run as register-tiled products on CPU (conv_transpose.py, conv_grad_filter.py,
conv_runtime_weights.py), and so does a Gemm with transA over tall operands (a weight gradient: tall_product.py);
a ConvTranspose with constant weights whose kernel equals its strides runs as an upsampling instead
(conv_transpose_upsample.py: ALGORITHM "upsample").
A 2-D float32 MaxPool runs separable on CPU (max_pool.py), and so do an AveragePool whose windows read padding
(average_pool.py), a GlobalAveragePool sums its planes in vector lanes (global_pool.py), and a training
MaxPoolWithTaps, its taps found in the same pass (max_pool_taps.py). A float32 BatchStats reads x once (batch_stats.py).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..kernel import ALGORITHM
from ..lowering.context import LowerContext
from ..lowering.conv_transpose import conv_transpose
from ..lowering.grad import RULES as GRAD_RULES, conv_grad_filter, window_of
from ..lowering.nn import RULES as GENERIC_NN_RULES, conv_pads
from .average_pool import (applies as separable_average_pool_applies, average_pool_by_rows,
                           average_pool_separable, runs_by_rows)
from .batch_stats import applies as one_read_stats_applies, batch_stats
from .conv_grad_filter import applies as tiled_grad_filter_applies, conv_grad_filter_tiled
from .conv_runtime_weights import applies as runtime_weights_applies, conv_runtime_weights
from .conv_transpose import applies as tiled_conv_transpose_applies, conv_transpose_tiled
from .conv_transpose_upsample import applies as upsample_applies, conv_transpose_upsample
from .depthwise_conv import conv_depthwise
from .global_pool import applies as lane_global_pool_applies, global_average_pool
from .grouped_conv import conv_grouped
from .im2col import conv_im2col
from .max_pool import (applies as separable_max_pool_applies, max_pool_blocks, max_pool_separable,
                       reads_channel_blocks)
from .max_pool_taps import applies as one_pass_taps_applies, max_pool_with_taps
from .packed_kernels import conv_packed, matmul_packed
from .packing import CONV_BLOCKS, DEPTHWISE_BLOCK, GROUPED_LAYOUT, MATMUL_BLOCK
from .tall_product import applies as tall_product_applies, gemm_tall
from .winograd import conv_winograd
from .winograd_blocks import applies as winograd_blocks_applies, conv_winograd_blocks


def _conv_packed(ctx: LowerContext):
    return conv_packed(ctx, *conv_pads(ctx), direct=ctx.attr(ALGORITHM) == "direct")


def _conv_depthwise(ctx: LowerContext):
    return conv_depthwise(ctx, *conv_pads(ctx))


def _conv_grouped(ctx: LowerContext):
    return conv_grouped(ctx, *conv_pads(ctx))


def _conv_im2col(ctx: LowerContext):
    return conv_im2col(ctx, *conv_pads(ctx))


def _conv_winograd(ctx: LowerContext):
    if winograd_blocks_applies(ctx.input(0), ctx.input(1)):
        return conv_winograd_blocks(ctx, *conv_pads(ctx))
    return conv_winograd(ctx, *conv_pads(ctx))


def _matmul_packed(ctx: LowerContext):
    if ctx.op_type == "Gemm":
        return matmul_packed(ctx, alpha=ctx.attr("alpha", 1.0), beta=ctx.attr("beta", 1.0))
    return matmul_packed(ctx)


def _conv_grad_filter(ctx: LowerContext):
    if ctx.attr(ALGORITHM) == "generic" or not tiled_grad_filter_applies(ctx):
        return conv_grad_filter(ctx)
    return conv_grad_filter_tiled(ctx, window_of(ctx, ctx.input_types[0].shape[2:], ctx.input_types[1].shape[2:]))


def _gemm_trans_a(ctx: LowerContext):
    if ctx.attr(ALGORITHM) == "generic" or not tall_product_applies(ctx):
        return GENERIC_NN_RULES["Gemm"](ctx)
    return gemm_tall(ctx)


def _conv_unpacked(ctx: LowerContext):
    if not runtime_weights_applies(ctx):
        return GENERIC_NN_RULES["Conv"](ctx)
    return conv_runtime_weights(ctx, *conv_pads(ctx))


def _max_pool(ctx: LowerContext):
    if reads_channel_blocks(ctx):
        return max_pool_blocks(ctx)
    if not separable_max_pool_applies(ctx):
        return GENERIC_NN_RULES["MaxPool"](ctx)
    return max_pool_separable(ctx)


def _average_pool(ctx: LowerContext):
    if not separable_average_pool_applies(ctx):
        return GENERIC_NN_RULES["AveragePool"](ctx)
    if runs_by_rows(ctx):
        return [average_pool_by_rows(ctx)]
    return average_pool_separable(ctx)


def _global_average_pool(ctx: LowerContext):
    if not lane_global_pool_applies(ctx):
        return GENERIC_NN_RULES["GlobalAveragePool"](ctx)
    return global_average_pool(ctx)


def _max_pool_with_taps(ctx: LowerContext):
    if not one_pass_taps_applies(ctx):
        return GRAD_RULES["MaxPoolWithTaps"](ctx)
    return max_pool_with_taps(ctx)


def _batch_stats(ctx: LowerContext):
    if not one_read_stats_applies(ctx):
        return GRAD_RULES["BatchStats"](ctx)
    return batch_stats(ctx)


def _conv_transpose(ctx: LowerContext):
    if ctx.attr(ALGORITHM) == "upsample" and upsample_applies(ctx):
        return conv_transpose_upsample(ctx)
    tiled = ctx.attr(ALGORITHM) != "generic" and tiled_conv_transpose_applies(ctx)
    return conv_transpose_tiled(ctx) if tiled else conv_transpose(ctx)


_CONV_ALGORITHMS = {"im2col": _conv_im2col, "winograd": _conv_winograd}


def variant_rule(op_type: str, attrs: Mapping[str, Any]) -> Callable | None:
    """The rule of the algorithm these attributes chose for the op; None when the generic rule applies."""
    if op_type == "Conv":
        if attrs.get(CONV_BLOCKS):
            return _conv_packed
        if attrs.get(DEPTHWISE_BLOCK):
            return _conv_depthwise
        if attrs.get(GROUPED_LAYOUT):
            return _conv_grouped
        return _CONV_ALGORITHMS.get(attrs.get(ALGORITHM), _conv_unpacked)
    if op_type in ("MatMul", "Gemm") and attrs.get(MATMUL_BLOCK):
        return _matmul_packed
    if op_type == "Gemm" and attrs.get("transA") and not attrs.get("transB"):
        return _gemm_trans_a
    if op_type == "ConvGradFilter":
        return _conv_grad_filter
    if op_type == "ConvTranspose":
        return _conv_transpose
    if op_type == "MaxPool":
        return _max_pool
    if op_type == "AveragePool":
        return _average_pool
    if op_type == "GlobalAveragePool":
        return _global_average_pool
    if op_type == "MaxPoolWithTaps":
        return _max_pool_with_taps
    if op_type == "BatchStats":
        return _batch_stats
    return None
