"""A one-hot row times a constant weight is a row of the weight: Gemm/MatMul(one_hot(x), W) becomes Gather(W, x).

An embedding exported as arithmetic (magika's byte embedding: `Equal(bytes, range(257))`, cast to float, times
a [257, 64] weight) multiplies a [2048, 257] matrix of zeros and ones by the weight: 67 MFLOP, and the one-hot
matrix is built element by element inside the product. Each row of the product is the weight's row at the row's
index, or zeros when the index is outside [0, K) (a one-hot row of all zeros), so a Gather of the weight with a zero
row appended (index K) computes it, reading 2048 rows of 64 floats.

The pattern, after constant folding:
  one_hot = Cast<float>(Equal(x, r))      x integer, its last axis 1; r a constant arange(K) along its last axis
  a = Reshape*(one_hot)                   any reshapes keeping the last axis K (rows flattened)
  y = Gemm(a, W, C) or MatMul(a, W)       W a constant [K, N]; Gemm without transposes
becomes
  idx = Where(0 <= x < K, x, K) reshaped to one axis (-1: any batch)
  y = Gather(alpha · [W; 0], idx) (+ beta · C)
The Equal, its Cast and the reshapes between must have no other reader (the product's own input may have others);
x must be int32 or int64, the index types Gather takes.
"""
from __future__ import annotations

import numpy as np

from tessel.ir.graph import Graph, Node, Value

from .base import Pass, PassResult, add_op, graphs_in, retire, single_user

# The index types Gather takes (ONNX's Tind): a one-hot of narrower integers is left as it is.
INDEX_TYPES = frozenset({"int32", "int64"})


def one_hot_gather(graph: Graph) -> PassResult:
    """Replace every one-hot-times-constant-weight product (module docstring) with a Gather of the weight."""
    rewritten = 0
    for g in graphs_in(graph):
        for node in list(g.nodes):
            if node.graph is not g:
                continue  # retired along with an earlier match
            match = _match(node)
            if match is not None:
                _rewrite(g, node, *match)
                rewritten += 1
    return PassResult(graph, rewritten > 0, {"one_hot_products": rewritten})


def _match(product: Node) -> tuple[Value, int] | None:
    """(x, K) when `product` multiplies a one-hot of x over K classes by a constant weight; else None."""
    if product.domain or product.op_type not in ("Gemm", "MatMul"):
        return None
    if product.op_type == "Gemm" and (product.attrs["transA"] or product.attrs["transB"]):
        return None
    a, weight = product.inputs[0], product.inputs[1]
    if not weight.is_constant or weight.type.rank != 2 or weight.type.dtype != "float32" or a.type.rank != 2:
        return None
    classes = weight.type.shape[0]
    # Back through reshapes that keep the classes axis, to the Cast.
    value = a
    while value.producer is not None and value.producer.op_type == "Reshape" and not value.producer.domain:
        source = value.producer.inputs[0]
        if single_user(source) is not value.producer or source.type.shape[-1:] != (classes,):
            return None
        value = source
    cast = value.producer
    if cast is None or cast.op_type != "Cast" or cast.domain or value.type.dtype != "float32":
        return None
    equal = cast.inputs[0].producer
    if equal is None or equal.op_type != "Equal" or equal.domain or single_user(cast.inputs[0]) is not cast:
        return None
    for x, r in (equal.inputs, reversed(equal.inputs)):
        if _is_range(r, classes) and not x.is_constant and x.type.dtype in INDEX_TYPES and x.type.shape[-1:] == (1,):
            return x, classes
    return None


def _is_range(value: Value, classes: int) -> bool:
    """Whether `value` is a constant 0, 1, ..., classes - 1 along its last axis, every other axis of size 1."""
    if not value.is_constant or value.type.rank < 1 or any(d != 1 for d in value.type.shape[:-1]):
        return False
    return value.type.shape[-1] == classes and np.array_equal(value.const.reshape(-1), np.arange(classes))


def _rewrite(graph: Graph, product: Node, x: Value, classes: int) -> None:
    """The Gather (and bias) replacing `product`, placed before it."""
    prefix = f"{product.name}/gather"

    def op(op_type, inputs, attrs=None, suffix=""):
        return add_op(graph, op_type, inputs, attrs, before=product,
                      name=graph.unique_node_name(f"{prefix}{suffix}")).outputs[0]

    def constant(suffix, array):
        return graph.add_constant(graph.unique_name(f"{prefix}/{suffix}"), array)

    alpha = product.attrs["alpha"] if product.op_type == "Gemm" else 1.0
    weight = product.inputs[1].const.astype(np.float32) * np.float32(alpha)
    rows = constant("rows", np.concatenate([weight, np.zeros((1, weight.shape[1]), np.float32)]))
    flat = op("Reshape", [x, constant("flat", np.array([-1], np.int64))], suffix="/flat")
    low = constant("zero", np.zeros((), x.type.dtype))
    high = constant("classes", np.array(classes, x.type.dtype))
    inside = op("And", [op("GreaterOrEqual", [flat, low], suffix="/low"), op("Less", [flat, high], suffix="/high")],
                suffix="/inside")
    index = op("Where", [inside, flat, high], suffix="/index")
    result = op("Gather", [rows, index], {"axis": 0})
    bias = product.inputs[2] if product.op_type == "Gemm" and len(product.inputs) > 2 else None
    if bias is not None:
        beta = product.attrs["beta"]
        if beta != 1.0:
            bias = op("Mul", [bias, constant("beta", np.array(beta, np.float32))], suffix="/beta")
        result = op("Add", [result, bias], suffix="/bias")
    retire(product, {0: result})


ONE_HOT_GATHER = Pass("one_hot_gather", one_hot_gather)
