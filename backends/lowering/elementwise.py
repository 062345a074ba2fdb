"""Elementwise and broadcasting ops.

Floating-point results follow IEEE 754 as ONNX does: a NaN operand of Max, Min,
Relu or Clip gives NaN (TVM's max and min keep the other operand, as LLVM's
maxnum does), and a product with a compile-time zero stays NaN for a NaN or
infinite factor (TVM's simplifier would fold `x * 0` to 0).
"""
from __future__ import annotations

import math
from functools import reduce

import numpy as np

from ..tvm_env import tvm
from .context import LowerContext

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx


def _is_float(dtype) -> bool:
    return str(dtype).startswith("float") or str(dtype) == "bfloat16"


def _exp(x):
    return topi.fast_exp(x) if str(x.dtype) == "float32" else topi.exp(x)


def _tanh(x):
    return topi.fast_tanh(x) if str(x.dtype) == "float32" else topi.tanh(x)


def _erf(x):
    return topi.fast_erf(x) if str(x.dtype) == "float32" else topi.erf(x)


def _const(value, dtype: str):
    return tir.const(value, dtype)


def _map(x, fn, name: str):
    return te.compute(x.shape, lambda *i: fn(x[tuple(i)]), name=name)


def _sigmoid(x):
    one = _const(1.0, x.dtype)
    return topi.divide(one, topi.add(one, _exp(topi.negative(x))))


def _isnan(x):
    """isnan elementwise; v != v for bfloat16, which TVM's isnan lacks."""
    return topi.not_equal(x, x) if str(x.dtype) == "bfloat16" else topi.isnan(x)


def _nan_max(a, b):
    """max(a, b) that is NaN when either is (broadcasting): a when a > b or a is NaN, else b."""
    if not _is_float(a.dtype):
        return topi.maximum(a, b)
    return topi.where(topi.logical_or(topi.greater(a, b), _isnan(a)), a, b)


def _nan_min(a, b):
    """min(a, b) that is NaN when either is (broadcasting)."""
    if not _is_float(a.dtype):
        return topi.minimum(a, b)
    return topi.where(topi.logical_or(topi.less(a, b), _isnan(a)), a, b)


def _at_least(x, bound):
    """max(x, bound) for a constant bound that is a number: a NaN x stays NaN (it fails the comparison)."""
    return _map(x, lambda v: tir.Select(v < bound, bound, v), "at_least")


def _at_most(x, bound):
    """min(x, bound) for a constant bound that is a number: a NaN x stays NaN."""
    return _map(x, lambda v: tir.Select(v > bound, bound, v), "at_most")


def _relu(x):
    return _at_least(x, _const(0, x.dtype))


def _unary(fn):
    return lambda ctx: [fn(ctx.input(0), ctx)]


UNARY = {
    "Relu": _unary(lambda x, c: _relu(x)),
    "Neg": _unary(lambda x, c: topi.negative(x)),
    "Abs": _unary(lambda x, c: topi.abs(x)),
    "Exp": _unary(lambda x, c: _exp(x)),
    "Log": _unary(lambda x, c: topi.log(x)),
    "Sqrt": _unary(lambda x, c: topi.sqrt(x)),
    "Tanh": _unary(lambda x, c: _tanh(x)),
    "Erf": _unary(lambda x, c: _erf(x)),
    "Sigmoid": _unary(lambda x, c: _sigmoid(x)),
    "Floor": _unary(lambda x, c: topi.floor(x)),
    "Ceil": _unary(lambda x, c: topi.ceil(x)),
    "Round": _unary(lambda x, c: _map(x, tir.nearbyint, "round")),
    "Sign": _unary(lambda x, c: topi.sign(x)),
    "Sin": _unary(lambda x, c: topi.sin(x)),
    "Cos": _unary(lambda x, c: topi.cos(x)),
    "Reciprocal": _unary(lambda x, c: topi.divide(_const(1.0, x.dtype), x)),
    "Not": _unary(lambda x, c: topi.logical_not(x)),
    "Softplus": _unary(lambda x, c: topi.log(topi.add(_exp(x), _const(1.0, x.dtype)))),
    "Softsign": _unary(lambda x, c: topi.divide(x, topi.add(topi.abs(x), _const(1.0, x.dtype)))),
    "LeakyRelu": _unary(lambda x, c: _map(x, lambda v: tir.Select(v < 0, v * _const(c.attr("alpha", 0.01), x.dtype), v), "leaky_relu")),
    "Elu": _unary(lambda x, c: topi.where(topi.less(x, _const(0, x.dtype)),
                                          topi.multiply(_const(c.attr("alpha", 1.0), x.dtype), topi.subtract(_exp(x), _const(1.0, x.dtype))), x)),
    "Selu": _unary(lambda x, c: topi.multiply(_const(c.attr("gamma"), x.dtype), topi.where(
        topi.less_equal(x, _const(0, x.dtype)),
        topi.multiply(_const(c.attr("alpha"), x.dtype), topi.subtract(_exp(x), _const(1.0, x.dtype))), x))),
    "HardSigmoid": _unary(lambda x, c: _hard_sigmoid(x, c.attr("alpha", 0.2), c.attr("beta", 0.5))),
    "HardSwish": _unary(lambda x, c: topi.multiply(x, _hard_sigmoid(x, 1.0 / 6.0, 0.5))),
    "Gelu": _unary(lambda x, c: _gelu(x, c.attr("approximate", "none"))),
    "IsNaN": _unary(lambda x, c: topi.isnan(x)),
    "Mish": _unary(lambda x, c: topi.multiply(x, _tanh(topi.log(topi.add(_exp(x), _const(1.0, x.dtype)))))),
    "Tan": _unary(lambda x, c: topi.tan(x)),
    "Asin": _unary(lambda x, c: topi.asin(x)),
    "Acos": _unary(lambda x, c: topi.acos(x)),
    "Atan": _unary(lambda x, c: topi.atan(x)),
    "Sinh": _unary(lambda x, c: topi.sinh(x)),
    "Cosh": _unary(lambda x, c: topi.cosh(x)),
    "Asinh": _unary(lambda x, c: topi.asinh(x)),
    "Acosh": _unary(lambda x, c: topi.acosh(x)),
    "Atanh": _unary(lambda x, c: topi.atanh(x)),
    "BitwiseNot": _unary(lambda x, c: topi.bitwise_not(x)),
    "IsInf": _unary(lambda x, c: _is_inf(x, c.attr("detect_positive", 1), c.attr("detect_negative", 1))),
    "ThresholdedRelu": _unary(lambda x, c: _map(
        x, lambda v: tir.Select(v > _const(c.attr("alpha", 1.0), x.dtype), v, _const(0, x.dtype)), "thresholded_relu")),
    "Shrink": _unary(lambda x, c: _shrink(x, c.attr("lambd", 0.5), c.attr("bias", 0.0))),
    "Celu": _unary(lambda x, c: _celu(x, c.attr("alpha", 1.0))),
}


def _is_inf(x, positive: int, negative: int):
    """IsInf, detecting +inf and/or -inf as the attributes say (integers are never infinite)."""
    def compute(v):
        if not _is_float(x.dtype):
            return tir.const(False, "bool")
        plus = v == _const(float("inf"), x.dtype)
        minus = v == _const(float("-inf"), x.dtype)
        if positive and negative:
            return tir.Or(plus, minus)
        return plus if positive else (minus if negative else tir.const(False, "bool"))

    return _map(x, compute, "is_inf")


def _shrink(x, lambd: float, bias: float):
    """x + bias below -lambd, x - bias above lambd, 0 between."""
    low, high = _const(-lambd, x.dtype), _const(lambd, x.dtype)
    shift = _const(bias, x.dtype)
    return _map(x, lambda v: tir.Select(v < low, v + shift, tir.Select(v > high, v - shift, _const(0, x.dtype))), "shrink")


def _celu(x, alpha: float):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    a, one, zero = _const(alpha, x.dtype), _const(1.0, x.dtype), _const(0.0, x.dtype)
    return _map(x, lambda v: tir.Select(v > zero, v, a * (tir.exp(v / a) - one)), "celu")


def _hard_sigmoid(x, alpha: float, beta: float):
    linear = topi.add(topi.multiply(x, _const(alpha, x.dtype)), _const(beta, x.dtype))
    return _at_least(_at_most(linear, _const(1.0, x.dtype)), _const(0.0, x.dtype))


def _gelu(x, approximate: str):
    half, one = _const(0.5, x.dtype), _const(1.0, x.dtype)
    if approximate == "tanh":
        cubic = topi.multiply(_const(0.044715, x.dtype), topi.multiply(x, topi.multiply(x, x)))
        inner = topi.multiply(_const(math.sqrt(2.0 / math.pi), x.dtype), topi.add(x, cubic))
        return topi.multiply(topi.multiply(half, x), topi.add(one, _tanh(inner)))
    scaled = topi.multiply(x, _const(1.0 / math.sqrt(2.0), x.dtype))
    return topi.multiply(topi.multiply(half, x), topi.add(one, _erf(scaled)))


def _div(ctx: LowerContext):
    a, b = ctx.input(0), ctx.input(1)
    if _is_float(a.dtype):
        return [topi.divide(a, b)]
    return [_broadcast(a, b, tir.truncdiv, ctx.out_shape(), "trunc_div")]


def _broadcast(a, b, fn, shape, name: str):
    """fn(a, b) elementwise with numpy broadcasting to `shape`, for TIR functions TOPI has no op for."""
    return te.compute(shape, lambda *i: fn(a[_bcast_index(a, i)], b[_bcast_index(b, i)]), name=name)


def _bcast_index(x, index):
    """The element of `x` that numpy broadcasting pairs with output position `index`."""
    rank = len(x.shape)
    tail = index[len(index) - rank:] if rank else ()
    return tuple(0 if int(d) == 1 else i for d, i in zip(x.shape, tail))


def _mod(ctx: LowerContext):
    a, b = ctx.input(0), ctx.input(1)
    if _is_float(a.dtype):
        return [_fmod(a, b)]
    return [_broadcast(a, b, tir.truncmod, ctx.out_shape(), "trunc_mod") if ctx.attr("fmod", 0) else topi.floor_mod(a, b)]


def _fmod(a, b):
    """C's fmod: a - b·trunc(a / b); a finite a over an infinite b is a itself (the product would be inf·0)."""
    remainder = topi.subtract(a, topi.multiply(b, topi.trunc(topi.divide(a, b))))
    keep = topi.logical_and(topi.isinf(b), topi.isfinite(a))
    return topi.where(keep, topi.broadcast_to(a, remainder.shape), remainder)


def _pow(ctx: LowerContext):
    a, b = ctx.input(0), ctx.input(1)
    if b.dtype != a.dtype:
        b = topi.cast(b, a.dtype)
    if not _is_float(a.dtype):
        return [topi.cast(topi.power(topi.cast(a, "float64"), topi.cast(b, "float64")), a.dtype)]
    exponent = ctx.data(1)
    if exponent is not None and exponent.size == 1 and float(exponent.reshape(-1)[0]) == 2.0:
        # x * x: exact for every x, where pow is a libm call per lane on CPUs and an approximation on GPUs.
        return [topi.broadcast_to(topi.multiply(a, a), ctx.out_shape())]
    return [topi.power(a, b)]


def _multiply(ctx: LowerContext):
    """a * b; a compile-time zero factor is written as IEEE's result (NaN for NaN or infinite x, else a zero
    with the product's sign), which TVM's simplifier cannot fold to 0."""
    a, b = ctx.input(0), ctx.input(1)
    if _is_float(a.dtype):
        for k, x in ((1, a), (0, b)):
            zero = ctx.data(k)
            if zero is not None and zero.size == 1 and float(zero.reshape(-1)[0]) == 0.0:
                negative = bool(np.signbit(zero.reshape(-1)[0]))
                return topi.broadcast_to(_times_zero(x, negative), ctx.out_shape())
    return topi.multiply(a, b)


def _times_zero(x, negative: bool):
    """x * 0 (x * -0 when `negative`), elementwise."""
    def compute(v):
        signed = -v if negative else v
        return tir.Select(tir.isfinite(v), tir.copysign(_const(0.0, x.dtype), signed), _const(float("nan"), x.dtype))

    return _map(x, compute, "times_zero")


def _binary(fn):
    return lambda ctx: [fn(ctx.input(0), ctx.input(1))]


BINARY = {
    "Add": _binary(topi.add),
    "Sub": _binary(topi.subtract),
    "Mul": lambda ctx: [_multiply(ctx)],
    "Div": _div,
    "Mod": _mod,
    "Pow": _pow,
    "Equal": _binary(topi.equal),
    "Greater": _binary(topi.greater),
    "GreaterOrEqual": _binary(topi.greater_equal),
    "Less": _binary(topi.less),
    "LessOrEqual": _binary(topi.less_equal),
    "And": _binary(topi.logical_and),
    "Or": _binary(topi.logical_or),
    "Xor": _binary(topi.logical_xor),
    "BitwiseAnd": _binary(topi.bitwise_and),
    "BitwiseOr": _binary(topi.bitwise_or),
    "BitwiseXor": _binary(topi.bitwise_xor),
    "BitShift": lambda ctx: [topi.left_shift(ctx.input(0), ctx.input(1)) if ctx.attr("direction") == "LEFT"
                             else topi.right_shift(ctx.input(0), ctx.input(1))],
    "PRelu": lambda ctx: [topi.where(topi.less(ctx.input(0), _const(0, ctx.input(0).dtype)),
                                     topi.multiply(ctx.input(0), ctx.input(1)), ctx.input(0))],
}


def _variadic(fn):
    """An n-ary op folded from a binary one; with one operand it is a copy."""
    def rule(ctx: LowerContext):
        xs = [x for x in ctx.inputs if x is not None]
        return [reduce(fn, xs) if len(xs) > 1 else topi.identity(xs[0])]

    return rule


def _mean(ctx: LowerContext):
    xs = [x for x in ctx.inputs if x is not None]
    return [topi.divide(reduce(topi.add, xs), _const(len(xs), xs[0].dtype))]


def _where(ctx: LowerContext):
    return [topi.where(ctx.input(0), ctx.input(1), ctx.input(2))]


def _largest_finite(dtype) -> float:
    if str(dtype) == "bfloat16":
        return 3.3895313892515355e38
    return float(np.finfo(str(dtype)).max)


def _clip(ctx: LowerContext):
    """ONNX's omitted bounds are the type's lowest and highest finite values (infinities clip to them)."""
    x = ctx.input(0)
    low, high = ctx.input(1), ctx.input(2)
    if low is not None:
        x = _nan_max(x, topi.reshape(low, ()) if len(low.shape) else low)
    elif _is_float(x.dtype):
        x = _at_least(x, _const(-_largest_finite(x.dtype), x.dtype))
    if high is not None:
        x = _nan_min(x, topi.reshape(high, ()) if len(high.shape) else high)
    elif _is_float(x.dtype):
        x = _at_most(x, _const(_largest_finite(x.dtype), x.dtype))
    return [x if x is not ctx.input(0) else topi.identity(x)]


def _cast(ctx: LowerContext):
    x, dtype = ctx.input(0), ctx.out_dtype()
    if dtype == "bool" and x.dtype != "bool":
        return [topi.not_equal(x, _const(0, x.dtype))]
    return [topi.cast(x, dtype)]


OTHER = {
    "Max": _variadic(_nan_max),
    "Min": _variadic(_nan_min),
    "Sum": _variadic(topi.add),
    "Mean": _mean,
    "Where": _where,
    "Clip": _clip,
    "Cast": _cast,
    "CastLike": _cast,
}

RULES = {**UNARY, **BINARY, **OTHER}
