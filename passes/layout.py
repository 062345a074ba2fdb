"""Layout rewrites: collapse chains of views and transposes, move views out of the way of fusion.

Views (Reshape, Flatten, Squeeze, Unsqueeze) cost nothing at run time, but a
view between a matmul and its elementwise epilogue splits them into two
kernels; `sink_views` moves the view after the elementwise op.
"""
from __future__ import annotations

import numpy as np

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import op_traits

from .base import add_op, can_replace, retire, single_user


def shape_view_source(value: Value, graph: Graph) -> Value:
    """The value a chain of Reshape/Flatten/Squeeze/Unsqueeze in `graph` ending at `value` starts from (`value`
    when no such view makes it): what `collapse_views` keeps of the chain."""
    while value.producer is not None and op_traits(value.producer.op_type).shape_view and value.graph is graph:
        value = value.producer.inputs[0]
    return value


def collapse_views(node: Node) -> str | None:
    """A chain of Reshape/Flatten/Squeeze/Unsqueeze becomes one Reshape; a no-op view disappears."""
    if not op_traits(node.op_type).shape_view:
        return None
    source = shape_view_source(node.inputs[0], node.graph)
    out = node.outputs[0]
    if source.type.shape == out.type.shape:
        if not can_replace(out, source):
            return None
        retire(node, {0: source})
        return "views_removed"
    if source is node.inputs[0]:
        return None
    shape = node.graph.add_constant(f"{out.name}_shape", np.asarray(out.type.shape, np.int64))
    reshape = add_op(node.graph, "Reshape", [source, shape], name=node.name, before=node)
    retire(node, {0: reshape.outputs[0]})
    return "view_chains_collapsed"


def collapse_transposes(node: Node) -> str | None:
    """Transpose of a Transpose becomes one Transpose (or nothing when the permutations cancel)."""
    if node.op_type != "Transpose":
        return None
    rank = node.inputs[0].type.rank
    perm = list(node.attrs.get("perm") or range(rank)[::-1])
    source = node.inputs[0]
    inner = source.producer
    if perm == list(range(rank)):
        if not can_replace(node.outputs[0], source):
            return None
        retire(node, {0: source})
        return "transposes_removed"
    if inner is None or inner.op_type != "Transpose" or inner.graph is not node.graph:
        return None
    inner_perm = list(inner.attrs.get("perm") or range(rank)[::-1])
    combined = [inner_perm[p] for p in perm]
    origin = inner.inputs[0]
    if combined == list(range(rank)):
        if not can_replace(node.outputs[0], origin):
            return None
        retire(node, {0: origin})
        return "transposes_removed"
    merged = add_op(node.graph, "Transpose", [origin], {"perm": combined}, name=node.name, before=node)
    retire(node, {0: merged.outputs[0]})
    return "transpose_chains_collapsed"


def _reshape(node: Node, value: Value, shape: tuple[int, ...], name: str) -> Value:
    g = node.graph
    target = g.add_constant(f"{name}_shape", np.asarray(shape, np.int64))
    return add_op(g, "Reshape", [value, target], name=name, before=node).outputs[0]


def _anchor_output(value: Value) -> bool:
    return value.producer is not None and op_traits(value.producer.op_type).fusion_anchor


def _view_of_anchor(value: Value, node: Node) -> bool:
    view = value.producer
    return (view is not None and op_traits(view.op_type).shape_view and view.graph is node.graph
            and single_user(value) is node and _anchor_output(view.inputs[0]))


def sink_views(node: Node) -> str | None:
    """Elementwise(view(anchor(...)), ...) becomes view(Elementwise(anchor(...), ...)).

    Other same-shaped operands are viewed to the anchor's shape (free); one-element
    operands stay. Fires only when no operand is itself an anchor's output, so a
    rewritten node never fires again.
    """
    if not op_traits(node.op_type).elementwise or node.domain or len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    operands = [v for v in node.inputs if v is not None and v.type.numel != 1]
    if not operands or any(v.type.shape != out.type.shape for v in operands) or any(_anchor_output(v) for v in operands):
        return None
    viewed = [v for v in operands if _view_of_anchor(v, node)]
    if len(viewed) != 1:
        return None
    source = viewed[0].producer.inputs[0]
    inputs = []
    for index, value in enumerate(node.inputs):
        if value is viewed[0]:
            inputs.append(source)
        elif value is None or value.type.numel == 1:
            inputs.append(value)
        else:
            inputs.append(_reshape(node, value, source.type.shape, f"{node.name}_in{index}"))
    moved = add_op(node.graph, node.op_type, inputs, dict(node.attrs), name=node.name, before=node)
    result = _reshape(node, moved.outputs[0], out.type.shape, f"{node.name}_view")
    retire(node, {0: result})
    return "views_sunk"


def split_to_slices(node: Node) -> str | None:
    """A Split becomes one Slice per output, so each part can fuse with its readers."""
    if node.op_type != "Split" or node.domain:
        return None
    source = node.inputs[0]
    axis = node.attrs.get("axis", 0) % source.type.rank
    g = node.graph
    replacements = {}
    start = 0
    for index, out in enumerate(node.outputs):
        size = out.type.shape[axis]
        if out.uses or out.is_graph_output:
            bounds = [g.add_constant(f"{out.name}_{what}", np.asarray([v], np.int64))
                      for what, v in (("start", start), ("end", start + size), ("axis", axis))]
            replacements[index] = add_op(g, "Slice", [source, *bounds], name=f"{node.name}_part{index}", before=node).outputs[0]
        start += size
    retire(node, replacements)
    return "splits_to_slices"
