"""Reverse-mode automatic differentiation as a pass on the IR.

`differentiate(graph, loss, wrt)` adds the backward nodes to `graph` in place, one gradient rule per
forward node (passes/gradients/), and returns the gradient of `loss` with respect to each value in `wrt`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tessel.ir.errors import TesselError
from tessel.ir.graph import Graph, Node, Value
from tessel.ir.types import numpy_dtype

from .gradients import GradBuilder, is_float, rule_for


class MissingGradientError(TesselError):
    """Nodes between the parameters and the loss have ops without a gradient rule; lists all of them at once.

    `ops` holds the op types, sorted.
    """

    def __init__(self, problems: dict[str, str]):
        self.ops = sorted(problems)
        parts = [f"{op} ({problems[op]})" if problems[op] else op for op in self.ops]
        super().__init__(f"no gradient rule for {len(self.ops)} op type(s): {', '.join(parts)}")


def differentiate(graph: Graph, loss: Value, wrt: Sequence[Value]) -> dict[str, Value]:
    """Add the backward pass of `loss` (a one-element float value) to `graph`; return {name: gradient} for `wrt`.

    Only nodes on a path from a value of `wrt` to the loss are differentiated; gradients reaching one
    value along several paths are summed. A value the loss does not depend on gets zeros. Raises
    MissingGradientError, naming every op without a rule, before adding anything.
    """
    if loss.type.numel != 1 or not is_float(loss):
        raise ValueError(f"differentiate: the loss '{loss.name}' must be a one-element float tensor, is {loss.type}")
    active = _nodes_between(graph, wrt, loss)
    _check_rules(active)
    builder = GradBuilder(graph)
    first_new = len(graph.nodes)
    grads: dict[int, Value] = {id(loss): builder.constant(np.ones(loss.type.shape, numpy_dtype(loss.type.dtype)))}
    carriers = _gradient_carriers(active, wrt)
    for node in reversed(active):
        output_grads = [grads.get(id(v)) if v is not None else None for v in node.outputs]
        if all(g is None for g in output_grads):
            continue
        wanted = [i for i, v in enumerate(node.inputs) if v is not None and id(v) in carriers]
        builder.begin(node, wanted)
        input_grads = rule_for(node)(builder, node, output_grads)
        for index in wanted:
            grad = input_grads[index] if index < len(input_grads) else None
            if grad is None:
                continue
            value = node.inputs[index]
            if grad.type.shape != value.type.shape:
                raise AssertionError(f"gradient rule of {node.op_type} gave {grad.type} for input {index} {value.type}")
            previous = grads.get(id(value))
            grads[id(value)] = grad if previous is None else builder.add(previous, grad)
    result = {v.name: grads.get(id(v)) or builder.zeros(v) for v in wrt}
    _drop_unread(graph, first_new, builder.constants_made(), result.values())
    return result


def _nodes_between(graph: Graph, wrt: Sequence[Value], loss: Value) -> list[Node]:
    """Nodes (in graph order) that read a float value depending on `wrt` and produce one the loss depends on."""
    depends = {id(v) for v in wrt}
    forward = []
    for node in graph.nodes:
        if any(v is not None and id(v) in depends and is_float(v) for v in node.inputs):
            floats = [v for v in node.outputs if is_float(v)]
            if floats:
                forward.append(node)
                depends.update(id(v) for v in floats)
    needed = {id(loss)}
    active = []
    for node in reversed(forward):
        if any(v is not None and id(v) in needed for v in node.outputs):
            active.append(node)
            needed.update(id(v) for v in node.inputs if v is not None)
    return active[::-1]


def _gradient_carriers(active: list[Node], wrt: Sequence[Value]) -> set[int]:
    """Ids of the float values a gradient must reach: `wrt` and active nodes' float outputs."""
    carriers = {id(v) for v in wrt if is_float(v)}
    for node in active:
        carriers.update(id(v) for v in node.outputs if is_float(v))
    return carriers


def _check_rules(active: list[Node]) -> None:
    """Raise MissingGradientError naming every op type among `active` without a usable rule."""
    problems: dict[str, str] = {}
    for node in active:
        rule = rule_for(node)
        if rule is None:
            problems.setdefault(node.op_type, "")
            continue
        reason = rule.unsupported(node)
        if reason is not None:
            problems[node.op_type] = reason
    if problems:
        raise MissingGradientError(problems)


def _drop_unread(graph: Graph, first_new: int, constants: list[Value], keep) -> None:
    """Remove backward nodes (those from index `first_new`) and backward `constants` that nothing reads,
    except the values in `keep`: rules build some gradients no one needs."""
    kept = {id(v) for v in keep}
    for node in reversed(graph.nodes[first_new:]):
        if all(out is None or (not out.uses and not out.is_graph_output and id(out) not in kept) for out in node.outputs):
            graph.remove_node(node)
    for value in constants:
        if not value.uses and not value.is_graph_output and id(value) not in kept:
            graph.remove_constant(value)
