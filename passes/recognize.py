"""Recognize exporter-decomposed GELU and LayerNorm and replace them by single ops.

GELU: 0.5·x·(1 + erf(x/√2)) and 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), in
any association of the final products. LayerNorm: (x - mean(x)) / sqrt(mean((x -
mean(x))²) + eps), optionally times gamma plus beta, over trailing axes.
Intermediate values must have no other readers (they disappear).
"""
from __future__ import annotations

import math

import numpy as np

from tessel.ir.graph import Node, Value

from .base import add_op, constant_scalar, retire, single_user

TOLERANCE = 1e-4


def _is_const(value: Value | None, target: float) -> bool:
    scalar = constant_scalar(value)
    return scalar is not None and abs(scalar - target) <= TOLERANCE * max(1.0, abs(target))


def _node(value: Value | None, op_type: str) -> Node | None:
    if value is None or value.producer is None or value.producer.op_type != op_type:
        return None
    return value.producer


def _other(node: Node, value: Value) -> Value | None:
    """The other operand of a binary node that reads `value` once."""
    a, b = node.inputs[0], node.inputs[1]
    if a is value and b is not value:
        return b
    if b is value and a is not value:
        return a
    return None


def _user(value: Value, op_type: str) -> Node | None:
    user = single_user(value)
    return user if user is not None and user.op_type == op_type else None


def _half_x_times(t: Value, x: Value) -> Node | None:
    """The Mul node computing 0.5 · x · t (any association), or None."""
    m = _user(t, "Mul")
    if m is None:
        return None
    factor = _other(m, t)
    if factor is x:  # (x · t) · 0.5
        last = _user(m.outputs[0], "Mul")
        return last if last is not None and _is_const(_other(last, m.outputs[0]), 0.5) else None
    if _is_const(factor, 0.5):  # (t · 0.5) · x
        last = _user(m.outputs[0], "Mul")
        return last if last is not None and _other(last, m.outputs[0]) is x else None
    half = _node(factor, "Mul")  # (x · 0.5) · t
    if half is not None and ((half.inputs[0] is x and _is_const(half.inputs[1], 0.5)) or
                             (half.inputs[1] is x and _is_const(half.inputs[0], 0.5))):
        return m
    return None


def _plus_one(value: Value) -> Value | None:
    add = _user(value, "Add")
    return add.outputs[0] if add is not None and _is_const(_other(add, value), 1.0) else None


def _erf_argument(erf: Node) -> Value | None:
    """x when the Erf reads x / √2 (or x · 1/√2)."""
    scaled = erf.inputs[0]
    if single_user(scaled) is not erf or scaled.producer is None:
        return None
    op = scaled.producer
    if op.op_type == "Div" and _is_const(op.inputs[1], math.sqrt(2.0)):
        return op.inputs[0]
    if op.op_type == "Mul":
        for k in (0, 1):
            if _is_const(op.inputs[1 - k], 1 / math.sqrt(2.0)):
                return op.inputs[k]
    return None


def _is_cube(value: Value, x: Value) -> bool:
    power = _node(value, "Pow")
    if power is not None:
        return power.inputs[0] is x and _is_const(power.inputs[1], 3.0)
    outer = _node(value, "Mul")
    if outer is None:
        return False
    inner = next((v for v in outer.inputs if v is not x), None)
    square = _node(inner, "Mul")
    return square is not None and x in outer.inputs and square.inputs[0] is x and square.inputs[1] is x


def _tanh_argument(tanh: Node) -> Value | None:
    """x when the Tanh reads √(2/π) · (x + 0.044715 · x³)."""
    scaled = _node(tanh.inputs[0], "Mul")
    if scaled is None:
        return None
    for k in (0, 1):
        inner, factor = scaled.inputs[k], scaled.inputs[1 - k]
        total = _node(inner, "Add")
        if total is None or not _is_const(factor, math.sqrt(2.0 / math.pi)):
            continue
        for j in (0, 1):
            x, cubic = total.inputs[j], total.inputs[1 - j]
            term = _node(cubic, "Mul")
            if term is None:
                continue
            for i in (0, 1):
                if _is_const(term.inputs[1 - i], 0.044715) and _is_cube(term.inputs[i], x):
                    return x
    return None


def recognize_gelu(node: Node) -> str | None:
    """Replace a decomposed GELU that starts at this Erf or Tanh node by one Gelu op."""
    if node.op_type == "Erf":
        x, approximate = _erf_argument(node), "none"
    elif node.op_type == "Tanh":
        x, approximate = _tanh_argument(node), "tanh"
    else:
        return None
    if x is None:
        return None
    t = _plus_one(node.outputs[0])
    last = _half_x_times(t, x) if t is not None else None
    if last is None or last.outputs[0].type != x.type:
        return None
    gelu = add_op(node.graph, "Gelu", [x], {"approximate": approximate}, name=f"{last.name}_gelu", before=last)
    retire(last, {0: gelu.outputs[0]})
    return f"gelu_{approximate}_recognized"


def _trailing_axes(reduce: Node) -> tuple[int, ...] | None:
    """The reduced axes when they are the last ones (keepdims set), else None."""
    rank = reduce.inputs[0].type.rank
    axes_value = reduce.inputs[1] if len(reduce.inputs) > 1 else None
    if axes_value is None or not axes_value.is_constant or not reduce.attrs.get("keepdims", 1):
        return None
    axes = sorted(int(a) % rank for a in axes_value.const.reshape(-1))
    return tuple(axes) if axes and axes == list(range(rank - len(axes), rank)) else None


def _squared(value: Value) -> Node | None:
    """The node computing value², read only by that node."""
    for user, _ in value.uses:
        if user.op_type == "Pow" and user.inputs[0] is value and _is_const(user.inputs[1], 2.0):
            return user
        if user.op_type == "Mul" and user.inputs[0] is value and user.inputs[1] is value:
            return user
    return None


def recognize_layer_norm(node: Node) -> str | None:
    """Replace a decomposed LayerNorm that starts at this ReduceMean by one LayerNormalization."""
    if node.op_type != "ReduceMean":
        return None
    axes = _trailing_axes(node)
    x = node.inputs[0]
    centered_node = _user(node.outputs[0], "Sub")
    if axes is None or centered_node is None or centered_node.inputs[0] is not x or x.type.dtype != "float32":
        return None
    centered = centered_node.outputs[0]
    if len(centered.uses) != 2 or centered.is_graph_output:
        return None
    square = _squared(centered)
    divide = next((u for u, i in centered.uses if u.op_type == "Div" and i == 0), None)
    if square is None or divide is None:
        return None
    variance = _user(square.outputs[0], "ReduceMean")
    if variance is None or _trailing_axes(variance) != axes:
        return None
    shifted = _user(variance.outputs[0], "Add")
    epsilon = constant_scalar(_other(shifted, variance.outputs[0])) if shifted is not None else None
    root = _user(shifted.outputs[0], "Sqrt") if epsilon is not None else None
    if root is None or single_user(root.outputs[0]) is not divide or divide.inputs[1] is not root.outputs[0]:
        return None
    normalized_shape = x.type.shape[axes[0]:]
    last, gamma, beta = divide, None, None
    scale = _user(divide.outputs[0], "Mul")
    if scale is not None and _matches(_other(scale, divide.outputs[0]), normalized_shape):
        last, gamma = scale, _other(scale, divide.outputs[0])
        shift = _user(scale.outputs[0], "Add")
        if shift is not None and _matches(_other(shift, scale.outputs[0]), normalized_shape):
            last, beta = shift, _other(shift, scale.outputs[0])
    if last.outputs[0].type != x.type:
        return None
    g = node.graph
    gamma_value = g.add_constant(f"{last.name}_gamma", _as_shape(gamma.const if gamma is not None else np.ones(1, np.float32), normalized_shape))
    inputs = [x, gamma_value]
    if beta is not None:
        inputs.append(g.add_constant(f"{last.name}_beta", _as_shape(beta.const, normalized_shape)))
    norm = add_op(g, "LayerNormalization", inputs, {"axis": axes[0], "epsilon": epsilon},
                  name=f"{last.name}_layernorm", before=last)
    retire(last, {0: norm.outputs[0]})
    return "layer_norm_recognized"


def _matches(value: Value | None, shape: tuple[int, ...]) -> bool:
    """A float32 constant that broadcasts along the normalized axes only."""
    if value is None or not value.is_constant or value.type.dtype != "float32":
        return False
    dims = value.type.shape
    if len(dims) > len(shape):
        if any(d != 1 for d in dims[: len(dims) - len(shape)]):
            return False
        dims = dims[len(dims) - len(shape):]
    padded = (1,) * (len(shape) - len(dims)) + tuple(dims)
    return all(d in (1, s) for d, s in zip(padded, shape))


def _as_shape(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    squeezed = array.reshape(array.shape[max(0, array.ndim - len(shape)):]) if array.ndim > len(shape) else array
    return np.ascontiguousarray(np.broadcast_to(squeezed, shape)).astype(np.float32)
