"""promote_to_float64: the float64 version of a model computes what the float32 one does, in float64."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tessel.ir.float64_model import promote_to_float64


def _model() -> onnx.ModelProto:
    """y = Relu(x @ W + b) * ConstantOfShape(2.0) + Cast(float16 scale): every place a float32 can hide."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 7, "W")
    b = numpy_helper.from_array(np.float32([0.1, -0.2, 0.3, -0.4]), "b")
    half = numpy_helper.from_array(np.float16([0.5]), "half")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["pre"]),
        helper.make_node("Relu", ["pre"], ["act"]),
        helper.make_node("Shape", ["act"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["two"],
                         value=numpy_helper.from_array(np.float32([2.0]), "v")),
        helper.make_node("Mul", ["act", "two"], ["scaled"]),
        helper.make_node("Cast", ["half"], ["scale"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["scaled", "scale"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w, b, half])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_every_float32_becomes_float64_and_the_values_stay():
    model = _model()
    promoted = promote_to_float64(model)
    onnx.checker.check_model(promoted)
    assert promoted.graph.input[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    assert promoted.graph.output[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    types = {t.name: t.data_type for t in promoted.graph.initializer}
    assert types == {"W": TensorProto.DOUBLE, "b": TensorProto.DOUBLE, "half": TensorProto.FLOAT16}
    assert model.graph.initializer[0].data_type == TensorProto.FLOAT, "the model given is left as it was"

    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    run = lambda m, feed: ort.InferenceSession(m.SerializeToString()).run(None, {"x": feed})[0]  # noqa: E731
    got = run(promoted, x.astype(np.float64))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, run(model, x), rtol=1e-6)


def test_subgraphs_are_promoted_too():
    then = helper.make_graph([helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(np.float32([1.0]), "c"))],
                             "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])])
    other = helper.make_graph([helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(np.float32([2.0]), "c"))],
                              "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1])])
    graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)], "g",
                              [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    promoted = promote_to_float64(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    branches = {a.name: a.g for a in promoted.graph.node[0].attribute}
    assert branches["then_branch"].node[0].attribute[0].t.data_type == TensorProto.DOUBLE
    assert branches["else_branch"].output[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    out = ort.InferenceSession(promoted.SerializeToString()).run(None, {"cond": np.array(False)})[0]
    assert out.dtype == np.float64 and out[0] == 2.0


def test_float32_that_a_node_makes_without_saying_so_is_promoted():
    nodes = [helper.make_node("Constant", [], ["c"], value_float=1.5),
             helper.make_node("Constant", [], ["cs"], value_floats=[1.0, 2.0]),
             helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
             helper.make_node("Add", ["x", "c"], ["a"]),
             helper.make_node("Add", ["a", "cs"], ["b"]),
             helper.make_node("Add", ["b", "zeros"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    promoted = promote_to_float64(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    onnx.checker.check_model(promoted, full_check=True)
    out = ort.InferenceSession(promoted.SerializeToString()).run(None, {"x": np.float64([1.0, -1.0])})[0]
    assert out.dtype == np.float64 and out.tolist() == [3.5, 2.5]
