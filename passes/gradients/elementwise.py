"""Gradient rules of elementwise ops: arithmetic (with broadcasting) and activations."""
from __future__ import annotations

import math

from tessel.ir.graph import Node, Value

from .builder import GradBuilder, Grads, Rule, is_float


def _add(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy = grads[0]
    return [b.unbroadcast(dy, x) if b.wants(i) else None for i, x in enumerate(node.inputs)]


def _sub(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy = grads[0]
    x, y = node.inputs
    return [b.unbroadcast(dy, x), b.unbroadcast(b.neg(dy), y) if b.wants(1) else None]


def _mul(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy = grads[0]
    x, y = node.inputs
    return [b.unbroadcast(b.mul(dy, y), x) if b.wants(0) else None,
            b.unbroadcast(b.mul(dy, x), y) if b.wants(1) else None]


def _div(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, out = grads[0], node.outputs[0]
    x, y = node.inputs
    # d(x/y)/dy = -x/y^2 = -out/y
    return [b.unbroadcast(b.div(dy, y), x) if b.wants(0) else None,
            b.unbroadcast(b.neg(b.div(b.mul(dy, out), y)), y) if b.wants(1) else None]


def _sum(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    return [b.unbroadcast(grads[0], x) if b.wants(i) else None for i, x in enumerate(node.inputs)]


def _mean(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    share = b.mul(grads[0], b.scalar(1.0 / len(node.inputs), grads[0]))
    return [b.unbroadcast(share, x) if b.wants(i) else None for i, x in enumerate(node.inputs)]


def _pow(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, out = grads[0], node.outputs[0]
    x, e = node.inputs
    dx = de = None
    if b.wants(0):
        exponent = b.cast(e, x.type.dtype)
        lowered = b.op("Pow", [x, b.sub(exponent, b.scalar(1.0, exponent))])
        dx = b.unbroadcast(b.mul(dy, b.mul(exponent, lowered)), x)
    if b.wants(1) and is_float(e):
        de = b.unbroadcast(b.mul(dy, b.mul(out, b.cast(b.op("Log", [x]), out.type.dtype))), e)
    return [dx, de]


def _unary(derivative):
    """A rule for y = f(x): dx = dy * derivative(b, x, y)."""
    def build(b: GradBuilder, node: Node, grads: Grads) -> Grads:
        x, y = node.inputs[0], node.outputs[0]
        return [b.mul(grads[0], derivative(b, node, x, y))] + [None] * (len(node.inputs) - 1)
    return build


def _gate(condition_of, otherwise=None):
    """A rule for piecewise ops: dx = dy where condition_of(b, node, x, y) holds, else otherwise(...) (or 0)."""
    def build(b: GradBuilder, node: Node, grads: Grads) -> Grads:
        dy, x, y = grads[0], node.inputs[0], node.outputs[0]
        other = otherwise(b, node, dy, x, y) if otherwise is not None else b.scalar(0.0, dy)
        return [b.where(condition_of(b, node, x, y), dy, other)] + [None] * (len(node.inputs) - 1)
    return build


def _positive(b: GradBuilder, node: Node, x: Value, y: Value) -> Value:
    return b.op("Greater", [x, b.scalar(0.0, x)])


def _positive_output(b: GradBuilder, node: Node, x: Value, y: Value) -> Value:
    # relu(x) > 0 exactly where x > 0: reading the output, which the next layer keeps for its own backward
    # anyway, lets the input die in forward (after a BatchNormalization, a whole activation).
    return b.op("Greater", [y, b.scalar(0.0, y)])


def _sigmoid_derivative(b, node, x, y):
    return b.mul(y, b.sub(b.scalar(1.0, y), y))


def _tanh_derivative(b, node, x, y):
    return b.sub(b.scalar(1.0, y), b.mul(y, y))


def _erf_derivative(b, node, x, y):
    return b.mul(b.scalar(2.0 / math.sqrt(math.pi), x), b.op("Exp", [b.neg(b.mul(x, x))]))


def _gelu_derivative(b, node, x, y):
    half, one = b.scalar(0.5, x), b.scalar(1.0, x)
    if node.attrs.get("approximate", "none") == "tanh":
        # y = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
        c = math.sqrt(2.0 / math.pi)
        x2 = b.mul(x, x)
        u = b.mul(b.scalar(c, x), b.add(x, b.mul(b.scalar(0.044715, x), b.mul(x2, x))))
        t = b.op("Tanh", [u])
        du = b.mul(b.scalar(c, x), b.add(one, b.mul(b.scalar(3 * 0.044715, x), x2)))
        left = b.mul(half, b.add(one, t))
        right = b.mul(b.mul(half, x), b.mul(b.sub(one, b.mul(t, t)), du))
        return b.add(left, right)
    # y = x Phi(x): Phi(x) + x phi(x) = (1 + erf(u)) / 2 + u exp(-u^2) / sqrt(pi) with u = x / sqrt(2). Every
    # node but the first reads u, not x, so fusion makes the whole derivative one kernel (reading x twice would
    # start a second group, and the first group's result would be an extra activation-sized buffer).
    u = b.mul(x, b.scalar(1.0 / math.sqrt(2.0), x))
    cdf = b.mul(half, b.add(one, b.op("Erf", [u])))
    density = b.mul(b.mul(u, b.op("Exp", [b.neg(b.mul(u, u))])), b.scalar(1.0 / math.sqrt(math.pi), x))
    return b.add(cdf, density)


def _softplus_derivative(b, node, x, y):
    return b.op("Sigmoid", [x])


def _mish_derivative(b, node, x, y):
    t = b.op("Tanh", [b.op("Softplus", [x])])
    sech2 = b.sub(b.scalar(1.0, x), b.mul(t, t))
    return b.add(t, b.mul(x, b.mul(sech2, b.op("Sigmoid", [x]))))


def _softsign_derivative(b, node, x, y):
    denominator = b.add(b.scalar(1.0, x), b.op("Abs", [x]))
    return b.op("Reciprocal", [b.mul(denominator, denominator)])


def _leaky_otherwise(b, node, dy, x, y):
    return b.mul(dy, b.scalar(node.attrs.get("alpha", 0.01), dy))


def _elu_otherwise(b, node, dy, x, y):
    # x <= 0: y = alpha (e^x - 1), dy/dx = e^x alpha = y + alpha
    return b.mul(dy, b.add(y, b.scalar(node.attrs.get("alpha", 1.0), y)))


def _selu(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x, y = grads[0], node.inputs[0], node.outputs[0]
    alpha, gamma = node.attrs.get("alpha", 1.67326319217681884765625), node.attrs.get("gamma", 1.05070102214813232421875)
    positive = b.mul(dy, b.scalar(gamma, dy))
    negative = b.mul(dy, b.add(y, b.scalar(gamma * alpha, y)))
    return [b.where(_positive(b, node, x, y), positive, negative)]


def _hard_sigmoid(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x = grads[0], node.inputs[0]
    alpha, beta = node.attrs.get("alpha", 0.2), node.attrs.get("beta", 0.5)
    t = b.add(b.mul(x, b.scalar(alpha, x)), b.scalar(beta, x))
    inside = b.op("And", [b.op("Greater", [t, b.scalar(0.0, t)]), b.op("Less", [t, b.scalar(1.0, t)])])
    return [b.where(inside, b.mul(dy, b.scalar(alpha, dy)), b.scalar(0.0, dy))]


def _hard_swish(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # y = x * clip(x/6 + 1/2, 0, 1): 0 below -3, x/3 + 1/2 on [-3, 3], 1 above (PyTorch's hardswish_backward)
    dy, x = grads[0], node.inputs[0]
    middle = b.mul(dy, b.add(b.div(x, b.scalar(3.0, x)), b.scalar(0.5, x)))
    upper = b.where(b.op("LessOrEqual", [x, b.scalar(3.0, x)]), middle, dy)
    return [b.where(b.op("Less", [x, b.scalar(-3.0, x)]), b.scalar(0.0, dy), upper)]


def _prelu(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, (x, slope) = grads[0], node.inputs
    positive = _positive(b, node, x, None)
    dx = b.where(positive, dy, b.mul(dy, slope)) if b.wants(0) else None
    dslope = b.unbroadcast(b.where(positive, b.scalar(0.0, dy), b.mul(dy, x)), slope) if b.wants(1) else None
    return [dx, dslope]


def _clip(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # PyTorch's clamp: the gradient passes where min <= x <= max (bounds included)
    dy, x = grads[0], node.inputs[0]
    low = node.inputs[1] if len(node.inputs) > 1 else None
    high = node.inputs[2] if len(node.inputs) > 2 else None
    inside = None
    for bound, compare in ((low, "GreaterOrEqual"), (high, "LessOrEqual")):
        if bound is not None:
            test = b.op(compare, [x, bound])
            inside = test if inside is None else b.op("And", [inside, test])
    dx = dy if inside is None else b.where(inside, dy, b.scalar(0.0, dy))
    return [dx] + [None] * (len(node.inputs) - 1)


def _where(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, (condition, x, y) = grads[0], node.inputs
    zero = b.scalar(0.0, dy)
    return [None,
            b.unbroadcast(b.where(condition, dy, zero), x) if b.wants(1) else None,
            b.unbroadcast(b.where(condition, zero, dy), y) if b.wants(2) else None]


def _extremum(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    """Max / Min of n inputs: the gradient is shared evenly among the inputs equal to the result (PyTorch's
    maximum/minimum halves it on a tie)."""
    dy, y = grads[0], node.outputs[0]
    hits = [b.op("Equal", [x, y]) for x in node.inputs]
    count = None
    for hit in hits:
        one = b.cast(hit, dy.type.dtype)
        count = one if count is None else b.add(count, one)
    share = b.div(dy, count)
    zero = b.scalar(0.0, dy)
    return [b.unbroadcast(b.where(hit, share, zero), x) if b.wants(i) else None
            for i, (hit, x) in enumerate(zip(hits, node.inputs))]


def _cast(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    x = node.inputs[0]
    return [b.cast(grads[0], x.type.dtype) if is_float(x) else None]


RULES: dict[str, Rule] = {
    "Add": Rule(_add),
    "Sub": Rule(_sub),
    "Mul": Rule(_mul),
    "Div": Rule(_div),
    "Sum": Rule(_sum),
    "Mean": Rule(_mean),
    "Pow": Rule(_pow),
    "Neg": Rule(lambda b, node, grads: [b.neg(grads[0])]),
    "Identity": Rule(lambda b, node, grads: [grads[0]]),
    "Cast": Rule(_cast),
    "Sqrt": Rule(_unary(lambda b, node, x, y: b.div(b.scalar(0.5, y), y))),
    "Exp": Rule(_unary(lambda b, node, x, y: y)),
    "Log": Rule(_unary(lambda b, node, x, y: b.op("Reciprocal", [x]))),
    "Abs": Rule(_unary(lambda b, node, x, y: b.op("Sign", [x]))),
    "Reciprocal": Rule(_unary(lambda b, node, x, y: b.neg(b.mul(y, y)))),
    "Sigmoid": Rule(_unary(_sigmoid_derivative)),
    "Tanh": Rule(_unary(_tanh_derivative)),
    "Erf": Rule(_unary(_erf_derivative)),
    "Gelu": Rule(_unary(_gelu_derivative)),
    "Softplus": Rule(_unary(_softplus_derivative)),
    "Mish": Rule(_unary(_mish_derivative)),
    "Softsign": Rule(_unary(_softsign_derivative)),
    "Relu": Rule(_gate(_positive_output)),
    "LeakyRelu": Rule(_gate(_positive, _leaky_otherwise)),
    "Elu": Rule(_gate(_positive, _elu_otherwise)),
    "Selu": Rule(_selu),
    "HardSigmoid": Rule(_hard_sigmoid),
    "HardSwish": Rule(_hard_swish),
    "PRelu": Rule(_prelu),
    "Clip": Rule(_clip),
    "Where": Rule(_where),
    "Max": Rule(_extremum),
    "Min": Rule(_extremum),
}
