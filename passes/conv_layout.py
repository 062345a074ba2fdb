"""Blocked activation layout between consecutive convs: NCHW[16]c kept from one conv kernel to the next.

The convs are dense ones and depthwise ones (backends/cpu/depthwise_conv.py).

A packed conv kernel reads NCHW and packs it into 16-channel blocks, and
unpacks its NCHW[16]c result back to NCHW. Where a conv kernel's result is
read only by other packed conv kernels (as their input, or by their epilogue:
a residual Add), the value stays in NCHW[16]c: (N, C/16, H, W, 16). The
producer writes its register tiles as they are and the readers skip the
packing; nothing else changes, since the value is never seen outside these
kernels (not a model output, not sent, not read by any other kernel).
"""
from __future__ import annotations

from typing import Callable, Mapping

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.types import TensorType

from .fuse import is_kernel, kernel_members

BLOCK = 16
# The conv algorithms whose kernels pack their input and unpack their output in 16-channel blocks (Winograd's
# transform them from and to the blocks: backends/cpu/winograd_blocks.py).
PACKED_ALGORITHMS = frozenset({"nchwc", "direct", "winograd"})
DEFAULT_ALGORITHM = "nchwc"
# Axes of a conv weight (K, C, R, S): the channels a kernel writes and reads.
OUT_CHANNELS, IN_CHANNELS = 0, 1


def blocked_type(t: TensorType, block: int) -> TensorType:
    """The NCHW[block]c type of an NCHW value."""
    n, c, h, w = t.shape
    return TensorType(t.dtype, (n, c // block, h, w, block))


def blocked_values(graph: Graph, algorithms: Callable[[Node], set[str]] | None = None) -> dict[str, int]:
    """Value name → channel block, for the values of `graph` (top level) kept in NCHW[16]c.

    `algorithms(node)` gives the conv algorithms a node's kernels use (algorithm
    selection may pick others than the default); only packed ones keep the layout.
    """
    algorithms = algorithms or (lambda node: {DEFAULT_ALGORITHM})

    def packed_conv_kernel(node: Node, channels_axis: int) -> bool:
        conv = _conv_anchor(node)
        return conv is not None and _blockable_conv(*conv, channels_axis) and algorithms(node) <= PACKED_ALGORITHMS

    # Candidates: every conv result and pass-through result not returned; then, until nothing changes, drop those
    # with a reader that does not take blocks and pass-through results whose input is not blocked.
    candidates: dict[str, Node] = {}
    for node in graph.nodes:
        value = node.outputs[0] if node.outputs else None
        if value is None or value.is_graph_output:
            continue
        if passes_blocks(node) or (len(node.outputs) == 1 and packed_conv_kernel(node, OUT_CHANNELS)
                                   and _conv_result(node, value)):
            candidates[value.name] = node

    def takes_blocks(user: Node) -> bool:
        if user.graph is not graph:
            return False
        if passes_blocks(user):
            return user.outputs[0].name in candidates
        return packed_conv_kernel(user, IN_CHANNELS)

    changed = True
    while changed:
        changed = False
        for name, node in list(candidates.items()):
            readers = [user for user, _ in node.outputs[0].uses]
            keep = bool(readers) and all(takes_blocks(user) for user in readers)
            if keep and passes_blocks(node):
                keep = node.inputs[0].name in candidates
            if not keep:
                del candidates[name]
                changed = True
    return {name: BLOCK for name in candidates}


def passes_blocks(node: Node) -> bool:
    """Whether a (top-level, unfused) kernel maps each channel on its own and can run on NCHW[16]c: a 2-D float32
    MaxPool without Indices, or a Slice of whole 16-channel blocks along axis 1 of a 4-D float32 value."""
    if node.domain != "" or node.op_type not in ("MaxPool", "Slice") or not node.inputs or node.inputs[0] is None:
        return False
    x = node.inputs[0]
    if x.type.dtype != "float32" or x.type.rank != 4 or x.type.shape[1] % BLOCK:
        return False
    if any(out is not None and (out.uses or out.is_graph_output) for out in node.outputs[1:]):
        return False
    if node.op_type == "MaxPool":
        return True
    return _block_slice(node, x.type.shape[1])


def _block_slice(node: Node, channels: int) -> bool:
    """Whether a Slice keeps every axis but the channels whole and cuts those at multiples of BLOCK, step 1."""
    operands = list(node.inputs[1:]) + [None] * (4 - len(node.inputs[1:]))
    starts, ends, axes, steps = operands[:4]
    if any(v is not None and not v.is_constant for v in (starts, ends, axes, steps)) or starts is None or ends is None:
        return False
    starts, ends = starts.const.reshape(-1).tolist(), ends.const.reshape(-1).tolist()
    axes = axes.const.reshape(-1).tolist() if axes is not None else list(range(len(starts)))
    steps = steps.const.reshape(-1).tolist() if steps is not None else [1] * len(starts)
    if [a % 4 for a in axes] != [1] or steps != [1]:
        return False
    start, end = (min(max(b + channels if b < 0 else b, 0), channels) for b in (starts[0], ends[0]))
    return start < end and start % BLOCK == 0 and end % BLOCK == 0


def _conv_anchor(node: Node) -> tuple[Node, Mapping[int, Value]] | None:
    """The Conv a kernel is built around, with the outer values of its inputs; None for other kernels."""
    if node.domain not in ("", TESSEL_DOMAIN) or not is_kernel(node):
        return None
    members, outer = kernel_members(node)
    convs = [m for m in members if m.domain == "" and m.op_type == "Conv"]
    if len(convs) != 1:
        return None
    conv = convs[0]
    return conv, {k: outer.get(id(v), v) for k, v in enumerate(conv.inputs) if v is not None}


def _blockable_conv(conv: Node, inputs: Mapping[int, Value], channels_axis: int) -> bool:
    """A dense 2-D float32 conv run unswapped, or a depthwise one, whose output (OUT_CHANNELS) or input
    (IN_CHANNELS) channels fill whole 16-channel blocks."""
    x, weight = inputs.get(0), inputs.get(1)
    if x is None or weight is None or not weight.is_constant or x.type.dtype != "float32" or x.type.rank != 4:
        return False
    groups = conv.attrs.get("group", 1)
    channels = weight.type.shape[OUT_CHANNELS] if channels_axis == OUT_CHANNELS else x.type.shape[1]
    if groups != 1:  # backends/cpu/depthwise_conv.py's blocks are 16 channels too
        return groups == x.type.shape[1] == weight.type.shape[OUT_CHANNELS] and channels % BLOCK == 0
    height, width = x.type.shape[2:]
    unswapped = not width < 8 <= height  # backends/cpu/packing.py runs tall, narrow convs transposed
    return channels % BLOCK == 0 and unswapped


def _conv_result(node: Node, value: Value) -> bool:
    """Whether `value` is the conv's output or an elementwise epilogue of it (same NCHW shape)."""
    conv, _ = _conv_anchor(node)
    if conv is node:
        return True
    out = conv.outputs[0]
    if value.type.shape != out.type.shape:
        return False
    body: Graph = node.attrs["body"]
    result = body.outputs[0]
    seen, stack = set(), [result]
    while stack:
        current = stack.pop()
        if current is out:
            return True
        if id(current) in seen or current.producer is None or current.producer.graph is not body:
            continue
        seen.add(id(current))
        stack.extend(v for v in current.producer.inputs if v is not None)
    return False
