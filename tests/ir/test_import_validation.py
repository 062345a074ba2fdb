"""Invalid models are refused in one line; graphs over empty tensors import with ONNX's (onnxruntime's) results;
sizes are checked before anything large is allocated (issue 13, items 8 and 9)."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import helper

from tessel import ir
from tessel.ir.errors import ModelImportError, ModelLoadError, ShapeBindingError
from tessel.ir.onnx_import import input_defaults, newest_opset

from .helpers import F, I64, model


def _relu_model(**kwargs):
    return model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [2])], [("y", F, [2])], **kwargs)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_duplicate_value_definition_is_refused():
    m = model([helper.make_node("Relu", ["x"], ["y"], name="a"), helper.make_node("Neg", ["x"], ["y"], name="b")],
              [("x", F, [2])], [("y", F, [2])])
    with pytest.raises(ModelImportError) as exc:
        ir.from_onnx(m)
    assert "value 'y' is defined twice (output of node 'a' (Relu) and output of node 'b' (Neg))" in _one_line(exc)


def test_node_output_redefining_an_input_is_refused():
    m = model([helper.make_node("Relu", ["x"], ["x"]), helper.make_node("Neg", ["x"], ["y"])],
              [("x", F, [2])], [("y", F, [2])])
    with pytest.raises(ModelImportError, match="value 'x' is defined twice \\(graph input 'x'"):
        ir.from_onnx(m)


def test_duplicate_initializers_are_refused():
    m = model([helper.make_node("Add", ["x", "w"], ["y"])], [("x", F, [2])], [("y", F, [2])],
              initializers=[("w", np.ones(2, np.float32)), ("w", np.zeros(2, np.float32))])
    with pytest.raises(ModelImportError, match="two initializers are named 'w'"):
        ir.from_onnx(m)


def test_duplicate_node_names_are_refused():
    m = model([helper.make_node("Relu", ["x"], ["t"], name="n"), helper.make_node("Neg", ["t"], ["y"], name="n")],
              [("x", F, [2])], [("y", F, [2])])
    with pytest.raises(ModelImportError) as exc:
        ir.from_onnx(m)
    assert "two nodes are named 'n' (nodes #0 and #1)" in _one_line(exc)


def test_subgraph_output_shadowing_an_outer_value_is_refused():
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["x"])], "then", [], [helper.make_tensor_value_info("x", F, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["z"])], "else", [], [helper.make_tensor_value_info("z", F, [2])])
    m = model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
              [("x", F, [2]), ("c", onnx.TensorProto.BOOL, [])], [("y", F, [2])])
    with pytest.raises(ModelImportError, match="graph 'then': value 'x' is defined twice \\(a value of an enclosing graph"):
        ir.from_onnx(m)


def test_opset_newer_than_known_is_refused_with_the_newest():
    with pytest.raises(ModelImportError) as exc:
        ir.from_onnx(_relu_model(opset=999))
    assert f"model imports ONNX opset 999; the newest Tessel reads is {newest_opset()}" in _one_line(exc)


def test_ir_version_newer_than_known_is_refused():
    m = _relu_model()
    m.ir_version = onnx.IR_VERSION + 50
    with pytest.raises(ModelImportError, match=f"IR version {onnx.IR_VERSION + 50}; the newest Tessel reads is"):
        ir.from_onnx(m)


def _shadowed(ir_version=10, declared=(2,)):
    m = model([helper.make_node("Add", ["x", "w"], ["y"])], [("x", F, [2]), ("w", F, list(declared))], [("y", F, [2])],
              initializers=[("w", np.array([1, 2], np.float32))])
    m.ir_version = ir_version
    return m


def test_initializer_that_is_an_input_stays_an_input_with_a_default():
    graph = ir.from_onnx(_shadowed())
    assert [v.name for v in graph.inputs] == ["x", "w"]
    assert not graph.constants
    np.testing.assert_array_equal(input_defaults(_shadowed())["w"], [1, 2])


def test_before_ir_version_4_initializers_listed_as_inputs_are_constants():
    graph = ir.from_onnx(_shadowed(ir_version=3))
    assert [v.name for v in graph.inputs] == ["x"]
    assert input_defaults(_shadowed(ir_version=3)) == {}


def test_default_that_contradicts_its_declared_input_is_refused():
    with pytest.raises(ModelImportError, match="input 'w': its initializer \\(its default value\\) is f32\\[2\\]"):
        ir.from_onnx(_shadowed(declared=(3,)))


def test_bound_shape_of_a_defaulted_input_must_match_the_default():
    with pytest.raises(ShapeBindingError, match="input 'w' has a default"):
        ir.from_onnx(_shadowed(declared=("n",)), {"w": (3,)})


def _reduce(op, opset=18):
    return model([helper.make_node(op, ["x", "axes"], ["y"])], [("x", F, [2, 0])], [("y", F, None)],
                 initializers=[("axes", np.array([1], np.int64))], opset=opset)


@pytest.mark.parametrize("op, value", [("ReduceSum", 0.0), ("ReduceMax", -np.inf), ("ReduceMin", np.inf),
                                       ("ReduceProd", 1.0), ("ReduceMean", 0.0), ("ReduceL2", 0.0)])
def test_reduction_over_an_empty_axis_is_the_onnxruntime_result(op, value):
    graph = ir.from_onnx(_reduce(op))
    (out,) = graph.outputs
    assert out.is_constant and out.type.shape == (2, 1)
    np.testing.assert_array_equal(out.const, np.full((2, 1), value, np.float32))


def test_argmax_over_an_empty_axis_is_one_line_naming_the_node():
    m = model([helper.make_node("ArgMax", ["x"], ["y"], axis=1, name="pick")], [("x", F, [2, 0])], [("y", I64, None)])
    with pytest.raises(ModelImportError) as exc:
        ir.from_onnx(m)
    assert _one_line(exc).startswith("node 'pick' (ArgMax): undefined over an empty input (f32[2,0])")


def test_matmul_over_an_empty_axis_is_zeros():
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", F, [2, 0])], [("y", F, None)],
              initializers=[("w", np.zeros((0, 3), np.float32))])
    (out,) = ir.from_onnx(m).outputs
    np.testing.assert_array_equal(out.const, np.zeros((2, 3), np.float32))


def test_conv_and_softmax_on_empty_tensors_give_empty_constants():
    m = model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Softmax", ["c"], ["y"])],
              [("x", F, [0, 3, 8, 8])], [("y", F, None)], initializers=[("w", np.ones((4, 3, 3, 3), np.float32))])
    graph = ir.from_onnx(m)
    assert not graph.nodes and graph.outputs[0].type.shape == (0, 4, 8, 8)


@pytest.mark.parametrize("op, weight, bias, group, says", [
    ("Conv", (4, 3, 3, 3), None, 1, "input [1, 8, 5, 5] has 8 channels; weight [4, 3, 3, 3] with group 1 takes 3"),
    ("Conv", (4, 3, 3, 3), None, 2, "weight [4, 3, 3, 3] with group 2 takes 6"),
    ("Conv", (6, 2, 3, 3), None, 4, "weight [6, 2, 3, 3] has 6 output channels, not a multiple of group 4"),
    ("Conv", (4, 8, 3, 3), 5, 1, "bias [5] is not one value per output channel (4)"),
    ("ConvTranspose", (4, 2, 3, 3), None, 1, "input [1, 8, 5, 5] has 8 channels; weight [4, 2, 3, 3] with group 1 "
                                             "takes 4"),
    ("ConvTranspose", (8, 2, 3, 3), 2, 2, "bias [2] is not one value per output channel (4)"),
    ("ConvTranspose", (8, 2, 3, 3), None, 3, "weight [8, 2, 3, 3] has 8 input channels, not a multiple of group 3"),
])
def test_a_conv_weight_or_bias_that_does_not_fit_its_input_is_one_line_naming_the_node(op, weight, bias, group, says):
    initializers = [("w", np.zeros(weight, np.float32))] + ([("b", np.zeros(bias, np.float32))] if bias else [])
    node = helper.make_node(op, ["x", "w"] + (["b"] if bias else []), ["y"], group=group, name="conv")
    with pytest.raises(ModelImportError) as exc:
        ir.from_onnx(model([node], [("x", F, [1, 8, 5, 5])], [("y", F, None)], initializers=initializers))
    assert _one_line(exc).startswith(f"node 'conv' ({op}):") and says in _one_line(exc)


def test_concat_drops_empty_parts():
    m = model([helper.make_node("Concat", ["x", "e"], ["y"], axis=1)], [("x", F, [2, 3]), ("e", F, [2, 0])], [("y", F, None)])
    graph = ir.from_onnx(m)
    (node,) = graph.nodes
    assert [v.name for v in node.inputs] == ["x"]


@pytest.mark.parametrize("op, inputs, initializers", [
    ("Tile", ["x", "r"], [("r", np.array([1 << 20, 1 << 20], np.int64))]),
    ("ConstantOfShape", ["s"], [("s", np.array([1 << 40], np.int64))]),
])
def test_output_larger_than_memory_is_refused_naming_the_node(op, inputs, initializers):
    m = model([helper.make_node(op, inputs, ["y"], name="big")], [("x", F, [2, 2])], [("y", F, None)],
              initializers=initializers)
    with pytest.raises(ModelImportError) as exc:
        ir.from_onnx(m)
    assert _one_line(exc).startswith(f"node 'big' ({op}): output 0 would be f32[")
    assert "more than this machine's memory" in str(exc.value)


def _external_model(tmp_path, **changes):
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", F, [1, 4])], [("y", F, [1, 4])],
              initializers=[("w", np.ones((4, 4), np.float32))])
    onnx.save(m, tmp_path / "ok.onnx", save_as_external_data=True, location="ok.data", size_threshold=0)
    m = onnx.load(tmp_path / "ok.onnx", load_external_data=False)
    tensor = m.graph.initializer[0]
    for entry in tensor.external_data:
        entry.value = str(changes.pop(entry.key, entry.value))
    for key, value in changes.items():
        if key == "dims":
            tensor.ClearField("dims")
            tensor.dims.extend(value)
        else:
            tensor.external_data.add(key=key, value=str(value))
    onnx.save(m, tmp_path / "bad.onnx")
    return tmp_path / "bad.onnx"


def test_external_data_beside_the_model_loads(tmp_path):
    assert ir.from_onnx(_external_model(tmp_path)).inputs[0].name == "x"


@pytest.mark.parametrize("changes, message", [
    ({"length": 1 << 40}, "external data claims 1099511627776 bytes at offset 0 of 'ok.data' (64 there), the tensor needs 64"),
    ({"offset": 60}, "external data claims 64 bytes at offset 60"),
    ({"location": "../ok.data"}, "is not a plain relative path beside the model"),
    ({"location": "/etc/passwd"}, "is not a plain relative path beside the model"),
    ({"location": "nothing.data"}, "is missing or outside the model's directory"),
])
def test_damaged_external_data_is_one_line_before_reading(tmp_path, changes, message):
    with pytest.raises(ModelLoadError) as exc:
        ir.from_onnx(_external_model(tmp_path, **changes))
    assert message in _one_line(exc)


def test_external_data_larger_than_memory_is_refused_before_reading(tmp_path):
    huge = tmp_path / "huge.data"
    with open(huge, "wb") as f:
        f.truncate(1 << 36)  # sparse: claims 64 GiB without using the disk
    path = _external_model(tmp_path, location="huge.data", length=1 << 36, dims=[1 << 17, 1 << 17])
    if (1 << 36) <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        pytest.skip("this machine has more than 64 GiB of memory")
    with pytest.raises(ModelLoadError, match="external tensor data takes 64.0 GiB, more than this machine's memory"):
        ir.from_onnx(path)
