"""`Emitter`: adds typed nodes in front of one node, for rewrites that expand it into several primitive ops."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.types import numpy_dtype

from .base import add_op


class Emitter:
    """Builds ops before `anchor` in its graph, naming them after `prefix`; shape arguments become constants."""

    def __init__(self, graph: Graph, anchor: Node, prefix: str):
        self.graph = graph
        self.anchor = anchor
        self.prefix = prefix

    def op(self, op_type: str, *inputs: Value | None, **attrs: Any) -> Value:
        """The single output of a new `op_type` node."""
        return self.node(op_type, inputs, attrs).outputs[0]

    def node(self, op_type: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None,
             num_outputs: int = 1) -> Node:
        """A new `op_type` node with schema-checked attributes and inferred output types."""
        return add_op(self.graph, op_type, list(inputs), attrs, name=f"{self.prefix}/{op_type}", before=self.anchor,
                      num_outputs=num_outputs)

    def const(self, array: Any, dtype: Any) -> Value:
        """A new constant holding `array` as `dtype`."""
        return self.graph.add_constant(self.graph.unique_name(f"{self.prefix}/const"), np.asarray(array, dtype))

    def scalar(self, value: float, like: Value) -> Value:
        """A scalar constant of `like`'s element type."""
        return self.const(value, numpy_dtype(like.type.dtype))

    def reshape(self, value: Value, shape: Sequence[int]) -> Value:
        """`value` reshaped to `shape` (itself when it already has that shape)."""
        if tuple(value.type.shape) == tuple(shape):
            return value
        return self.op("Reshape", value, self.const(list(shape), np.int64))

    def split(self, value: Value, axis: int, sizes: Sequence[int]) -> list[Value]:
        """`value` cut along `axis` into parts of `sizes` (itself when there is one part)."""
        if len(sizes) == 1:
            return [value]
        node = self.node("Split", [value, self.const(list(sizes), np.int64)], {"axis": axis}, num_outputs=len(sizes))
        return list(node.outputs)

    def concat(self, values: Sequence[Value], axis: int) -> Value:
        """`values` joined along `axis` (the value itself when there is one)."""
        if len(values) == 1:
            return values[0]
        return self.op("Concat", *values, axis=axis)
