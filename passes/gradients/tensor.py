"""Gradient rules of data-movement ops: reshapes, transposes, joins and splits, slices, gathers, padding,
broadcasts, tiling and nearest-neighbour resizing."""
from __future__ import annotations

import numpy as np

from tessel.ir.evaluate import evaluate
from tessel.ir.graph import Node
from tessel.ir.schema import get_schema

from .builder import GradBuilder, Grads, Rule, const_ints


def _reshaped(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    """Ops that only change the shape (Reshape, Flatten, Squeeze, Unsqueeze)."""
    return [b.reshape(grads[0], node.inputs[0].type.shape)] + [None] * (len(node.inputs) - 1)


def _transpose(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    rank = node.inputs[0].type.rank
    perm = list(node.attrs.get("perm") or reversed(range(rank)))
    return [b.transpose(grads[0], list(np.argsort(perm)))]


def _expand(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    return [b.unbroadcast(grads[0], node.inputs[0]), None]


def _concat(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    inputs = node.inputs
    if len(inputs) == 1:
        return [grads[0]]
    axis = node.attrs["axis"] % inputs[0].type.rank
    sizes = [x.type.shape[axis] for x in inputs]
    return list(b.ops("Split", [grads[0], b.ints(sizes)], n_out=len(inputs), axis=axis))


def _split(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    x = node.inputs[0]
    axis = node.attrs.get("axis", 0) % x.type.rank
    parts = [g if g is not None else b.zeros(out) for g, out in zip(grads, node.outputs)]
    dx = parts[0] if len(parts) == 1 else b.op("Concat", parts, axis=axis)
    return [dx] + [None] * (len(node.inputs) - 1)


def _slices(node: Node) -> tuple[slice, ...]:
    """The numpy indexing a Slice node performs (Python's slice clamping is ONNX's)."""
    x = node.inputs[0]
    starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
    axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 else None
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 else None
    axes = list(range(len(starts))) if axes is None else [a % x.type.rank for a in axes]
    steps = steps or [1] * len(starts)
    index = [slice(None)] * x.type.rank
    for axis, start, end, step in zip(axes, starts, ends, steps):
        index[axis] = slice(start, end, step)
    return tuple(index)


def _slice(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x = grads[0], node.inputs[0]
    index = _slices(node)
    bounds = [s.indices(d) for s, d in zip(index, x.type.shape)]
    if all(step == 1 for _, _, step in bounds):
        # A box: pad the gradient back with zeros around it.
        begins = [start for start, _, _ in bounds]
        ends = [d - start - n for (start, _, _), d, n in zip(bounds, x.type.shape, dy.type.shape)]
        dx = b.op("Pad", [dy, b.ints(begins + ends)])
    else:
        # Strided or reversed: each input element reads its place in the flattened gradient, or a trailing zero.
        source = np.full(x.type.numel, dy.type.numel, dtype=np.int64)
        source[np.arange(x.type.numel).reshape(x.type.shape)[index].reshape(-1)] = np.arange(dy.type.numel)
        flat = b.op("Concat", [b.reshape(dy, [dy.type.numel]), b.reshape(b.scalar(0.0, dy), [1])], axis=0)
        dx = b.reshape(b.op("Gather", [flat, b.constant(source)], axis=0), x.type.shape)
    return [dx] + [None] * (len(node.inputs) - 1)


def _gather(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    # Move the gathered axis to the front, scatter-add the gradient rows there, move it back.
    dy, (data, indices) = grads[0], node.inputs
    rank, q = data.type.rank, indices.type.rank
    axis = node.attrs.get("axis", 0) % rank
    size = data.type.shape[axis]
    if indices.const is not None:
        rows = b.constant(np.asarray(indices.const, dtype=np.int64) % size)
    else:
        rows = b.cast(indices, "int64")
        rows = b.where(b.op("Less", [rows, b.constant(np.array(0, np.int64))]),
                       b.add(rows, b.constant(np.array(size, np.int64))), rows)
    front = [axis] + [i for i in range(rank) if i != axis]
    zeros = b.expand(b.scalar(0.0, dy), [data.type.shape[i] for i in front])
    updates = b.transpose(dy, list(range(axis, axis + q)) + list(range(axis)) + list(range(axis + q, dy.type.rank)))
    scattered = b.op("ScatterND", [zeros, b.reshape(rows, (*indices.type.shape, 1)), updates], reduction="add")
    return [b.transpose(scattered, list(np.argsort(front))), None]


def _pad_amounts(node: Node) -> tuple[list[int], list[int]]:
    """Per-axis (begins, ends) a Pad node adds (negative: crops)."""
    rank = node.inputs[0].type.rank
    pads = const_ints(node.inputs[1])
    axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 else None
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    begins, ends = [0] * rank, [0] * rank
    for k, axis in enumerate(axes):
        begins[axis], ends[axis] = pads[k], pads[len(axes) + k]
    return begins, ends


def _pad(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x = grads[0], node.inputs[0]
    begins, ends = _pad_amounts(node)
    # Padded places drop out; cropped places (negative pads) get zeros back.
    starts = [max(p, 0) for p in begins]
    kept = [d - max(-p, 0) - max(-e, 0) for d, p, e in zip(x.type.shape, begins, ends)]
    dx = b.op("Slice", [dy, b.ints(starts), b.ints([s + k for s, k in zip(starts, kept)])])
    crops = [max(-p, 0) for p in begins] + [max(-e, 0) for e in ends]
    if any(crops):
        dx = b.op("Pad", [dx, b.ints(crops)])
    return [dx] + [None] * (len(node.inputs) - 1)


def _pad_unsupported(node: Node) -> str | None:
    mode = node.attrs.get("mode", "constant")
    return None if mode == "constant" else f"mode '{mode}'"


def _tile(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x = grads[0], node.inputs[0]
    repeats = const_ints(node.inputs[1])
    blocks = [n for r, d in zip(repeats, x.type.shape) for n in (r, d)]
    summed = b.reduce_sum(b.reshape(dy, blocks), list(range(0, 2 * x.type.rank, 2)), keepdims=False)
    return [b.reshape(summed, x.type.shape), None]


def _resize_sources(node: Node) -> np.ndarray:
    """For a nearest-mode Resize, the flat input index each output element copies (found by running it)."""
    x = node.inputs[0]
    positions = np.arange(x.type.numel, dtype=np.float64).reshape(x.type.shape)
    inputs = [positions] + [v.const if v is not None else None for v in node.inputs[1:]]
    return evaluate(get_schema("Resize"), node.attrs, inputs, 1)[0].astype(np.int64)


def _resize(b: GradBuilder, node: Node, grads: Grads) -> Grads:
    dy, x = grads[0], node.inputs[0]
    sources = _resize_sources(node)
    factors = [o // i if i and o % i == 0 else 0 for i, o in zip(x.type.shape, dy.type.shape)]
    if all(factors):
        blocks = np.arange(x.type.numel).reshape(x.type.shape)
        for axis, f in enumerate(factors):
            blocks = np.repeat(blocks, f, axis=axis)
        if np.array_equal(blocks, sources):
            # Each input element fills an integer block of the output: sum each block.
            split = [n for d, f in zip(x.type.shape, factors) for n in (d, f)]
            summed = b.reduce_sum(b.reshape(dy, split), list(range(1, 2 * x.type.rank, 2)), keepdims=False)
            return [b.reshape(summed, x.type.shape)] + [None] * (len(node.inputs) - 1)
    flat = b.op("ScatterElements", [b.expand(b.scalar(0.0, dy), [x.type.numel]), b.constant(sources.reshape(-1)),
                                    b.reshape(dy, [dy.type.numel])], axis=0, reduction="add")
    return [b.reshape(flat, x.type.shape)] + [None] * (len(node.inputs) - 1)


def _resize_unsupported(node: Node) -> str | None:
    mode = node.attrs.get("mode", "nearest")
    if mode != "nearest":
        return f"mode '{mode}'"
    if any(v is not None and v.const is None for v in node.inputs[1:]):
        return "scales or sizes computed at run time"
    return None


RULES: dict[str, Rule] = {
    "Reshape": Rule(_reshaped),
    "Flatten": Rule(_reshaped),
    "Squeeze": Rule(_reshaped),
    "Unsqueeze": Rule(_reshaped),
    "Transpose": Rule(_transpose),
    "Expand": Rule(_expand),
    "Concat": Rule(_concat),
    "Split": Rule(_split),
    "Slice": Rule(_slice),
    "Gather": Rule(_gather),
    "Pad": Rule(_pad, _pad_unsupported),
    "Tile": Rule(_tile),
    "Resize": Rule(_resize, _resize_unsupported),
}
