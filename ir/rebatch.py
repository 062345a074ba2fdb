"""Re-batching a graph: the same graph at another batch size (axis 0 of its inputs), types inferred again.

Micro-batches and data-parallel replicas run a model on slices of its batch.
Rather than import the model again at the slice's size, the compiler re-batches
the graph it already optimized: the inputs take the new batch on axis 0 and
every node's output types are inferred again, in order (fused bodies and
branches included). Weights are shared with the original, not copied.

A shape the exporter or constant folding wrote down with the batch in it (a
Reshape to [8, -1] at batch 8, or to [T, 8, C] time-major) is the one thing
inference cannot re-derive: a constant Reshape target or Expand shape is
re-derived from how its input changed (the output dim that carried the batch
scales with it). Anything else that pins the batch (a constant of the batch's
shape) fails with `RebatchError` naming the node.
"""
from __future__ import annotations

import numpy as np

from .attributes import Attributes
from .errors import TesselError
from .graph import Graph, Node, Value
from .schema import FUSED, InferenceFailure, get_schema
from .types import TensorType


class RebatchError(TesselError):
    """The graph cannot run at the requested batch (a node pins the batch)."""


def batch_size(graph: Graph) -> int | None:
    """Axis 0 shared by every input of rank ≥ 1, or None when they disagree or there are none."""
    sizes = {v.type.shape[0] for v in graph.inputs if v.type.rank}
    return sizes.pop() if len(sizes) == 1 else None


def rebatched(graph: Graph, batch: int) -> Graph:
    """A copy of `graph` whose inputs take `batch` on axis 0, with every type inferred again.

    Raise RebatchError naming the node that cannot run at that batch.
    """
    old = batch_size(graph)
    if old is None:
        raise RebatchError(f"the inputs of '{graph.name}' do not share a batch size on axis 0; cannot re-batch it")
    copied = clone(graph)
    if batch == old:
        return copied
    before: dict[int, TensorType] = {}
    for value in copied.inputs:
        if value.type.rank:
            before[id(value)] = value.type
            value.type = TensorType(value.type.dtype, (batch,) + value.type.shape[1:])
    _infer_again(copied, old, batch, before)
    return copied


def clone(graph: Graph, parent: Graph | None = None, mapping: dict[int, Value] | None = None) -> Graph:
    """A copy of `graph` (nodes, values, fused bodies and branches) sharing its read-only constant arrays."""
    mapping = {} if mapping is None else mapping  # id(original value) → its copy; branches read enclosing values
    copied = Graph(graph.name, parent=parent)
    for value in graph.inputs:
        mapping[id(value)] = copied.add_input(value.name, value.type)
    for value in graph.constants:
        mapping[id(value)] = copied.add_constant(value.name, value.const)
    for node in graph.nodes:
        attrs = Attributes({key: clone(a, copied, mapping) if isinstance(a, Graph) else a
                            for key, a in node.attrs.items()})
        made = copied.add_node(node.op_type, [mapping[id(v)] if v is not None else None for v in node.inputs], attrs,
                               [v.type if v is not None else None for v in node.outputs], name=node.name,
                               output_names=[v.name if v is not None else "" for v in node.outputs], domain=node.domain)
        for value, made_value in zip(node.outputs, made.outputs):
            if value is not None:
                mapping[id(value)] = made_value
    copied.outputs = [mapping[id(v)] for v in graph.outputs]
    return copied


def _infer_again(graph: Graph, old: int, new: int, before: dict[int, TensorType] | None = None) -> None:
    """Infer the output types of `graph`'s nodes again, in order, from their (re-typed) inputs.

    `before` keeps each re-typed value's type at the old batch: pinned shapes are re-derived from the change.
    """
    before = {} if before is None else before
    for node in list(graph.nodes):
        if not node.domain and node.op_type in _PINNED_SHAPE_RULES:
            _PINNED_SHAPE_RULES[node.op_type](graph, node, before, old)
        _rebatch_uniform_constants(graph, node, before)
        for body in node.subgraphs():
            if node.op_type == FUSED:
                for param, value in zip(body.inputs, node.inputs):
                    before.setdefault(id(param), param.type)
                    param.type = value.type
            _infer_again(body, old, new, before)
        schema = get_schema(node.op_type, node.domain)
        if schema is None:
            raise RebatchError(f"node '{node.name}': no schema for {node.domain or 'ai.onnx'}.{node.op_type}")
        types = [v.type if v is not None else None for v in node.inputs]
        data = [v.const if v is not None else None for v in node.inputs]
        try:
            inferred = schema.infer(node.attrs, types, data, len(node.outputs))
        except InferenceFailure as exc:
            raise RebatchError(f"node '{node.name}' ({node.op_type}) cannot run at batch {new} (compiled at {old}): "
                               f"{exc}") from None
        for value, t in zip(node.outputs, inferred):
            if value is not None and t is not None and t != value.type:
                before[id(value)] = value.type
                value.type = t


def _rebatch_reshape(graph: Graph, node: Node, before: dict[int, TensorType], batch: int) -> None:
    """A constant Reshape target re-derived for the re-batched input: the output dim that carried the batch
    (in the group of dims the reshape merges or splits around it) scales with it."""
    data, target = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    if target is None or target.const is None or id(data) not in before:
        return
    old_in, new_in, old_out = before[id(data)].shape, data.type.shape, node.outputs[0].type.shape
    if len(old_in) != len(new_in):
        return
    new_out = _scaled_output(old_in, new_in, old_out, batch)
    if new_out is None:
        return  # inference then names the node
    shape = np.asarray(target.const).astype(np.int64)
    fixed = np.array([d if d in (0, -1) else n for d, n in zip(shape, new_out)], np.int64)
    _replace_constant(graph, node, 1, target, fixed, "batch")


def _rebatch_expand(graph: Graph, node: Node, before: dict[int, TensorType], batch: int) -> None:
    """A constant Expand shape re-derived: a dim equal to the input's old size (right-aligned) that changed
    takes the new size."""
    data, target = node.inputs
    if target.const is None or id(data) not in before:
        return
    old_in, new_in = before[id(data)].shape, data.type.shape
    shape = np.asarray(target.const).astype(np.int64).copy()
    for k in range(1, min(len(old_in), len(shape)) + 1):
        if old_in[-k] != new_in[-k] and shape[-k] == old_in[-k]:
            shape[-k] = new_in[-k]
    if not np.array_equal(shape, target.const):
        _replace_constant(graph, node, 1, target, shape, "batch")


def _rebatch_uniform_constants(graph: Graph, node: Node, before: dict[int, TensorType]) -> None:
    """A constant holding one value everywhere (the zeros of an RNN's initial state, folded at the old batch)
    read beside inputs whose dims changed: its dims equal to a changed dim's old size (right-aligned) follow."""
    changed = [(before[id(v)].shape, v.type.shape) for v in node.inputs
               if v is not None and id(v) in before and before[id(v)].rank == v.type.rank]
    if not changed:
        return
    for index, value in enumerate(node.inputs):
        if value is None or value.const is None or value.type.rank == 0 or value.type.numel == 0:
            continue
        shape = list(value.type.shape)
        for old_shape, new_shape in changed:
            for k in range(1, min(len(old_shape), len(shape)) + 1):
                if old_shape[-k] != new_shape[-k] and shape[-k] == old_shape[-k]:
                    shape[-k] = new_shape[-k]
        array = value.const
        if tuple(shape) != array.shape and np.all(array == array.flat[0]):
            _replace_constant(graph, node, index, value, np.full(shape, array.flat[0], array.dtype), "batch")


_PINNED_SHAPE_RULES = {"Reshape": _rebatch_reshape, "Expand": _rebatch_expand}


def _scaled_output(old_in: tuple[int, ...], new_in: tuple[int, ...], old_out: tuple[int, ...],
                   batch: int) -> list[int] | None:
    """The reshape's output shape for `new_in`, or None when it is not clear which output dim changes.

    Reshape keeps row-major order, so input and output dims fall into groups with equal products (at the
    boundaries where both prefix products agree); a group whose input product changed passes the change to
    one of its output dims: the one of the old `batch` size, else one equal to the changed input dim (carried
    through unchanged in size), else the first one the change divides.
    """
    groups = _aligned_groups(old_in, old_out)
    if groups is None:
        return None
    new_out = list(old_out)
    for (a, b), (c, d) in groups:
        old_size, new_size = int(np.prod(old_in[a:b], dtype=np.int64)), int(np.prod(new_in[a:b], dtype=np.int64))
        if old_size == new_size:
            continue
        changed = [old_in[i] for i in range(a, b) if old_in[i] != new_in[i]]
        candidates = ([j for j in range(c, d) if old_out[j] == batch] + [j for j in range(c, d) if old_out[j] in changed]
                      + list(range(c, d)))
        for j in candidates:
            if (old_out[j] * new_size) % old_size == 0:
                new_out[j] = old_out[j] * new_size // old_size
                break
        else:
            return None
    return new_out


def _aligned_groups(shape_in: tuple[int, ...], shape_out: tuple[int, ...]):
    """Pairs of dim ranges ([a, b) of the input, [c, d) of the output) with equal products, as fine as possible."""
    groups, a, c = [], 0, 0
    i, j, p_in, p_out = 0, 0, 1, 1
    while i < len(shape_in) or j < len(shape_out):
        if p_in <= p_out and i < len(shape_in) or j == len(shape_out):
            p_in *= shape_in[i]
            i += 1
        else:
            p_out *= shape_out[j]
            j += 1
        if p_in == p_out and i > a and j > c:
            groups.append(((a, i), (c, j)))
            a, c = i, j
    if not groups or p_in != p_out:
        return None
    # Trailing dims of size 1 join the last group.
    groups[-1] = ((groups[-1][0][0], len(shape_in)), (groups[-1][1][0], len(shape_out)))
    return groups


def _replace_constant(graph: Graph, node: Node, index: int, old: Value, array: np.ndarray, why: str) -> None:
    """Make input `index` of `node` a new constant holding `array` (the old one goes when nothing reads it)."""
    graph.set_input(node, index, graph.add_constant(graph.unique_name(f"{old.name}__{why}"), array))
    if not old.uses and not old.is_graph_output:
        old.graph.remove_constant(old)
