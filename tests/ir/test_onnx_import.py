"""Importer behaviour: opset normalisation, shape binding, folding, If handling, bad graphs."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel import ir
from tests.conftest import run_onnxruntime
from tests.ir.helpers import F, I64, model

X = ("x", F, [2, 3, 4, 5])

# (name, opset, nodes, initializers, output shape): old op versions whose form differs from opset 21.
OLD_FORMS = [
    ("split_attr", 11, [helper.make_node("Split", ["x"], ["a", "y"], axis=1, split=[1, 2])], [], [2, 2, 4, 5]),
    ("split_equal", 13, [helper.make_node("Split", ["x"], ["y", "b"], axis=0)], [], [1, 3, 4, 5]),
    ("squeeze_attr", 11, [helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0]),
                          helper.make_node("Squeeze", ["u"], ["y"], axes=[0])], [], [2, 3, 4, 5]),
    ("reduce_mean_attr", 13, [helper.make_node("ReduceMean", ["x"], ["y"], axes=[1, 3], keepdims=0)], [], [2, 4]),
    ("reduce_sum_attr", 11, [helper.make_node("ReduceSum", ["x"], ["y"], axes=[2])], [], [2, 3, 1, 5]),
    ("clip_attr", 10, [helper.make_node("Clip", ["x"], ["y"], min=-0.5, max=0.5)], [], [2, 3, 4, 5]),
    ("pad_attr", 10, [helper.make_node("Pad", ["x"], ["y"], pads=[0, 0, 1, 1, 0, 0, 1, 1], value=2.0)], [], [2, 3, 6, 7]),
    ("slice_attr", 9, [helper.make_node("Slice", ["x"], ["y"], starts=[1, 0], ends=[3, -1], axes=[1, 3])], [], [2, 2, 4, 4]),
    ("softmax_axis1", 11, [helper.make_node("Softmax", ["x"], ["y"], axis=1)], [], [2, 3, 4, 5]),
    ("logsoftmax_last", 11, [helper.make_node("LogSoftmax", ["x"], ["y"], axis=3)], [], [2, 3, 4, 5]),
    ("upsample_input", 9, [helper.make_node("Upsample", ["x", "s"], ["y"], mode="nearest")],
     [("s", np.array([1, 1, 2, 2], np.float32))], [2, 3, 8, 10]),
    ("dropout_ratio", 7, [helper.make_node("Dropout", ["x"], ["y"], ratio=0.3)], [], [2, 3, 4, 5]),
    ("batchnorm_spatial", 7, [helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y"], spatial=1)],
     [("g", np.full(3, 2, np.float32)), ("b", np.ones(3, np.float32)), ("m", np.zeros(3, np.float32)),
      ("v", np.ones(3, np.float32))], [2, 3, 4, 5]),
    ("topk_attr", 9, [helper.make_node("TopK", ["x"], ["y", "i"], k=2, axis=-1)], [], [2, 3, 4, 2]),
]


@pytest.mark.parametrize("name,opset,nodes,inits,out_shape", OLD_FORMS, ids=[c[0] for c in OLD_FORMS])
def test_old_op_versions_match_onnxruntime(name, opset, nodes, inits, out_shape):
    outputs = [("y", F, out_shape)] + ([("i", I64, None)] if name == "topk_attr" else [])
    original = model(nodes, [X], outputs, inits, opset=opset)
    graph = ir.from_onnx(original)
    assert not ({n.op_type for n in graph.nodes} & {"Upsample", "Scatter"})
    feeds = {"x": np.random.default_rng(0).standard_normal([2, 3, 4, 5]).astype(np.float32)}
    for want, got in zip(run_onnxruntime(original, feeds), run_onnxruntime(ir.to_onnx(graph), feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shape_subgraph_folds_to_a_constant_reshape():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [("zero", np.array(0, np.int64)), ("zero1", np.array([0], np.int64)), ("minus1", np.array([-1], np.int64))]
    graph = ir.from_onnx(model(nodes, [("x", F, ["batch", 3, 4, 5])], [("y", F, None)], inits), {"x": (2, 3, 4, 5)})
    assert [n.op_type for n in graph.nodes] == ["Reshape"]
    assert graph.outputs[0].type == ir.TensorType("float32", (2, 60))
    assert graph.nodes[0].inputs[1].const.tolist() == [2, -1]


def test_if_with_constant_condition_is_inlined():
    then_branch = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", F, None)])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    graph = ir.from_onnx(model(nodes, [X], [("y", F, None)], [("c", np.array(False))]))
    assert [n.op_type for n in graph.nodes] == ["Neg"]
    assert graph.outputs[0].name == "y"


def test_if_with_runtime_condition_keeps_both_branches():
    then_branch = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", F, None)])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    original = model(nodes, [X, ("c", 9, [])], [("y", F, None)])
    graph = ir.from_onnx(original)
    assert [n.op_type for n in graph.nodes] == ["If"]
    x = np.random.default_rng(1).standard_normal([2, 3, 4, 5]).astype(np.float32)
    for flag in (True, False):
        feeds = {"x": x, "c": np.array(flag)}
        np.testing.assert_array_equal(run_onnxruntime(ir.to_onnx(graph), feeds)[0], run_onnxruntime(original, feeds)[0])


def test_a_branch_returning_an_outer_value_keeps_its_producer(kernel_cache):
    # then returns r, made by the Relu outside (the ONNX checker and onnxruntime refuse this form): the branch gets
    # an Identity of r, so r counts as used and no pass (dce, pool_concat) removes the Relu.
    from tessel.compiler.api import compile

    then_branch = helper.make_graph([], "then", [], [helper.make_tensor_value_info("r", F, None)])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                                    [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("If", ["c"], ["y"], then_branch=then_branch,
                                                                       else_branch=else_branch)]
    branchy = model(nodes, [X, ("c", 9, [])], [("y", F, None)])
    graph = ir.from_onnx(branchy)
    relu = graph.nodes[0]
    assert relu.op_type == "Relu" and [u.op_type for u, _ in relu.outputs[0].uses] == ["Identity"]
    x = np.random.default_rng(2).standard_normal([2, 3, 4, 5]).astype(np.float32)
    artifact = compile(branchy, cache_dir=kernel_cache)
    np.testing.assert_array_equal(artifact.run({"x": x, "c": np.array(True)})["y"], np.maximum(x, 0))
    np.testing.assert_array_equal(artifact.run({"x": x, "c": np.array(False)})["y"], -x)


def test_symbolic_dimension_without_binding_names_input_and_axis():
    with pytest.raises(ir.ShapeBindingError, match=r"input 'x' axis 2 is symbolic \('h'\)"):
        ir.from_onnx(model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [1, 3, "h", 5])], [("y", F, None)]))


@pytest.mark.parametrize("shapes,match", [
    ({"nope": (1,)}, "model's inputs are 'x'"),
    ({"x": (1, 3)}, "rank 4"),
    ({"x": (2, 3, 4, 5)}, "axis 0 is 1"),
    ({"x": (1, 3, -4, 5)}, "negative"),
])
def test_bad_input_shapes_are_rejected(shapes, match):
    original = model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [1, 3, "h", 5])], [("y", F, None)])
    with pytest.raises(ir.ShapeBindingError, match=match):
        ir.from_onnx(original, shapes)


def test_cycle_is_reported_with_node_names():
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="first"), helper.make_node("Relu", ["a"], ["b"], name="second")]
    with pytest.raises(ir.ModelImportError, match="cycle through nodes 'first', 'second'"):
        ir.from_onnx(model(nodes, [X], [("b", F, None)]))


def test_undefined_name_is_reported():
    with pytest.raises(ir.ModelImportError, match="reads 'ghost'"):
        ir.from_onnx(model([helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")], [X], [("y", F, None)]))


def test_nodes_out_of_order_are_sorted():
    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Neg", ["x"], ["a"])]
    graph = ir.from_onnx(model(nodes, [X], [("y", F, None)]))
    assert [n.op_type for n in graph.nodes] == ["Neg", "Relu"]


def test_missing_and_corrupt_files_raise_load_errors(tmp_path):
    with pytest.raises(ir.ModelLoadError, match="no such file"):
        ir.from_onnx(tmp_path / "absent.onnx")
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    with pytest.raises(ir.ModelLoadError):
        ir.from_onnx(text)
    good = model([helper.make_node("Relu", ["x"], ["y"])], [X], [("y", F, None)]).SerializeToString()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(ir.TesselError):
        ir.from_onnx(truncated)


def _free_dims_model():
    """x[-1,3,-1,-1] → Relu → ReduceSum over `axes` (an input) → Reshape to `shape` (an input)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("ReduceSum", ["r", "axes"], ["s"], keepdims=0),
             helper.make_node("Reshape", ["s", "shape"], ["y"])]
    return model(nodes, [("x", F, [-1, 3, -1, -1]), ("axes", I64, [1]), ("shape", I64, [2])], [("y", F, [-1, -1])])


def test_minus_one_dims_are_free_and_take_the_bound_sizes():
    m = model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [-1, 3, -1, 0])], [("y", F, [-1, 3, -1, 0])])
    graph = ir.from_onnx(m, {"x": (2, 3, 7, 5)})  # a declared 0 ("unknown" to some exporters) takes the bound size too
    assert graph.inputs[0].type.shape == (2, 3, 7, 5) and graph.outputs[0].type.shape == (2, 3, 7, 5)
    with pytest.raises(ir.ShapeBindingError, match="axis 0 is unknown; give its size: --input-shape x=Nx3xNx0"):
        ir.from_onnx(m)
    with pytest.raises(ir.ShapeBindingError, match="axis 1 is 3 in the model, but the given shape 2x4x7x5 says 4"):
        ir.from_onnx(m, {"x": (2, 4, 7, 5)})


def test_input_values_become_constants_and_leave_the_inputs():
    graph = ir.from_onnx(_free_dims_model(), {"x": (2, 3, 4, 5)}, input_values={"axes": [1], "shape": np.array([2, -1])})
    assert [v.name for v in graph.inputs] == ["x"]
    assert graph.outputs[0].type.shape == (2, 20)


def test_a_shape_operand_fed_at_run_time_names_the_input_to_give():
    with pytest.raises(ir.ModelImportError) as exc:
        ir.from_onnx(_free_dims_model(), {"x": (2, 3, 4, 5)})
    assert "'axes' decides its output shape but is a graph input: give the value when compiling (--input-value axes=" in str(exc.value)


@pytest.mark.parametrize("values, message", [
    ({"axes": 1.5}, r"input value for 'axes' \(\[1.5\]\) does not fit the input's element type int64"),
    ({"axes": [1, 2]}, "input value for 'axes' has shape 2; the model declares 1"),
    ({"axes": ["a"]}, "input value for 'axes' must be numbers"),
    ({"nosuch": 1}, "input value given for 'nosuch', but the model's inputs are 'x', 'axes', 'shape'"),
])
def test_input_values_that_do_not_fit_the_input_are_refused(values, message):
    with pytest.raises(ir.ShapeBindingError, match=message):
        ir.from_onnx(_free_dims_model(), {"x": (2, 3, 4, 5)}, input_values={"shape": [2, -1], **values})


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


# (name, opset, nodes, initializers, numpy reference of y from x): op versions after opset 21.
NEW_FORMS = [
    ("swish_function", 24, [helper.make_node("Swish", ["x"], ["y"], alpha=2.0)], [], lambda x: x * _sigmoid(2 * x)),
    ("rms_norm_function", 23, [helper.make_node("RMSNormalization", ["x", "s"], ["y"], epsilon=1e-5)],
     [("s", np.full(5, 2, np.float32))], lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * 2),
    ("mod_python_sign", 28, [helper.make_node("Mod", ["x", "d"], ["y"], fmod=0)],
     [("d", np.array([-1.5, 0.7, 2, -3, 1], np.float32))], lambda x: np.mod(x, np.array([-1.5, 0.7, 2, -3, 1], np.float32))),
    ("cast_default_round_mode", 24, [helper.make_node("Cast", ["x"], ["y"], to=F, round_mode="up")], [], lambda x: x),
]


@pytest.mark.parametrize("name,opset,nodes,inits,reference", NEW_FORMS, ids=[c[0] for c in NEW_FORMS])
def test_new_op_versions_import_as_canonical_ops(name, opset, nodes, inits, reference):
    graph = ir.from_onnx(model(nodes, [X], [("y", F, None)], inits, opset=opset))
    assert all(node.op_type not in ("Swish", "RMSNormalization") for node in graph.nodes)
    x = np.random.default_rng(0).standard_normal([2, 3, 4, 5]).astype(np.float32) * 3
    got, = run_onnxruntime(ir.to_onnx(graph), {"x": x})
    np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)


def test_an_added_attribute_set_away_from_its_default_is_an_unsupported_op():
    m = model([helper.make_node("Cast", ["x"], ["y"], to=F, round_mode="nearest")], [X], [("y", F, None)], opset=24)
    with pytest.raises(ir.UnsupportedModelError, match="Cast .*attribute 'round_mode' \\(added in op version 24\\) "
                                                       "is set to b?'nearest'; only its default is supported"):
        ir.from_onnx(m)


def test_compress_with_a_known_condition_becomes_a_gather():
    m = model([helper.make_node("Compress", ["x", "c"], ["y"], axis=1)], [X, ("c", 9, [3])], [("y", F, None)])
    graph = ir.from_onnx(m, input_values={"c": np.array([True, False, True])})
    assert [n.op_type for n in graph.nodes] == ["Gather"] and graph.outputs[0].type.shape == (2, 2, 4, 5)
