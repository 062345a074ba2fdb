"""bfloat16 at a model's boundary: graph inputs, outputs and initializers of that type are refused at import.

The runtime hands tensors over as NumPy arrays (DLPack, .npz files), and NumPy has no bfloat16: such a model would
import and compile, then fail when run. bfloat16 values inside the graph (between Casts) are fine.
"""
from __future__ import annotations

import onnx

BFLOAT16_REASON = "bfloat16 graph inputs, outputs and initializers are not supported (the runtime passes NumPy arrays)"


def bfloat16_boundary_names(graph: onnx.GraphProto) -> frozenset[str]:
    """Names of the graph's inputs, outputs and initializers whose element type is bfloat16."""
    values = [v for v in list(graph.input) + list(graph.output)
              if v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16]
    initializers = [t for t in graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16]
    return frozenset(v.name for v in values) | frozenset(t.name for t in initializers)


def touches(node: onnx.NodeProto, names: frozenset[str]) -> bool:
    """True when the node reads or writes one of `names`."""
    return any(name in names for name in list(node.input) + list(node.output))
