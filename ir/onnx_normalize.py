"""Rewrite older ONNX op versions into Tessel's canonical (opset 21) form.

ONNX moved many attributes to inputs over the years (Split, Squeeze,
Unsqueeze, Reduce*, Clip, Pad, Slice, TopK, Dropout, ...), renamed ops
(Upsample → Resize, Scatter → ScatterElements) and changed the meaning of
the axis of Softmax-family ops (opset 13) and of Mod's fmod=0 on floats
(opset 28). Each rewrite here takes a node as written at its own version
and returns the equivalent node in canonical form, so every later stage
sees one definition per op.
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
    training = node.inputs[2] if len(node.inputs) > 2 else None
    ratio = node.inputs[1] if len(node.inputs) > 1 else None
    if (not node.extra.get("training") and training is not None and training.const is not None
            and bool(training.const.reshape(-1)[0])
            and (ratio is None or ratio.const is None or float(ratio.const.reshape(-1)[0]) > 0)):
        raise ImportProblem("Dropout in training mode drops at random, which is not supported (export the model for inference)")
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
    if node.attrs.get("antialias", 0):
        raise ImportProblem("Resize with antialias=1 is not supported")
    return node


def _lstm(node, version, ctx):
    # Peepholes run as the unrolled primitive ops (passes/simplify.unroll_peephole_lstm), which model only the
    # plain form: a peephole LSTM using anything more is refused here rather than failing at compile.
    if len(node.inputs) < 8 or node.inputs[7] is None:
        return node
    extras = [name for name, used in (
        ("sequence_lens", len(node.inputs) > 4 and node.inputs[4] is not None),
        ("activations", [a.lower() for a in node.attrs.get("activations") or []] not in (
            [], ["sigmoid", "tanh", "tanh"], ["sigmoid", "tanh", "tanh"] * 2)),
        ("clip", node.attrs.get("clip") is not None),
        ("activation_alpha", node.attrs.get("activation_alpha") is not None),
        ("activation_beta", node.attrs.get("activation_beta") is not None),
        ("layout=1", node.attrs.get("layout", 0) != 0),
        ("input_forget=1", bool(node.attrs.get("input_forget", 0)))) if used]
    if extras:
        raise ImportProblem(f"LSTM peephole weights (input P) together with {', '.join(extras)} are not supported")
    return node


def _conv_transpose(node, version, ctx):
    if node.inputs and node.inputs[0] is not None and len(node.inputs[0].type.shape) > 4:
        raise ImportProblem("ConvTranspose over more than 2 spatial axes is not supported (1-D and 2-D are)")
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


def _dft(node, version, ctx):
    if version < 20:
        node.attrs.setdefault("axis", 1)  # DFT-17's default; the input's default became -2
        _attr_to_input(node, ctx, "axis", 2)
    return node


def _compress(node, version, ctx):
    condition = node.inputs[1]
    if not condition.is_constant:
        return node  # the output's size is unknown until run time: import fails, naming the condition
    # A known condition picks known indices: a Gather, which needs no kernel of its own.
    data = node.inputs[0]
    if "axis" not in node.attrs:
        data = ctx.emit("Reshape", [data, ctx.constant(np.array([-1], np.int64), f"{node.name}_flat")], {},
                        f"{node.name}_flatten")
    picked = np.flatnonzero(condition.const.reshape(-1)[:data.type.shape[node.attrs.get("axis", 0)]])
    node.op_type = "Gather"
    node.inputs = [data, ctx.constant(picked.astype(np.int64), f"{node.name}_indices")]
    node.attrs = {"axis": node.attrs.get("axis", 0)}
    return node


def _range(node, version, ctx):
    # ONNX wants scalars; onnxruntime (and exporters relying on it) also take one-element vectors.
    node.inputs = [ctx.emit("Reshape", [v, ctx.constant(np.zeros(0, np.int64), f"{node.name}_scalar")], {},
                            f"{node.name}_{k}_scalar") if v is not None and v.type.shape == (1,) else v
                   for k, v in enumerate(node.inputs)]
    return node


def _mod(node, version, ctx):
    if version < 28 or node.attrs.get("fmod", 0) or not node.inputs[0].type.dtype.startswith(("float", "bfloat")):
        return node
    # Mod-28 defines fmod=0 on floats as Python's (numpy's) mod, whose sign is the divisor's: C's fmod,
    # moved by one divisor where the two signs differ.
    a, b = node.inputs
    remainder = ctx.emit("Mod", [a, b], {"fmod": 1}, f"{node.name}_fmod")
    zero = ctx.constant(np.zeros((), numpy_dtype(a.type.dtype)), f"{node.name}_zero")
    signs_differ = ctx.emit("Xor", [ctx.emit("Less", [remainder, zero], {}, f"{node.name}_r_negative"),
                                    ctx.emit("Less", [b, zero], {}, f"{node.name}_b_negative")], {}, f"{node.name}_signs")
    nonzero = ctx.emit("Not", [ctx.emit("Equal", [remainder, zero], {}, f"{node.name}_r_zero")], {}, f"{node.name}_r_nonzero")
    moved = ctx.emit("Add", [remainder, b], {}, f"{node.name}_moved")
    node.op_type = "Where"
    node.attrs = {}
    node.inputs = [ctx.emit("And", [signs_differ, nonzero], {}, f"{node.name}_move"), moved, remainder]
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
    "LSTM": _lstm,
    "ConvTranspose": _conv_transpose,
    "Scatter": _scatter,
    "Mod": _mod,
    "Range": _range,
    "DFT": _dft,
    "Compress": _compress,
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
