"""Constant folding: compute nodes whose inputs are all constants, up to a size cap.

Import already folds shape arithmetic (small tensors); this pass also folds
larger weight transformations (a transposed or rescaled weight, a folded
BatchNorm's arithmetic) and whatever earlier passes made constant. Values are
computed by ONNX's reference implementation, so they follow the specification.
"""
from __future__ import annotations

import functools

import numpy as np

from tessel.ir.evaluate import evaluate
from tessel.ir.graph import Graph, Node
from tessel.ir.schema import get_schema
from tessel.ir.types import numpy_dtype

from .base import Pass, PassResult, graphs_in, is_pure, retire

DEFAULT_LIMIT_BYTES = 1 << 20


def _foldable(node: Node, limit_bytes: int) -> bool:
    if not is_pure(node) or node.domain:
        return False
    present = [v for v in node.inputs if v is not None]
    if not present or not all(v.is_constant for v in present):
        return False
    schema = get_schema(node.op_type, node.domain)
    if schema is None or not schema.traits.deterministic:
        return False
    return all(out is None or out.type.nbytes <= limit_bytes for out in node.outputs)


def constant_fold(graph: Graph, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> PassResult:
    """Replace each node whose inputs are all constants by its computed outputs (each at most `limit_bytes`)."""
    folded = skipped = 0
    folded_bytes = 0
    for g in graphs_in(graph):
        for node in list(g.nodes):
            if not _foldable(node, limit_bytes):
                continue
            schema = get_schema(node.op_type, node.domain)
            try:
                arrays = evaluate(schema, node.attrs, [v.const if v is not None else None for v in node.inputs], len(node.outputs))
            except Exception:  # the reference evaluator lacks a few cases; the node then runs at run time
                skipped += 1
                continue
            replacements = {}
            for index, (out, array) in enumerate(zip(node.outputs, arrays)):
                if out is None:
                    continue
                array = np.asarray(array).astype(numpy_dtype(out.type.dtype), copy=False).reshape(out.type.shape)
                replacements[index] = g.add_constant(f"{out.name}_folded", array)
                folded_bytes += array.nbytes
            retire(node, replacements)
            folded += 1
    return PassResult(graph, folded > 0, {"nodes_folded": folded, "bytes_folded": folded_bytes, "not_evaluable": skipped})


def constant_fold_pass(limit_bytes: int = DEFAULT_LIMIT_BYTES) -> Pass:
    """The folding pass with a per-tensor cap of `limit_bytes`."""
    return Pass("constant_fold", functools.partial(constant_fold, limit_bytes=limit_bytes))


CONSTANT_FOLD = constant_fold_pass()
