"""Operands that must be known when compiling: the inputs of an op that decide its output shape.

Reshape's shape, Resize's scales and sizes, Slice's starts and ends, Reduce axes, Pad's pads,
TopK's k, ... Tessel gives every tensor a static shape, so these operands must be constants by
the time the node is imported. When one is a graph input, its value has to be given at compile
time (`input_values=` / `--input-value NAME=...`); `shape_deciding_inputs` finds those inputs.
"""
from __future__ import annotations

from typing import Iterable

import onnx
from onnx import defs

# By op: the names (as in the ONNX schemas) of the inputs that decide the output's shape, or that the
# kernels read as constants (Resize's roi, Compress's condition).
_SHAPE_OPERANDS: dict[str, frozenset[str]] = {
    **{op: frozenset({"axes"}) for op in (
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
        "ReduceProd", "ReduceSum", "ReduceSumSquare", "Squeeze", "Unsqueeze")},
    "Reshape": frozenset({"shape"}),
    "Expand": frozenset({"shape"}),
    "CenterCropPad": frozenset({"shape", "axes"}),
    "Resize": frozenset({"roi", "scales", "sizes"}),
    "Upsample": frozenset({"scales"}),
    "Slice": frozenset({"starts", "ends", "axes", "steps"}),
    "Pad": frozenset({"pads", "axes"}),
    "TopK": frozenset({"K"}),
    "Tile": frozenset({"repeats"}),
    "ConstantOfShape": frozenset({"input"}),
    "Range": frozenset({"start", "limit", "delta"}),
    "OneHot": frozenset({"depth"}),
    "Split": frozenset({"split"}),
    "Col2Im": frozenset({"image_shape", "block_shape"}),
    "AffineGrid": frozenset({"size"}),
    "Compress": frozenset({"condition"}),
    "CumSum": frozenset({"axis"}),
    "CumProd": frozenset({"axis"}),
    "Trilu": frozenset({"k"}),
    "Dropout": frozenset({"ratio", "training_mode"}),
    **{op: frozenset({"sequence_lens"}) for op in ("LSTM", "GRU", "RNN")},
    "MaxUnpool": frozenset({"output_shape"}),
    "DFT": frozenset({"dft_length", "axis"}),
    "STFT": frozenset({"frame_step", "frame_length"}),
    "MelWeightMatrix": frozenset({"num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz", "upper_edge_hertz"}),
    **{op: frozenset({"size"}) for op in ("BlackmanWindow", "HannWindow", "HammingWindow")},
}
# Ops whose outputs depend on their inputs' shapes only, never on their values.
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def shape_operand_positions(op_type: str, version: int, domain: str = "") -> list[int]:
    """Positions of the inputs of `op_type` (as defined at opset `version`) that decide its output shape."""
    names = _SHAPE_OPERANDS.get(op_type)
    if not names or domain not in ("", "ai.onnx"):
        return []
    try:
        schema = defs.get_schema(op_type, version, "")
    except defs.SchemaError:
        return []
    return [index for index, formal in enumerate(schema.inputs) if formal.name in names]


def shape_deciding_inputs(model: onnx.ModelProto) -> dict[str, list[str]]:
    """The graph inputs whose values decide a shape, each with the operands it reaches ("Reshape 'r' shape").

    An input decides a shape when a shape operand is computed from its values, through any chain of
    nodes (but not through Shape or Size, which read only shapes) and the subgraphs of If nodes that compute
    it; shape operands inside subgraphs are not searched.
    """
    graph = model.graph
    opset = next((e.version for e in model.opset_import if e.domain in ("", "ai.onnx")), 0)
    initializers = {t.name for t in graph.initializer}
    inputs = [vi.name for vi in graph.input if vi.name not in initializers]
    producers = {name: node for node in graph.node for name in node.output if name}
    found: dict[str, list[str]] = {}
    for index, node in enumerate(graph.node):
        for position in shape_operand_positions(node.op_type, opset, node.domain):
            if position >= len(node.input) or not node.input[position]:
                continue
            formal = defs.get_schema(node.op_type, opset, "").inputs[position].name
            label = f"{node.op_type} '{node.name or f'#{index}'}' {formal}"
            for name in _sources(node.input[position], producers, set(inputs)):
                found.setdefault(name, []).append(label)
    return {name: found[name] for name in inputs if name in found}


def _sources(name: str, producers: dict[str, onnx.NodeProto], inputs: set[str]) -> Iterable[str]:
    """The graph inputs whose values `name` is computed from."""
    seen: set[str] = set()
    stack = [name]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in inputs:
            yield current
        node = producers.get(current)
        if node is not None and node.op_type not in _SHAPE_ONLY:
            stack.extend(n for n in node.input if n)
            stack.extend(_read_in_subgraphs(node))


def _read_in_subgraphs(node: onnx.NodeProto) -> Iterable[str]:
    """Every name the node's subgraphs read (an If branch reads the enclosing graph's values by name)."""
    for attr in node.attribute:
        for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
            for inner in graph.node:
                yield from (n for n in inner.input if n)
                yield from _read_in_subgraphs(inner)
            yield from (vi.name for vi in graph.output)
