"""Keep an exported model's declared shapes from contradicting ONNX's own shape inference at the export opset.

ONNX's inference for MaxPool/AveragePool before opset 22 gives a ceil-mode output one element too many when the
last window would start in the end padding; onnxruntime and Tessel drop that window. A model declaring the right
size then fails `onnx.checker`'s full check. Such dims are written unknown (onnxruntime computes them anyway).
"""
from __future__ import annotations

import onnx


def _declared_dims(values) -> dict[str, list[int | None]]:
    return {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            for v in values if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}


def _inferred_dims(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Dims ONNX infers for the main graph's values from its inputs alone (nothing we declared)."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    del bare.graph.value_info[:]
    for output in bare.graph.output:
        output.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(bare, strict_mode=False).graph
    return _declared_dims(list(inferred.value_info) + list(inferred.output))


def without_contradicted_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every declared dim that ONNX's inference sizes differently made unknown (in place)."""
    inferred = _inferred_dims(model)
    for value in list(model.graph.value_info) + list(model.graph.output):
        theirs = inferred.get(value.name)
        if theirs is None or not value.type.tensor_type.HasField("shape"):
            continue
        for dim, size in zip(value.type.tensor_type.shape.dim, theirs):
            if size is not None and dim.HasField("dim_value") and dim.dim_value != size:
                dim.ClearField("dim_value")
    return model
