"""TVM-style op patterns: how an op's outputs depend on its inputs, which decides what fuses.

ELEMWISE: output element i reads input element i. BROADCAST: the same, with
broadcasting. INJECTIVE: each output element reads one input element (layout
and indexing ops). REDUCTION: output elements combine many input elements
(reductions, softmax, normalisations, pooling). OUT_EWISE_FUSABLE: compute-
heavy ops whose elementwise consumers fuse into their epilogue (conv, matmul).
OPAQUE: never fused.
"""
from __future__ import annotations

from enum import IntEnum

from tessel.ir.graph import Node


class Pattern(IntEnum):
    """Op patterns, ordered as TVM orders them: a group's pattern is the largest of its members'."""

    ELEMWISE = 0
    BROADCAST = 1
    INJECTIVE = 2
    REDUCTION = 3
    OUT_EWISE_FUSABLE = 4
    OPAQUE = 8


ELEMENTWISE_OPS = frozenset({
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BatchNormalization", "BitShift",
    "Ceil", "Celu", "Clip", "Cos", "Cosh", "Div", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater",
    "GreaterOrEqual", "HardSigmoid", "HardSwish", "IsInf", "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log",
    "Max", "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "Pow", "PRelu", "Reciprocal", "Relu",
    "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Sub", "Sum",
    "Tan", "Tanh", "ThresholdedRelu", "Where", "Xor", "Cast", "CastLike",
})
INJECTIVE_OPS = frozenset({
    "Concat", "DepthToSpace", "Expand", "Flatten", "Gather", "GatherElements", "Identity", "Pad", "Reshape",
    "Resize", "Slice", "SpaceToDepth", "Squeeze", "Tile", "Transpose", "Trilu", "Unsqueeze",
})
REDUCTION_OPS = frozenset({
    "ArgMax", "ArgMin", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "InstanceNormalization",
    "LayerNormalization", "LogSoftmax", "LRN", "MaxPool", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare",
    "Softmax",
})
OUT_EWISE_FUSABLE_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def pattern(node: Node) -> Pattern:
    """The node's pattern; nodes with several outputs, subgraphs or a domain are opaque."""
    if node.domain or node.subgraphs() or sum(1 for v in node.outputs if v is not None) != 1:
        return Pattern.OPAQUE
    op = node.op_type
    if op == "Dropout" and len(node.outputs) == 1:
        return Pattern.INJECTIVE
    if op in ELEMENTWISE_OPS:
        shape = node.outputs[0].type.shape
        same = all(v is None or v.type.shape == shape or v.type.numel == 1 for v in node.inputs)
        return Pattern.ELEMWISE if same else Pattern.BROADCAST
    if op in INJECTIVE_OPS:
        return Pattern.INJECTIVE
    if op in REDUCTION_OPS:
        return Pattern.REDUCTION
    if op in OUT_EWISE_FUSABLE_OPS:
        return Pattern.OUT_EWISE_FUSABLE
    return Pattern.OPAQUE
