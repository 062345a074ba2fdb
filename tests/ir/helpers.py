"""Small ONNX models built in tests."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def model(nodes, inputs, outputs, initializers=(), opset=21) -> onnx.ModelProto:
    """A model from nodes and (name, elem_type, shape) inputs/outputs."""
    graph = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        [numpy_helper.from_array(np.asarray(a), name) for name, a in initializers],
    )
    ir_version = 7 if opset < 15 else 10
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


F = TensorProto.FLOAT
I64 = TensorProto.INT64
