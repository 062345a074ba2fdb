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
# The conv algorithms whose kernels pack their input and unpack their output in 16-channel blocks.
PACKED_ALGORITHMS = frozenset({"nchwc", "direct"})
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

    blocked = {}
    for node in graph.nodes:
        if len(node.outputs) != 1 or node.outputs[0] is None or not packed_conv_kernel(node, OUT_CHANNELS):
            continue
        value = node.outputs[0]
        if not _conv_result(node, value) or value.is_graph_output:
            continue
        readers = [user for user, _ in value.uses]
        if readers and all(user.graph is graph and packed_conv_kernel(user, IN_CHANNELS) for user in readers):
            blocked[value.name] = BLOCK
    return blocked


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
