"""What gradient rules build with: `GradBuilder` (node-building shorthands) and the `Rule` type."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.types import dtype_to_onnx, numpy_dtype
from tessel.passes.base import add_op


class GradBuilder:
    """Adds backward nodes to a graph for the rule of one forward node at a time.

    `differentiate` points it at each forward node (`begin`) with the inputs whose gradient is
    wanted, so rules can skip work nobody reads (`wants`).
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.node: Node | None = None
        self._wanted: frozenset[int] = frozenset()
        self._constants: dict[tuple, Value] = {}

    def begin(self, node: Node, wanted: Sequence[int]) -> None:
        """Build for `node` next; `wanted` are the input indices whose gradient is needed."""
        self.node = node
        self._wanted = frozenset(wanted)

    def wants(self, index: int) -> bool:
        """True when the gradient of input `index` of the current node is needed."""
        return index in self._wanted

    # ---- nodes -------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[Value | None], *, n_out: int = 1, domain: str = "", **attrs) -> Value:
        """One new node (output 0 returned; see `ops` for several outputs)."""
        return self.ops(op_type, inputs, n_out=n_out, domain=domain, **attrs)[0]

    def ops(self, op_type: str, inputs: Sequence[Value | None], *, n_out: int = 1, domain: str = "", **attrs) -> list[Value]:
        """One new node with `n_out` outputs, all returned."""
        name = f"{self.node.name}_grad" if self.node is not None else "grad"
        node = add_op(self.graph, op_type, list(inputs), attrs, name=name, num_outputs=n_out, domain=domain)
        return list(node.outputs)

    def add(self, a: Value, b: Value) -> Value:
        """a + b (broadcasting)."""
        return self.op("Add", [a, b])

    def sub(self, a: Value, b: Value) -> Value:
        """a - b (broadcasting)."""
        return self.op("Sub", [a, b])

    def mul(self, a: Value, b: Value) -> Value:
        """a * b (broadcasting)."""
        return self.op("Mul", [a, b])

    def div(self, a: Value, b: Value) -> Value:
        """a / b (broadcasting)."""
        return self.op("Div", [a, b])

    def neg(self, a: Value) -> Value:
        """-a."""
        return self.op("Neg", [a])

    def where(self, condition: Value, a: Value, b: Value) -> Value:
        """a where `condition` holds, else b (broadcasting)."""
        return self.op("Where", [condition, a, b])

    def cast(self, value: Value, dtype: str) -> Value:
        """`value` converted to `dtype` (itself when it already is)."""
        return value if value.type.dtype == dtype else self.op("Cast", [value], to=dtype_to_onnx(dtype))

    def reshape(self, value: Value, shape: Sequence[int]) -> Value:
        """`value` reshaped to the static `shape` (itself when it already has it)."""
        if tuple(value.type.shape) == tuple(shape):
            return value
        return self.op("Reshape", [value, self.ints(shape)])

    def expand(self, value: Value, shape: Sequence[int]) -> Value:
        """`value` broadcast to `shape` (itself when it already has it)."""
        if tuple(value.type.shape) == tuple(shape):
            return value
        return self.op("Expand", [value, self.ints(shape)])

    def reduce_sum(self, value: Value, axes: Sequence[int], keepdims: bool) -> Value:
        """Sum over `axes` (none: `value` itself)."""
        if not axes:
            return value
        return self.op("ReduceSum", [value, self.ints(axes)], keepdims=int(keepdims))

    def transpose(self, value: Value, perm: Sequence[int]) -> Value:
        """`value` with its axes permuted (itself for the identity permutation)."""
        if list(perm) == list(range(len(perm))):
            return value
        return self.op("Transpose", [value], perm=list(perm))

    def unbroadcast(self, grad: Value, target: Value) -> Value:
        """The gradient of a value that was broadcast to `grad`'s shape: summed back to `target`'s shape."""
        gshape, tshape = grad.type.shape, target.type.shape
        lead = len(gshape) - len(tshape)
        axes = list(range(lead)) + [lead + i for i, d in enumerate(tshape) if d == 1 and gshape[lead + i] != 1]
        return self.reshape(self.reduce_sum(grad, axes, keepdims=False), tshape)

    # ---- constants ---------------------------------------------------------
    def constant(self, array: np.ndarray) -> Value:
        """A graph constant holding `array` (one per distinct array)."""
        array = np.ascontiguousarray(array)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.graph.add_constant("grad_const", array)
        return self._constants[key]

    def constants_made(self) -> list[Value]:
        """Every constant this builder added."""
        return list(self._constants.values())

    def scalar(self, number: float, like: Value) -> Value:
        """A rank-0 constant of `like`'s element type."""
        return self.constant(np.array(number, dtype=numpy_dtype(like.type.dtype)))

    def ints(self, values: Sequence[int]) -> Value:
        """A 1-D int64 constant (shapes, axes, pads)."""
        return self.constant(np.array(list(values), dtype=np.int64))

    def zeros(self, like: Value) -> Value:
        """Zeros of `like`'s type, made at run time (no constant as large as the tensor)."""
        return self.expand(self.scalar(0.0, like), like.type.shape)


Grads = list[Value | None]


@dataclass(frozen=True)
class Rule:
    """The gradient rule of one op type.

    `build(builder, node, output_grads)` gets one gradient per node output (None where none
    flows back) and returns one per node input (None: no gradient). `unsupported(node)` says why
    this particular node cannot be differentiated (an attribute value the rule does not handle),
    or None.
    """

    build: Callable[[GradBuilder, Node, Grads], Grads]
    unsupported: Callable[[Node], str | None] = lambda node: None

    def __call__(self, builder: GradBuilder, node: Node, output_grads: Grads) -> Grads:
        return self.build(builder, node, output_grads)


def is_float(value: Value | None) -> bool:
    """True for a value that can carry a gradient (a floating-point tensor)."""
    return value is not None and value.type.dtype in ("float16", "bfloat16", "float32", "float64")


def const_ints(value: Value | None) -> list[int] | None:
    """The integers held by a constant input (axes, shape, pads), or None when the input is omitted."""
    if value is None:
        return None
    if value.const is None:
        raise ValueError(f"gradient rule needs '{value.name}' to be a constant")
    return [int(v) for v in np.asarray(value.const).reshape(-1)]
