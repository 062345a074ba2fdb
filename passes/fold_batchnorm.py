"""BatchNormalization (inference form) folded into the Conv or Gemm that feeds it.

y = (conv(x, W) + b - mean) · s + beta with s = gamma / sqrt(var + eps) is
conv(x, W · s) + (b - mean) · s + beta: new constant weights, one node fewer.
"""
from __future__ import annotations

import numpy as np

from tessel.ir.graph import Node, Value

from .base import add_op, retire, single_user


def _constants(values) -> list[np.ndarray] | None:
    if any(v is None or not v.is_constant for v in values):
        return None
    return [v.const.astype(np.float64) for v in values]


def fold_batchnorm(node: Node) -> str | None:
    """Fold a BatchNormalization whose input comes only from a Conv or Gemm with constant weights."""
    if node.op_type != "BatchNormalization" or any(v is not None for v in node.outputs[1:]):
        return None
    source: Value = node.inputs[0]
    producer = source.producer
    if producer is None or single_user(source) is not node or producer.graph is not node.graph:
        return None
    params = _constants(node.inputs[1:5])
    if params is None or source.type.dtype not in ("float32", "float64"):
        return None
    gamma, beta, mean, var = params
    scale = gamma / np.sqrt(var + node.attrs.get("epsilon", 1e-5))
    if producer.op_type == "Conv":
        folded = _fold_into_conv(producer, scale, beta, mean)
    elif producer.op_type == "Gemm" and source.type.rank == 2:
        folded = _fold_into_gemm(producer, scale, beta, mean)
    else:
        return None
    if folded is None:
        return None
    retire(node, {0: folded.outputs[0]})
    return f"batchnorm_folded_into_{producer.op_type.lower()}"


def _fold_into_conv(conv: Node, scale, beta, mean) -> Node | None:
    weight = conv.inputs[1]
    bias = conv.inputs[2] if len(conv.inputs) > 2 else None
    if not weight.is_constant or (bias is not None and not bias.is_constant):
        return None
    dtype = weight.const.dtype
    w = weight.const.astype(np.float64) * scale.reshape((-1,) + (1,) * (weight.type.rank - 1))
    b = bias.const.astype(np.float64) if bias is not None else np.zeros_like(scale)
    g = conv.graph
    new_w = g.add_constant(f"{weight.name}_bn", w.astype(dtype))
    new_b = g.add_constant(f"{conv.name}_bn_bias", ((b - mean) * scale + beta).astype(dtype))
    return add_op(g, "Conv", [conv.inputs[0], new_w, new_b], dict(conv.attrs), name=conv.name, before=conv)


def _fold_into_gemm(gemm: Node, scale, beta, mean) -> Node | None:
    a, b = gemm.inputs[0], gemm.inputs[1]
    c = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    if not b.is_constant or (c is not None and not c.is_constant):
        return None
    rows, cols = gemm.outputs[0].type.shape
    alpha, beta_c = gemm.attrs.get("alpha", 1.0), gemm.attrs.get("beta", 1.0)
    dtype = b.const.dtype
    w = b.const.astype(np.float64)
    w = w * scale[:, None] if gemm.attrs.get("transB", 0) else w * scale[None, :]
    offset = np.broadcast_to(c.const.astype(np.float64) * beta_c, (rows, cols)) if c is not None else np.zeros((rows, cols))
    if c is None or c.type.shape[:-1] == () or all(d == 1 for d in c.type.shape[:-1]):
        offset = offset[0]
    g = gemm.graph
    new_b = g.add_constant(f"{b.name}_bn", w.astype(dtype))
    new_c = g.add_constant(f"{gemm.name}_bn_bias", ((offset - mean) * scale + beta).astype(dtype))
    attrs = {**gemm.attrs, "beta": 1.0, "alpha": alpha}
    return add_op(g, "Gemm", [a, new_b, new_c], attrs, name=gemm.name, before=gemm)
