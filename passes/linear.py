"""MatMul by a constant matrix followed by a bias Add becomes one Gemm (a linear layer).

Leading dimensions of the left operand are flattened by a Reshape before the
Gemm and restored after it; both Reshapes are views, free at run time.
"""
from __future__ import annotations

import numpy as np

from tessel.ir.graph import Node

from .base import add_op, retire, single_user


def matmul_add_to_gemm(node: Node) -> str | None:
    """Rewrite Add(MatMul(A, W), bias) with constant W (K, N) and a constant bias of N elements."""
    if node.op_type != "Add":
        return None
    for index in (0, 1):
        product, bias = node.inputs[index], node.inputs[1 - index]
        matmul = product.producer
        if matmul is None or matmul.op_type != "MatMul" or matmul.graph is not node.graph:
            continue
        if single_user(product) is not node or product is bias:
            continue
        a, w = matmul.inputs
        if not w.is_constant or w.type.rank != 2 or a.type.rank < 2 or not bias.is_constant:
            continue
        n = w.type.shape[1]
        if bias.type.numel != n or (bias.type.rank and bias.type.shape[-1] != n):
            continue
        if node.outputs[0].type != product.type or a.type.dtype not in ("float32", "float64"):
            continue
        return _rewrite(node, matmul, a, w, bias)
    return None


def _rewrite(add: Node, matmul: Node, a, w, bias) -> str:
    g = add.graph
    k = a.type.shape[-1]
    flat_a = a
    if a.type.rank != 2:
        shape = g.add_constant(f"{matmul.name}_rows", np.asarray([-1, k], np.int64))
        flat_a = add_op(g, "Reshape", [a, shape], name=f"{matmul.name}_flatten", before=add).outputs[0]
    c = g.add_constant(f"{bias.name}_row", bias.const.reshape(-1))
    gemm = add_op(g, "Gemm", [flat_a, w, c], name=matmul.name, before=add)
    result = gemm.outputs[0]
    if a.type.rank != 2:
        shape = g.add_constant(f"{matmul.name}_shape", np.asarray(add.outputs[0].type.shape, np.int64))
        result = add_op(g, "Reshape", [result, shape], name=f"{matmul.name}_unflatten", before=add).outputs[0]
    retire(add, {0: result})
    return "matmul_add_to_gemm"
