"""Analytic costs of one node: floating-point operations and bytes moved.

These are the analytic half of the cost model (the measured half comes from
the backend's profiler). FLOPs count a multiply-add as two operations.
"""
from __future__ import annotations

import math

from .graph import Node
from .schema import FUSED, TESSEL_DOMAIN

# Ops that only move, copy or re-index data: no arithmetic.
DATA_MOVEMENT = frozenset({
    "Cast", "CastLike", "Concat", "DepthToSpace", "Dropout", "Expand", "EyeLike", "Flatten", "Gather",
    "GatherElements", "GatherND", "Identity", "Pad", "Reshape", "ScatterElements", "ScatterND", "Shape",
    "Size", "Slice", "SpaceToDepth", "Split", "Squeeze", "Tile", "Transpose", "Trilu", "Unsqueeze",
    "ConstantOfShape", "Range", "OneHot", "ReverseSequence", "Unreachable",
})
# Rough operation counts per element for normalisations and softmax (max, sub, exp, sum, div, ...).
PER_ELEMENT = {"Softmax": 5, "LogSoftmax": 6, "LayerNormalization": 8, "BatchNormalization": 2,
               "InstanceNormalization": 8, "GroupNormalization": 8, "LpNormalization": 3, "Gelu": 8, "Erf": 4}


def _numel(value) -> int:
    return value.type.numel if value is not None else 0


def flops(node: Node) -> int:
    """Floating-point operations one run of the node performs (max over If branches)."""
    op = node.op_type
    ins, outs = node.inputs, node.outputs
    out = _numel(outs[0]) if outs else 0
    if op == "If":
        return max((sum(flops(n) for n in branch.walk_nodes()) for branch in node.subgraphs()), default=0)
    if node.domain == TESSEL_DOMAIN and op == FUSED:
        return sum(flops(n) for body in node.subgraphs() for n in body.walk_nodes())
    if op in DATA_MOVEMENT:
        return 0
    if op == "Conv":
        weight = ins[1].type.shape
        per_output = 2 * weight[1] * math.prod(weight[2:])
        return out * per_output + (out if len(ins) > 2 and ins[2] is not None else 0)
    if op == "ConvTranspose":
        weight = ins[1].type.shape  # (C_in, C_out / group, k...)
        return 2 * _numel(ins[0]) * weight[1] * math.prod(weight[2:])
    if op == "MatMul":
        return 2 * out * ins[0].type.shape[-1]
    if op == "Gemm":
        a = ins[0].type.shape
        k = a[0] if node.attrs.get("transA", 0) else a[1]
        return 2 * out * k + (out if len(ins) > 2 and ins[2] is not None else 0)
    if op in ("LSTM", "GRU", "RNN"):
        seq, batch, width = ins[0].type.shape
        if node.attrs.get("layout", 0):
            batch, seq = seq, batch
        directions, gates_hidden, _ = ins[1].type.shape
        hidden = node.attrs["hidden_size"]
        per_step = 2 * gates_hidden * (width + hidden) + 10 * hidden
        return seq * batch * directions * per_step
    if op in ("MaxPool", "AveragePool", "LpPool"):
        return out * math.prod(node.attrs.get("kernel_shape", (1,)))
    if op == "MaxPoolWithTaps":  # every tap compared, and its index kept where it is the new maximum
        return 2 * out * math.prod(node.attrs["kernel_shape"])
    if op == "BatchStats":  # one read: a subtract (the shift), two adds and a multiply per element
        return 4 * _numel(ins[0])
    if op.startswith("Reduce") or op.startswith("Global") or op in ("ArgMax", "ArgMin"):
        return _numel(ins[0])
    return out * PER_ELEMENT.get(op, 1)


def bytes_moved(node: Node) -> int:
    """Bytes the node reads and writes if every tensor crosses memory once."""
    return sum(v.type.nbytes for v in node.inputs if v is not None) + sum(v.type.nbytes for v in node.outputs if v is not None)
