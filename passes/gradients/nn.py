"""Gradient rules of neural-network ops: softmax family, MatMul and Gemm, convolutions, pooling, normalization,
LRN and inference-form Dropout."""
from __future__ import annotations

import math

import numpy as np

from tessel.ir.graph import Node, Value
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.types import numpy_dtype

from .builder import GradBuilder, Grads, Rule


def _softmax(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, y = grads[0], node.outputs[0]
    axis = node.attrs.get("axis", -1) % y.type.rank
    dot = b.reduce_sum(b.mul(dy, y), [axis], keepdims=True)
    return [b.mul(y, b.sub(dy, dot))]


def _log_softmax(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, y = grads[0], node.outputs[0]
    axis = node.attrs.get("axis", -1) % y.type.rank
    total = b.reduce_sum(dy, [axis], keepdims=True)
    return [b.sub(dy, b.mul(b.op("Exp", [y]), total))]


def _swap_last(b: GradBuilder, value: Value) -> Value:
    rank = value.type.rank
    return b.transpose(value, list(range(rank - 2)) + [rank - 1, rank - 2])


def _matmul(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, (x, w) = grads[0], node.inputs
    # 1-D operands act as a row (x) or a column (w) matrix, as numpy.matmul.
    x2 = b.reshape(x, (1, *x.type.shape)) if x.type.rank == 1 else x
    w2 = b.reshape(w, (*w.type.shape, 1)) if w.type.rank == 1 else w
    batch = _broadcast_shape(x2.type.shape[:-2], w2.type.shape[:-2])
    dy2 = b.reshape(dy, (*batch, x2.type.shape[-2], w2.type.shape[-1]))
    dx = dw = None
    if b.wants(0):
        dx = b.reshape(b.unbroadcast(b.op("MatMul", [dy2, _swap_last(b, w2)]), x2), x.type.shape)
    if b.wants(1):
        if w2.type.rank == 2:
            # A weight matrix shared by a batch: one matrix product over the flattened batch rows, as Gemm with
            # transA, which reads both operands along their rows (backends/cpu/tall_product.py).
            k, m = w2.type.shape
            rows = b.reshape(x2, (-1, k)) if x2.type.rank > 2 else x2
            drows = b.reshape(dy2, (-1, m)) if dy2.type.rank > 2 else dy2
            dw2 = b.op("Gemm", [rows, drows], transA=1)
        else:
            dw2 = b.unbroadcast(b.op("MatMul", [_swap_last(b, x2), dy2]), w2)
        dw = b.reshape(dw2, w.type.shape)
    return [dx, dw]


def _broadcast_shape(a: tuple[int, ...], c: tuple[int, ...]) -> tuple[int, ...]:
    rank = max(len(a), len(c))
    a, c = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(c)) + tuple(c)
    return tuple(max(p, q) for p, q in zip(a, c))


def _gemm(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # Y = alpha A' B' + beta C with A' = A^T if transA, B' = B^T if transB.
    dy, inputs = grads[0], node.inputs
    a, w = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    alpha, beta = node.attrs.get("alpha", 1.0), node.attrs.get("beta", 1.0)
    trans_a, trans_w = node.attrs.get("transA", 0), node.attrs.get("transB", 0)
    da = dw = dc = None
    if b.wants(0):
        da = (b.op("Gemm", [w, dy], alpha=alpha, transA=trans_w, transB=1) if trans_a
              else b.op("Gemm", [dy, w], alpha=alpha, transB=1 - trans_w))
    if b.wants(1):
        dw = (b.op("Gemm", [dy, a], alpha=alpha, transA=1, transB=trans_a) if trans_w
              else b.op("Gemm", [a, dy], alpha=alpha, transA=1 - trans_a))
    if c is not None and b.wants(2):
        scaled = dy if beta == 1.0 else b.mul(dy, b.scalar(beta, dy))
        dc = b.unbroadcast(scaled, c)
    return [da, dw, dc][:len(inputs)]


def window_attrs(node: Node, x: Value, y: Value, kernel: list[int]) -> dict:
    """The explicit sliding-window attributes of a conv or pool node over x -> y (auto_pad resolved to pads)."""
    rank = len(kernel)
    strides = list(node.attrs.get("strides") or [1] * rank)
    dilations = list(node.attrs.get("dilations") or [1] * rank)
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = list(node.attrs.get("pads") or [0] * (2 * rank))
    elif auto_pad == "VALID":
        pads = [0] * (2 * rank)
    else:
        totals = [max(0, (o - 1) * s + (k - 1) * d + 1 - i)
                  for i, o, k, s, d in zip(x.type.shape[2:], y.type.shape[2:], kernel, strides, dilations)]
        begins = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
        pads = begins + [t - b for t, b in zip(totals, begins)]
    return {"kernel_shape": list(kernel), "strides": strides, "pads": pads, "dilations": dilations}


def _bias_grad(b: GradBuilder, dy: Value) -> Value:
    """The gradient of a per-channel bias (axis 1) added to `dy`'s tensor."""
    return b.reduce_sum(dy, [0] + list(range(2, dy.type.rank)), keepdims=False)


def _conv(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, (x, w) = grads[0], node.inputs[:2]
    window = window_attrs(node, x, node.outputs[0], list(w.type.shape[2:]))
    group = node.attrs.get("group", 1)
    dx = dw = db = None
    if b.wants(0):
        # ConvTranspose of dy with the same filter; output_padding restores the rows the stride dropped.
        produced = [s * (o - 1) + (k - 1) * d + 1 - pb - pe for o, k, s, d, pb, pe in zip(
            dy.type.shape[2:], window["kernel_shape"], window["strides"], window["dilations"],
            window["pads"][:len(window["strides"])], window["pads"][len(window["strides"]):])]
        dx = b.op("ConvTranspose", [dy, w], group=group, **window,
                  output_padding=[i - p for i, p in zip(x.type.shape[2:], produced)])
    if b.wants(1):
        dw = b.op("ConvGradFilter", [x, dy], domain=TESSEL_DOMAIN, group=group, **window)
    if len(node.inputs) > 2 and b.wants(2):
        db = _bias_grad(b, dy)
    return [dx, dw, db][:len(node.inputs)]


def _conv_transpose_pads(node: Node, x: Value, y: Value, window: dict) -> list[int]:
    """A ConvTranspose node's effective pads (given, or derived from output_shape / auto_pad as ONNX says)."""
    rank = len(window["kernel_shape"])
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if auto_pad == "NOTSET" and not node.attrs.get("output_shape"):
        return list(node.attrs.get("pads") or [0] * (2 * rank))
    output_padding = list(node.attrs.get("output_padding") or [0] * rank)
    totals = [s * (i - 1) + op + (k - 1) * d + 1 - o for i, o, k, s, d, op in zip(
        x.type.shape[2:], y.type.shape[2:], window["kernel_shape"], window["strides"], window["dilations"],
        output_padding)]
    begins = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
    return begins + [t - p for t, p in zip(totals, begins)]


def _conv_transpose(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # y = ConvTranspose(x, W) is the data gradient of a Conv from y's space to x's: its gradients are that Conv
    # (data) and that Conv's filter gradient with the roles of input and output swapped.
    dy, (x, w) = grads[0], node.inputs[:2]
    kernel = list(node.attrs.get("kernel_shape") or w.type.shape[2:])
    rank = len(kernel)
    window = {"kernel_shape": kernel, "strides": list(node.attrs.get("strides") or [1] * rank),
              "dilations": list(node.attrs.get("dilations") or [1] * rank)}
    window["pads"] = _conv_transpose_pads(node, x, node.outputs[0], window)
    group = node.attrs.get("group", 1)
    dx = b.op("Conv", [dy, w], group=group, **window) if b.wants(0) else None
    dw = b.op("ConvGradFilter", [dy, x], domain=TESSEL_DOMAIN, group=group, **window) if b.wants(1) else None
    db = _bias_grad(b, dy) if len(node.inputs) > 2 and b.wants(2) else None
    return [dx, dw, db][:len(node.inputs)]


def _max_pool(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x = grads[0], node.inputs[0]
    window = window_attrs(node, x, node.outputs[0], list(node.attrs["kernel_shape"]))
    return [b.op("MaxPoolGrad", [x, dy], domain=TESSEL_DOMAIN, ceil_mode=node.attrs.get("ceil_mode", 0), **window)]


def _average_pool(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x = grads[0], node.inputs[0]
    window = window_attrs(node, x, node.outputs[0], list(node.attrs["kernel_shape"]))
    return [b.op("AveragePoolGrad", [dy], domain=TESSEL_DOMAIN, ceil_mode=node.attrs.get("ceil_mode", 0),
                 count_include_pad=node.attrs.get("count_include_pad", 0), input_shape=list(x.type.shape), **window)]


def _global_average_pool(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x = grads[0], node.inputs[0]
    share = b.mul(dy, b.scalar(1.0 / math.prod(x.type.shape[2:]), dy))
    return [b.expand(share, x.type.shape)]


def _global_max_pool(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # One window over all of each map: its gradient goes to the first maximum, as PyTorch's max pooling.
    dy, x = grads[0], node.inputs[0]
    spatial = list(x.type.shape[2:])
    return [b.op("MaxPoolGrad", [x, dy], domain=TESSEL_DOMAIN, kernel_shape=spatial)]


def _layer_norm(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x, scale = grads[0], node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    axes = list(range(node.attrs.get("axis", -1) % x.type.rank, x.type.rank))
    count = math.prod(x.type.shape[a] for a in axes)

    def mean(value: Value) -> Value:
        return b.mul(b.reduce_sum(value, axes, keepdims=True), b.scalar(1.0 / count, value))

    centered = b.sub(x, mean(x))
    variance = mean(b.mul(centered, centered))
    rstd = b.op("Reciprocal", [b.op("Sqrt", [b.add(variance, b.scalar(node.attrs.get("epsilon", 1e-5), variance))])])
    normalized = b.mul(centered, rstd)
    dx = dscale = dbias = None
    if b.wants(0):
        g = b.mul(dy, scale)
        dx = b.mul(rstd, b.sub(b.sub(g, mean(g)), b.mul(normalized, mean(b.mul(g, normalized)))))
    if b.wants(1):
        dscale = b.unbroadcast(b.mul(dy, normalized), scale)
    if bias is not None and b.wants(2):
        dbias = b.unbroadcast(dy, bias)
    return [dx, dscale, dbias][:len(node.inputs)]


def _layer_norm_unsupported(node: Node) -> str | None:
    if any(out is not None and (out.uses or out.is_graph_output) for out in node.outputs[1:]):
        return "its Mean or InvStdDev output is used"
    return None


def _batch_norm(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # Inference form: the statistics are inputs, held fixed (prepare_training rewrites training-mode BN).
    dy, (x, scale, mean, var) = grads[0], (*node.inputs[:2], *node.inputs[3:5])
    per_channel = [x.type.shape[1]] + [1] * (x.type.rank - 2)
    rstd = b.op("Reciprocal", [b.op("Sqrt", [b.add(var, b.scalar(node.attrs.get("epsilon", 1e-5), var))])])
    dx = dscale = dbias = None
    if b.wants(0):
        dx = b.mul(dy, b.reshape(b.mul(scale, rstd), per_channel))
    if b.wants(1):
        normalized = b.mul(b.sub(x, b.reshape(mean, per_channel)), b.reshape(rstd, per_channel))
        dscale = _bias_grad(b, b.mul(dy, normalized))
    if b.wants(2):
        dbias = _bias_grad(b, dy)
    return [dx, dscale, dbias, None, None]


def _batch_norm_unsupported(node: Node) -> str | None:
    if node.attrs.get("training_mode", 0):
        return "training_mode=1 (prepare_training rewrites it into primitive ops)"
    return None


def _batch_stats(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # mean = Σx / n and var = Σ(x - mean)² / n: dx = dmean / n + 2 (x - mean) dvar / n. The var's derivative
    # through the mean, -2 Σ(x - mean) / n, is zero and left out (autodiff of the primitive ops computes it).
    dmean, dvar = grads
    x, mean = node.inputs[0], node.outputs[0]
    count = x.type.numel // x.type.shape[1]
    dx = None
    if dvar is not None:
        dx = b.mul(b.sub(x, mean), b.mul(dvar, b.scalar(2.0 / count, dvar)))
    if dmean is not None:
        share = b.mul(dmean, b.scalar(1.0 / count, dmean))
        dx = b.expand(share, x.type.shape) if dx is None else b.add(dx, share)
    return [dx]


def _channel_window_sum(b: GradBuilder, value: Value, band: np.ndarray) -> Value:
    """sum over channels c' of value[:, c'] * band[c', c], for each channel c (axis 1)."""
    rank = value.type.rank
    last = b.transpose(value, [0] + list(range(2, rank)) + [1])
    summed = b.op("MatMul", [last, b.constant(band.astype(numpy_dtype(value.type.dtype)))])
    return b.transpose(summed, [0, rank - 1] + list(range(1, rank - 1)))


def _lrn(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # y = x s^-beta with s = bias + alpha/size * (sum of x^2 over the channel window):
    # dx = dy s^-beta - 2 beta alpha/size * x * (sum over the windows holding x of dy y / s)
    dy, x, y = grads[0], node.inputs[0], node.outputs[0]
    size = node.attrs["size"]
    alpha, beta, bias = node.attrs.get("alpha", 1e-4), node.attrs.get("beta", 0.75), node.attrs.get("bias", 1.0)
    channels = x.type.shape[1]
    band = np.zeros((channels, channels))
    for c in range(channels):
        band[max(0, c - (size - 1) // 2):min(channels - 1, c + size // 2) + 1, c] = 1.0
    s = b.add(b.scalar(bias, x), b.mul(b.scalar(alpha / size, x), _channel_window_sum(b, b.mul(x, x), band)))
    direct = b.mul(dy, b.op("Pow", [s, b.scalar(-beta, s)]))
    spread = _channel_window_sum(b, b.div(b.mul(dy, y), s), band.T)
    return [b.sub(direct, b.mul(b.scalar(2.0 * beta * alpha / size, x), b.mul(x, spread)))]


def _dropout(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    return [grads[0]] + [None] * (len(node.inputs) - 1)


def _dropout_unsupported(node: Node) -> str | None:
    # Only the inference form is the identity; prepare_training rewrites a training-mode Dropout into x * mask.
    training = node.inputs[2] if len(node.inputs) > 2 else None
    ratio = node.inputs[1] if len(node.inputs) > 1 else None
    if training is None or (training.const is not None and not training.const.any()):
        return None
    if ratio is not None and ratio.const is not None and not ratio.const.any():
        return None
    return "training mode (prepare_training rewrites it into x * mask)"


RULES: dict[str, Rule] = {
    "Softmax": Rule(_softmax),
    "LogSoftmax": Rule(_log_softmax),
    "MatMul": Rule(_matmul),
    "Gemm": Rule(_gemm),
    "Conv": Rule(_conv),
    "ConvTranspose": Rule(_conv_transpose),
    "MaxPool": Rule(_max_pool),
    "AveragePool": Rule(_average_pool),
    "GlobalAveragePool": Rule(_global_average_pool),
    "GlobalMaxPool": Rule(_global_max_pool),
    "LayerNormalization": Rule(_layer_norm, _layer_norm_unsupported),
    "BatchNormalization": Rule(_batch_norm, _batch_norm_unsupported),
    "LRN": Rule(_lrn),
    "Dropout": Rule(_dropout, _dropout_unsupported),
}
# Tessel-domain ops of the training graph.
TESSEL_RULES: dict[str, Rule] = {
    "BatchStats": Rule(_batch_stats),
}
