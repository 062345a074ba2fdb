"""float16 ops that sum many terms compute in float32 and round once, as ONNX's reference and onnxruntime do.

A float16 accumulator loses a bit or two per dozen terms (MatMul, Conv, softmax denominators), so results drift one
or two float16 ulps from every other runtime. The widened op reads its float16 inputs as float32; its float32
results are rounded to the node's float16 output type where the kernel stores them.
"""
from __future__ import annotations

from dataclasses import replace

from tessel.ir.types import TensorType

from .context import LowerContext

HALF = "float16"
WIDE = "float32"

# Ops whose outputs are sums (or normalizations by sums) of many float16 products. Softmax is not here: the
# reference rounds its exponentials to float16 before summing them (reduce.py sums those in float32).
ACCUMULATING_OPS = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum",
    "ReduceSum", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp",
    "LogSoftmax", "LpNormalization",
    "Sum", "Mean", "LayerNormalization", "InstanceNormalization", "GroupNormalization", "RMSNormalization",
    "AveragePool", "GlobalAveragePool", "LpPool", "GlobalLpPool", "LRN",
})


def _widened_type(t: TensorType | None) -> TensorType | None:
    return TensorType(WIDE, t.shape) if t is not None and t.dtype == HALF else t


def widen_half_accumulation(ctx: LowerContext, topi) -> LowerContext:
    """`ctx` with float16 inputs cast to float32 and float16 outputs typed float32 when the op accumulates;
    else `ctx` unchanged. The caller casts each result to the node's own output type."""
    if ctx.op_type not in ACCUMULATING_OPS or not any(t is not None and t.dtype == HALF for t in ctx.input_types):
        return ctx
    inputs = [topi.cast(x, WIDE) if x is not None and t is not None and t.dtype == HALF else x
              for x, t in zip(ctx.inputs, ctx.input_types)]
    const_data = [d.astype(WIDE) if d is not None and str(d.dtype) == HALF else d for d in ctx.const_data]
    return replace(ctx, inputs=inputs, input_types=[_widened_type(t) for t in ctx.input_types],
                   const_data=const_data, output_types=[_widened_type(t) for t in ctx.output_types])
