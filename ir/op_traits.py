"""Op traits: the facts about an op type that passes, planners and backends ask about, each defined once.

`op_traits(op_type)` answers for any op type (an op Tessel does not know has
the defaults: a kernel, opaque, deterministic, no side effects); an op's schema
carries the same object as `OpSchema.traits`. Op types are unique across the
default and Tessel domains, so the op type alone decides.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import IntEnum


class Pattern(IntEnum):
    """TVM-style op patterns, ordered as TVM orders them: a fused group's pattern is the largest of its members'.

    ELEMWISE: output element i reads input element i. BROADCAST: the same, with
    broadcasting (a node's inputs decide between the two). INJECTIVE: each output
    element reads one input element (layout and indexing ops). REDUCTION: output
    elements combine many input elements (reductions, softmax, normalisations,
    pooling). OUT_EWISE_FUSABLE: compute-heavy ops whose elementwise consumers fuse
    into their epilogue (conv, matmul). OPAQUE: never fused.
    """

    ELEMWISE = 0
    BROADCAST = 1
    INJECTIVE = 2
    REDUCTION = 3
    OUT_EWISE_FUSABLE = 4
    OPAQUE = 8


_ELEMENTWISE = frozenset({
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BatchNormalization", "BitShift",
    "Ceil", "Celu", "Clip", "Cos", "Cosh", "Div", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater",
    "GreaterOrEqual", "HardSigmoid", "HardSwish", "IsInf", "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log",
    "Max", "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "Pow", "PRelu", "Reciprocal", "Relu",
    "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Sub", "Sum",
    "Tan", "Tanh", "ThresholdedRelu", "Where", "Xor", "Cast", "CastLike",
})
_INJECTIVE = frozenset({
    "Concat", "DepthToSpace", "Expand", "Flatten", "Gather", "GatherElements", "Identity", "Pad", "Reshape",
    "Resize", "Slice", "SpaceToDepth", "Squeeze", "Tile", "Transpose", "Trilu", "Unsqueeze",
})
_REDUCTION = frozenset({
    "ArgMax", "ArgMin", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "InstanceNormalization",
    "LayerNormalization", "LogSoftmax", "LRN", "MaxPool", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare",
    "Softmax",
})
_OUT_EWISE_FUSABLE = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
# Views that only give input 0 another shape: a chain of them is one Reshape.
_SHAPE_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
# Executed as zero-copy views of input 0 (kernels only inside a fused group, or for Dropout's mask).
_VIEWS = _SHAPE_VIEWS | {"Identity", "Dropout"}
# Control flow and failure markers: the runtime executes them itself, never as a kernel.
_NOT_KERNELS = frozenset({"If", "Unreachable", "AllReduce"})
# Ops that treat every sample (axis 0) on its own, so a batch can run in slices.
_PER_SAMPLE = frozenset({"Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "MatMul", "Gemm"})
# Ops whose result is not a function of their inputs: never folded or merged.
# AllReduce's result depends on the other workers' values.
_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
                               "Multinomial", "AllReduce"})
# Ops whose inputs can be given in any order.
_COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal", "BitwiseAnd",
                          "BitwiseOr", "BitwiseXor"})
# Input positions that hold a layer's parameters (weights, biases, normalisation scales and statistics): kernels
# pack or transform them at compile time when they are constants, so whatever computes them is folded.
_WEIGHT_INPUTS = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1,), "BatchNormalization": (1, 2, 3, 4),
    "InstanceNormalization": (1, 2), "LayerNormalization": (1, 2), "PRelu": (1,), "LSTM": (1, 2, 3),
    "GRU": (1, 2, 3), "RNN": (1, 2, 3),
}
# Ops that move a tensor between devices (passes/partition.py inserts them).
_TRANSFERS = frozenset({"Send", "Recv"})
# Ops that must run even when nothing reads their outputs, and must never be merged.
_SIDE_EFFECTS = _TRANSFERS | {"Unreachable"}


@dataclass(frozen=True)
class OpTraits:
    """What an op type is, independent of any one node."""

    pattern: Pattern = Pattern.OPAQUE  # ELEMWISE for elementwise ops: a node's shapes decide BROADCAST
    kernel: bool = True  # runs as a kernel (a view runs as one only when `view` says it must)
    view: bool = False  # a zero-copy view of input 0
    shape_view: bool = False  # a view that only reshapes input 0 (Reshape, Flatten, Squeeze, Unsqueeze)
    per_sample: bool = False  # each sample (axis 0) computed on its own: the batch can run in slices
    deterministic: bool = True  # equal inputs always give equal outputs
    commutative: bool = False  # the inputs can be given in any order
    side_effects: bool = False  # must run even when nothing reads its outputs; never merged
    transfer: bool = False  # moves a tensor between devices (Send, Recv)
    weight_inputs: frozenset[int] = frozenset()  # input positions holding the layer's parameters

    @property
    def elementwise(self) -> bool:
        """Output element i reads only element i of each (broadcast) input."""
        return self.pattern == Pattern.ELEMWISE

    @property
    def fusion_anchor(self) -> bool:
        """A conv, matmul or reduction: the op a fused group's elementwise epilogue is built around."""
        return self.pattern in (Pattern.REDUCTION, Pattern.OUT_EWISE_FUSABLE)


def _pattern(op_type: str) -> Pattern:
    if op_type in _ELEMENTWISE:
        return Pattern.ELEMWISE
    if op_type in _INJECTIVE:
        return Pattern.INJECTIVE
    if op_type in _REDUCTION:
        return Pattern.REDUCTION
    if op_type in _OUT_EWISE_FUSABLE:
        return Pattern.OUT_EWISE_FUSABLE
    return Pattern.OPAQUE


@functools.cache
def op_traits(op_type: str) -> OpTraits:
    """The traits of an op type."""
    return OpTraits(
        pattern=_pattern(op_type),
        kernel=op_type not in _NOT_KERNELS,
        view=op_type in _VIEWS,
        shape_view=op_type in _SHAPE_VIEWS,
        per_sample=op_type in _PER_SAMPLE,
        deterministic=op_type not in _NONDETERMINISTIC,
        commutative=op_type in _COMMUTATIVE,
        side_effects=op_type in _SIDE_EFFECTS,
        transfer=op_type in _TRANSFERS,
        weight_inputs=frozenset(_WEIGHT_INPUTS.get(op_type, ())),
    )
