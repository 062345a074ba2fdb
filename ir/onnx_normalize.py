"""Rewrite older ONNX op versions into Tessel's canonical (opset 21) form.

ONNX moved many attributes to inputs over the years (Split, Squeeze,
Unsqueeze, Reduce*, Clip, Pad, Slice, TopK, Dropout, ...), renamed ops
(Upsample → Resize, Scatter → ScatterElements) and changed the meaning of
the axis of Softmax-family ops. Each rewrite here takes a node as written at
its own version and returns the equivalent node in canonical form, so every
later stage sees one definition per op.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .graph import Value
from .types import numpy_dtype


class ImportProblem(Exception):
    """A node cannot be brought to canonical form; the message says why."""


@dataclass
class RawNode:
    """A node as read from ONNX: attributes are plain Python values (graphs still protos)."""

    name: str
    op_type: str
    attrs: dict[str, Any]
    inputs: list[Value | None]
    outputs: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


class NormalizeContext(Protocol):
    """What a rewrite may ask of the importer."""

    def constant(self, array: np.ndarray, name: str) -> Value:
        """A new constant value."""

    def emit(self, op_type: str, inputs: list[Value | None], attrs: dict[str, Any], name: str) -> Value:
        """A new canonical single-output node, typed (and folded when constant)."""


def _attr_to_input(node: RawNode, ctx: NormalizeContext, attr: str, position: int, dtype: str = "int64") -> None:
    """Move attribute `attr` (if present) to input `position`, padding skipped optionals with None."""
    if attr not in node.attrs:
        return
    value = node.attrs.pop(attr)
    while len(node.inputs) < position:
        node.inputs.append(None)
    array = np.asarray(value, dtype=numpy_dtype(dtype))
    node.inputs.insert(position, ctx.constant(array, f"{node.name}_{attr}"))


def _split(node, version, ctx):
    if version < 13:
        _attr_to_input(node, ctx, "split", 1)
    if version < 18 and (len(node.inputs) < 2 or node.inputs[1] is None):
        node.attrs["num_outputs"] = len(node.outputs)
    return node


def _axes_to_input(first_canonical_version: int):
    def rewrite(node, version, ctx):
        if version < first_canonical_version:
            _attr_to_input(node, ctx, "axes", 1)
        return node

    return rewrite


def _clip(node, version, ctx):
    if version < 11:
        dtype = node.inputs[0].type.dtype
        low = node.attrs.pop("min", float(np.finfo(np.float32).min))
        high = node.attrs.pop("max", float(np.finfo(np.float32).max))
        node.inputs = [node.inputs[0], ctx.constant(np.array(low, numpy_dtype(dtype)), f"{node.name}_min"),
                       ctx.constant(np.array(high, numpy_dtype(dtype)), f"{node.name}_max")]
    return node


def _pad(node, version, ctx):
    if version < 11:
        pads = node.attrs.pop("pads", node.attrs.pop("paddings", None))
        value = node.attrs.pop("value", 0.0)
        dtype = node.inputs[0].type.dtype
        node.inputs = [node.inputs[0], ctx.constant(np.asarray(pads, np.int64), f"{node.name}_pads"),
                       ctx.constant(np.array(value, numpy_dtype(dtype)), f"{node.name}_value")]
    return node


def _slice(node, version, ctx):
    if version < 10:
        starts = node.attrs.pop("starts")
        ends = node.attrs.pop("ends")
        axes = node.attrs.pop("axes", list(range(len(starts))))
        node.inputs = [node.inputs[0]] + [
            ctx.constant(np.asarray(v, np.int64), f"{node.name}_{n}") for n, v in (("starts", starts), ("ends", ends), ("axes", axes))
        ]
    return node


def _topk(node, version, ctx):
    if version < 10:
        _attr_to_input(node, ctx, "k", 1)
        node.inputs[1] = ctx.constant(np.asarray([node.inputs[1].const.item()], np.int64), f"{node.name}_k")
    return node


def _dropout(node, version, ctx):
    node.attrs.pop("is_test", None)
    if version < 12 and "ratio" in node.attrs:
        node.inputs.append(ctx.constant(np.array(node.attrs.pop("ratio"), np.float32), f"{node.name}_ratio"))
    return node


def _batch_norm(node, version, ctx):
    if node.attrs.pop("spatial", 1) != 1:
        raise ImportProblem("BatchNormalization with spatial=0 is not supported")
    node.attrs.pop("is_test", None)
    node.attrs.pop("consumed_inputs", None)
    if node.extra.get("training"):
        return node  # passes/training_mode.py rewrites either form into training-mode primitive ops
    if node.attrs.get("training_mode", 0):
        raise ImportProblem("BatchNormalization in training mode is not supported (export the model for inference)")
    used_extra = [name for name in node.outputs[1:] if name and name in node.extra.get("used_names", ())]
    if used_extra:
        raise ImportProblem(f"BatchNormalization training outputs {used_extra} are read; only inference is supported")
    node.outputs = node.outputs[:1]
    return node


def _resize_from_scales(node, scales: Value):
    mode = node.attrs.get("mode", "nearest")
    node.attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric"}
    if mode == "nearest":
        node.attrs["nearest_mode"] = "floor"
    node.op_type = "Resize"
    node.inputs = [node.inputs[0], None, scales]
    return node


def _upsample(node, version, ctx):
    if "scales" in node.attrs:
        scales = ctx.constant(np.asarray(node.attrs.pop("scales"), np.float32), f"{node.name}_scales")
    else:
        scales = node.inputs[1]
    return _resize_from_scales(node, scales)


def _resize(node, version, ctx):
    if version < 11:
        return _resize_from_scales(node, node.inputs[1])
    return node


def _scatter(node, version, ctx):
    node.op_type = "ScatterElements"
    return node


def _softmax_family(node, version, ctx):
    if version >= 13:
        return node
    data = node.inputs[0]
    rank = data.type.rank
    axis = node.attrs.get("axis", 1)
    axis = axis + rank if axis < 0 else axis
    node.attrs["axis"] = -1
    if axis == rank - 1:
        return node
    # Before opset 13 these ops flattened the input to 2-D at `axis` and worked on the second dimension.
    flat = ctx.emit("Flatten", [data], {"axis": axis}, f"{node.name}_flatten")
    inner = ctx.emit(node.op_type, [flat], {"axis": -1}, f"{node.name}_2d")
    shape = ctx.constant(np.asarray(data.type.shape, np.int64), f"{node.name}_shape")
    node.op_type = "Reshape"
    node.attrs = {}
    node.inputs = [inner, shape]
    return node


_REDUCE_AXES_INPUT_SINCE = {"ReduceSum": 13}
_REDUCE_OPS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
               "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")

REWRITES: dict[str, Callable[[RawNode, int, NormalizeContext], RawNode]] = {
    "Split": _split,
    "Squeeze": _axes_to_input(13),
    "Unsqueeze": _axes_to_input(13),
    "Clip": _clip,
    "Pad": _pad,
    "Slice": _slice,
    "TopK": _topk,
    "Dropout": _dropout,
    "BatchNormalization": _batch_norm,
    "Upsample": _upsample,
    "Resize": _resize,
    "Scatter": _scatter,
    "Softmax": _softmax_family,
    "LogSoftmax": _softmax_family,
    "Hardmax": _softmax_family,
    **{op: _axes_to_input(_REDUCE_AXES_INPUT_SINCE.get(op, 18)) for op in _REDUCE_OPS},
}

# Ops that exist only in older opsets and are rewritten into another op.
RENAMED = frozenset({"Upsample", "Scatter"})


def normalize(node: RawNode, version: int, ctx: NormalizeContext) -> RawNode:
    """Bring `node`, written at op version `version`, into canonical form."""
    rewrite = REWRITES.get(node.op_type)
    return rewrite(node, version, ctx) if rewrite is not None else node
