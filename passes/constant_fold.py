"""Constant folding: compute nodes whose inputs are all constants; a layer's weights whatever their size.

Import already folds shape arithmetic (small tensors); this pass also folds
larger weight transformations (a transposed or rescaled weight, a folded
BatchNorm's arithmetic) and whatever earlier passes made constant. Values are
computed by ONNX's reference implementation, so they follow the specification.

Other tensors are folded up to a size cap (it keeps artifacts small: a large
constant made from a small one is computed at load instead). A tensor that
feeds a weight operand (`OpTraits.weight_inputs`: a conv's or matmul's weight,
a bias, a normalisation's parameters), directly or through other foldable
nodes, is folded whatever its size: a conv or matmul packs its weights at
compile time for its fast kernel, and a weight computed at load (a float16
weight Cast to float32, a ConstantOfShape, a Transpose) would leave it the
generic one. The artifact then holds the weight as a plain initializer would.
"""
from __future__ import annotations

import functools

import numpy as np

from tessel.ir.evaluate import evaluate
from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import op_traits
from tessel.ir.schema import get_schema
from tessel.ir.types import numpy_dtype

from .base import Pass, PassResult, graphs_in, is_pure, retire

DEFAULT_LIMIT_BYTES = 1 << 20


def _evaluable(node: Node) -> bool:
    """A pure, deterministic op of the default domain: its outputs can be computed at compile time from its inputs."""
    if not is_pure(node) or node.domain:
        return False
    schema = get_schema(node.op_type, node.domain)
    return schema is not None and schema.traits.deterministic


def _on_constants(node: Node) -> bool:
    present = [v for v in node.inputs if v is not None]
    return bool(present) and all(v.is_constant for v in present)


def _computable(node: Node, memo: dict[int, bool]) -> bool:
    """Whether `node`'s outputs follow from constants alone: an evaluable node on constants or on such outputs."""
    if id(node) not in memo:
        memo[id(node)] = False  # a cycle (none in a valid graph) is not computable
        memo[id(node)] = _evaluable(node) and any(v is not None for v in node.inputs) and all(
            v.is_constant or (v.producer is not None and _computable(v.producer, memo))
            for v in node.inputs if v is not None)
    return memo[id(node)]


def feeds_weight(value: Value, memo: dict[int, bool] | None = None) -> bool:
    """Whether `value` is a weight operand of some node, or is folded into one by nodes computable at compile time."""
    memo = {} if memo is None else memo
    for user, index in value.uses:
        if index in op_traits(user.op_type).weight_inputs:
            return True
        if _computable(user, memo) and any(out is not None and feeds_weight(out, memo) for out in user.outputs):
            return True
    return False


def fold_node(node: Node) -> int | None:
    """Replace `node` (on constants) by constants holding its outputs; the bytes they hold, or None when the
    reference evaluator cannot compute it (the node then stays)."""
    schema = get_schema(node.op_type, node.domain)
    try:
        arrays = evaluate(schema, node.attrs, [v.const if v is not None else None for v in node.inputs], len(node.outputs))
    except Exception:  # the reference evaluator lacks a few cases; the node then runs at run time
        return None
    graph = node.graph
    replacements = {}
    folded_bytes = 0
    for index, (out, array) in enumerate(zip(node.outputs, arrays)):
        if out is None:
            continue
        array = np.asarray(array).astype(numpy_dtype(out.type.dtype), copy=False).reshape(out.type.shape)
        replacements[index] = graph.add_constant(f"{out.name}_folded", array)
        folded_bytes += array.nbytes
    retire(node, replacements)
    return folded_bytes


def _foldable(node: Node, limit_bytes: int) -> bool:
    if not _evaluable(node) or not _on_constants(node):
        return False
    outputs = [out for out in node.outputs if out is not None]
    return all(out.type.nbytes <= limit_bytes for out in outputs) or any(feeds_weight(out) for out in outputs)


def fold_weight(node: Node) -> str | None:
    """Simplify's rewrite: fold a node on constants that computes a weight operand, whatever its size, so that
    rewrites needing constant weights (BatchNorm folding) see it."""
    if not _evaluable(node) or not _on_constants(node):
        return None
    if not any(out is not None and feeds_weight(out) for out in node.outputs):
        return None
    return "weight_folded" if fold_node(node) is not None else None


def constant_fold(graph: Graph, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> PassResult:
    """Replace each node whose inputs are all constants by its computed outputs (each at most `limit_bytes`,
    unless it feeds a weight operand)."""
    folded = skipped = 0
    folded_bytes = 0
    for g in graphs_in(graph):
        for node in list(g.nodes):
            if not _foldable(node, limit_bytes):
                continue
            made = fold_node(node)
            if made is None:
                skipped += 1
                continue
            folded += 1
            folded_bytes += made
    return PassResult(graph, folded > 0, {"nodes_folded": folded, "bytes_folded": folded_bytes, "not_evaluable": skipped})


def constant_fold_pass(limit_bytes: int = DEFAULT_LIMIT_BYTES) -> Pass:
    """The folding pass with a per-tensor cap of `limit_bytes` (weight operands excepted)."""
    return Pass("constant_fold", functools.partial(constant_fold, limit_bytes=limit_bytes))


CONSTANT_FOLD = constant_fold_pass()
