"""Gradient rules of neural-network ops: softmax family, MatMul and Gemm."""
from __future__ import annotations

from tessel.ir.graph import Node, Value

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
            # A weight matrix shared by a batch: one matrix product over the flattened batch rows.
            k, m = w2.type.shape
            rows = b.reshape(x2, (-1, k)) if x2.type.rank > 2 else x2
            drows = b.reshape(dy2, (-1, m)) if dy2.type.rank > 2 else dy2
            dw2 = b.op("MatMul", [b.transpose(rows, [1, 0]), drows])
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


RULES: dict[str, Rule] = {
    "Softmax": Rule(_softmax),
    "LogSoftmax": Rule(_log_softmax),
    "MatMul": Rule(_matmul),
    "Gemm": Rule(_gemm),
}
