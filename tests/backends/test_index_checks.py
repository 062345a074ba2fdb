"""Index inputs are checked at run time: out of range is one error naming the node and the index, never an access outside."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.backends.lowering.index_checks import IndexCheck, parse_check
from tessel.compiler.api import compile
from tessel.runtime.errors import ExecutionError
from tests.conftest import CORPUS, run_onnxruntime

WEIGHT = np.arange(40, dtype=np.float32).reshape(10, 4)


def _model(nodes, inputs, output_shape, initializers=(WEIGHT,)):
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)],
        [numpy_helper.from_array(w, "w") for w in initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _gather_model():
    node = helper.make_node("Gather", ["w", "i"], ["y"], axis=0, name="Gather_3")
    return _model([node], [helper.make_tensor_value_info("i", TensorProto.INT64, [3])], [3, 4])


def _gather_elements_model():
    node = helper.make_node("GatherElements", ["w", "i"], ["y"], axis=0, name="GatherElements_1")
    return _model([node], [helper.make_tensor_value_info("i", TensorProto.INT64, [2, 4])], [2, 4])


def _embedding_model():
    """int32 token ids → Cast → Gather → Add: one fused kernel whose indices pass a cast."""
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64, name="cast_ids"),
        helper.make_node("Gather", ["w", "ids64"], ["rows"], axis=0, name="embed"),
        helper.make_node("Add", ["rows", "pos"], ["y"], name="add_pos"),
    ]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT32, [1, 3]),
              helper.make_tensor_value_info("pos", TensorProto.FLOAT, [1, 3, 4])]
    return _model(nodes, inputs, [1, 3, 4])


@pytest.fixture(scope="module")
def gather(kernel_cache):
    return compile(_gather_model(), input_shapes={"i": (3,)}, cache_dir=kernel_cache)


@pytest.mark.parametrize("bad", [10, 2**31, -11, -(2**40)])
def test_gather_out_of_range_is_one_error_naming_node_and_index(gather, bad):
    with pytest.raises(ExecutionError) as error:
        gather.run({"i": np.array([bad, 0, 0], dtype=np.int64)})
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"node 'Gather_3': index {bad} out of range [-10, 9] on axis 0 of 'w'")


def test_gather_in_range_and_negative_indices_equal_onnxruntime(gather):
    i = np.array([9, -1, -10], dtype=np.int64)
    got = gather.run({"i": i})["y"]
    np.testing.assert_array_equal(got, run_onnxruntime(_gather_model(), {"i": i})[0])


def test_gather_elements_checks_every_index(kernel_cache):
    artifact = compile(_gather_elements_model(), input_shapes={"i": (2, 4)}, cache_dir=kernel_cache)
    good = np.array([[0, -1, 3, 9], [-10, 2, 2, 1]], dtype=np.int64)
    np.testing.assert_array_equal(artifact.run({"i": good})["y"],
                                  run_onnxruntime(_gather_elements_model(), {"i": good})[0])
    for bad in (10, 2**31):
        indices = good.copy()
        indices[1, 3] = bad
        with pytest.raises(ExecutionError, match=rf"^node 'GatherElements_1': index {bad} out of range \[-10, 9\]"):
            artifact.run({"i": indices})


def test_fused_embedding_checks_its_token_ids_through_a_cast(kernel_cache):
    artifact = compile(_embedding_model(), input_shapes={"ids": (1, 3), "pos": (1, 3, 4)}, cache_dir=kernel_cache)
    pos = np.ones((1, 3, 4), np.float32)
    ids = np.array([[3, -2, 0]], dtype=np.int32)
    np.testing.assert_array_equal(artifact.run({"ids": ids, "pos": pos})["y"],
                                  run_onnxruntime(_embedding_model(), {"ids": ids, "pos": pos})[0])
    with pytest.raises(ExecutionError, match=r"^node 'embed': index 1000 out of range \[-10, 9\] on axis 0 of 'w'"):
        artifact.run({"ids": np.array([[3, 1000, 0]], dtype=np.int32), "pos": pos})


def test_indices_computed_inside_a_kernel_are_checked_after_it(kernel_cache):
    nodes = [helper.make_node("Add", ["i", "one"], ["shifted"], name="shift"),
             helper.make_node("Gather", ["w", "shifted"], ["y"], axis=0, name="lookup")]
    model = _model(nodes, [helper.make_tensor_value_info("i", TensorProto.INT64, [3])], [3, 4])
    model.graph.initializer.append(numpy_helper.from_array(np.array(1, dtype=np.int64), "one"))
    artifact = compile(model, input_shapes={"i": (3,)}, cache_dir=kernel_cache)
    good = np.array([8, -11, 0], dtype=np.int64)
    np.testing.assert_array_equal(artifact.run({"i": good})["y"], run_onnxruntime(model, {"i": good})[0])
    with pytest.raises(ExecutionError, match=r"^node 'lookup': an index computed in kernel '.+' is out of range "
                                             r"\[-10, 9\] on axis 0 of 'w'"):
        artifact.run({"i": np.array([2**40, 0, 0], dtype=np.int64)})


@pytest.mark.parametrize("computed", [False, True], ids=["argument", "computed"])
def test_a_million_indices_compile_in_seconds_and_are_all_checked(computed, kernel_cache):
    """The fuzzer's case 7931: TVM unrolled the loop of assertions whole (minutes of build for 2**20 indices)."""
    count = 2**20
    nodes = [helper.make_node("Gather", ["w", "j" if computed else "i"], ["rows"], axis=0, name="lookup"),
             helper.make_node("ReduceMax", ["rows"], ["y"], keepdims=0, name="top")]
    if computed:
        nodes.insert(0, helper.make_node("Add", ["i", "one"], ["j"], name="shift"))
    model = _model(nodes, [helper.make_tensor_value_info("i", TensorProto.INT64, [1, count])], [])
    model.graph.initializer.append(numpy_helper.from_array(np.array(1, dtype=np.int64), "one"))
    started = time.monotonic()
    artifact = compile(model, input_shapes={"i": (1, count)}, cache_dir=kernel_cache)
    assert time.monotonic() - started < 60
    good = np.random.default_rng(7931).integers(-11 if computed else -10, 9 if computed else 10, (1, count))
    np.testing.assert_array_equal(artifact.run({"i": good})["y"], run_onnxruntime(model, {"i": good})[0])
    bad = good.copy()
    bad[0, -1] = 10
    said = r"an index computed in kernel '.+' is" if computed else r"index 10"
    with pytest.raises(ExecutionError, match=rf"^node 'lookup': {said} out of range \[-10, 9\] on axis 0 of 'w'"):
        artifact.run({"i": bad})


def test_the_cli_reports_a_bad_index_in_one_line_with_exit_2(gather, tmp_path):
    gather.save(str(tmp_path / "gather.tessel"))
    np.savez(tmp_path / "bad.npz", i=np.array([2**31, 0, 0], dtype=np.int64))
    result = subprocess.run([sys.executable, "-m", "tessel.compiler.cli", "run", str(tmp_path / "gather.tessel"),
                             "--inputs", str(tmp_path / "bad.npz")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "node 'Gather_3': index 2147483648 out of range [-10, 9]" in result.stderr


def test_check_description_round_trips_and_foreign_errors_are_not_checks():
    check = IndexCheck("Gather", 1, (4096,), 0, 0)
    assert parse_check("tessel index check:" + check.describe()) == check
    assert parse_check("tessel index check:" + IndexCheck("GatherND", 0, (5, 7), 2, None).describe()).bounds == (5, 7)
    assert parse_check("list index out of range") is None


def test_first_violation_names_the_component_of_a_coordinate():
    check = IndexCheck("GatherND", 0, (2, 10), 1, 0)
    assert check.first_violation(np.array([[1, 9], [-2, -10]])) is None
    assert check.first_violation(np.array([[1, 9], [1, 10]])) == (10, 10, 2)
    assert check.first_violation(np.array([[-3, 0], [1, 10]])) == (-3, 2, 1)


def _gather_nd_model(batch_dims, indices_shape, output_shape):
    node = helper.make_node("GatherND", ["w", "i"], ["y"], batch_dims=batch_dims, name="gather_nd")
    return _model([node], [helper.make_tensor_value_info("i", TensorProto.INT64, indices_shape)], output_shape,
                  initializers=(WEIGHT.reshape(2, 5, 4),))


def test_gather_nd_checks_each_coordinate_against_its_axis(kernel_cache):
    model = _gather_nd_model(0, [3, 2], [3, 4])
    artifact = compile(model, input_shapes={"i": (3, 2)}, cache_dir=kernel_cache)
    good = np.array([[1, 4], [-1, -5], [0, 3]], dtype=np.int64)
    np.testing.assert_array_equal(artifact.run({"i": good})["y"], run_onnxruntime(model, {"i": good})[0])
    for bad, message in (([[0, 5]], r"index 5 out of range \[-5, 4\] on axis 1"), ([[2, 0]], r"index 2 out of range \[-2, 1\] on axis 0")):
        indices = np.concatenate([good[:2], np.array(bad, dtype=np.int64)])
        with pytest.raises(ExecutionError, match=rf"^node 'gather_nd': {message} of 'w'"):
            artifact.run({"i": indices})


def test_gather_nd_with_batch_dims_equals_onnxruntime(kernel_cache):
    model = _gather_nd_model(1, [2, 1], [2, 4])
    artifact = compile(model, input_shapes={"i": (2, 1)}, cache_dir=kernel_cache)
    indices = np.array([[3], [-2]], dtype=np.int64)
    np.testing.assert_array_equal(artifact.run({"i": indices})["y"], run_onnxruntime(model, {"i": indices})[0])
    with pytest.raises(ExecutionError, match=r"index 5 out of range \[-5, 4\] on axis 1"):
        artifact.run({"i": np.array([[0], [5]], dtype=np.int64)})


def test_one_hot_out_of_range_gives_a_row_of_off_values_as_onnx_says(kernel_cache):
    node = helper.make_node("OneHot", ["i", "depth", "values"], ["y"], axis=-1)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("i", TensorProto.INT64, [5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 4])],
        [numpy_helper.from_array(np.array(4, np.int64), "depth"), numpy_helper.from_array(np.array([-1, 2], np.float32), "values")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifact = compile(model, input_shapes={"i": (5,)}, cache_dir=kernel_cache)
    indices = np.array([0, -1, 4, -5, 2**40], dtype=np.int64)
    np.testing.assert_array_equal(artifact.run({"i": indices})["y"], run_onnxruntime(model, {"i": indices})[0])


MINIGPT = next(m for m in CORPUS if m.name == "minigpt_small")


@pytest.fixture(scope="module")
def minigpt(kernel_cache):
    return compile(str(MINIGPT.path), input_shapes=MINIGPT.input_shapes, cache_dir=kernel_cache, profile=False)


@pytest.mark.parametrize("token", [5000, 100000])
def test_minigpt_rejects_token_ids_outside_its_vocabulary(minigpt, token):
    ids = MINIGPT.make_inputs()["input_ids"]
    ids[0, 5] = token
    with pytest.raises(ExecutionError, match=rf"index {token} out of range \[-4096, 4095\] on axis 0 of 'wte.weight'"):
        minigpt.run({"input_ids": ids})


def test_minigpt_valid_token_ids_equal_onnxruntime(minigpt):
    feeds = MINIGPT.make_inputs()
    feeds["input_ids"][0, :2] = [4095, 0]
    got = minigpt.run(feeds)
    want = run_onnxruntime(str(MINIGPT.path), feeds)
    np.testing.assert_allclose(list(got.values())[0], want[0], rtol=1e-3, atol=1e-4)


SCATTER_UPDATES = -np.arange(1, 9, dtype=np.float32).reshape(2, 4)


def _scatter_model(node, indices_shape, updates_shape):
    inputs = [helper.make_tensor_value_info("i", TensorProto.INT64, indices_shape),
              helper.make_tensor_value_info("u", TensorProto.FLOAT, updates_shape)]
    model = _model([node], inputs, [10, 4])
    model.opset_import[0].version = 18
    return model


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_elements_writes_in_range_and_refuses_out_of_range(reduction, kernel_cache):
    node = helper.make_node("ScatterElements", ["w", "i", "u"], ["y"], axis=0, reduction=reduction, name="scatter")
    model = _scatter_model(node, [2, 4], [2, 4])
    artifact = compile(model, input_shapes={"i": (2, 4), "u": (2, 4)}, cache_dir=kernel_cache)
    indices = np.array([[0, -1, 3, 9], [2, 2, -10, 5]], dtype=np.int64)
    feeds = {"i": indices, "u": SCATTER_UPDATES}
    np.testing.assert_array_equal(artifact.run(feeds)["y"], run_onnxruntime(model, feeds)[0])
    indices[1, 2] = 2**31
    with pytest.raises(ExecutionError, match=r"^node 'scatter': index 2147483648 out of range \[-10, 9\] on axis 0 of 'w'"):
        artifact.run(feeds)


def test_scatter_nd_writes_in_range_and_refuses_out_of_range(kernel_cache):
    node = helper.make_node("ScatterND", ["w", "i", "u"], ["y"], name="scatter_nd")
    model = _scatter_model(node, [2, 1], [2, 4])
    artifact = compile(model, input_shapes={"i": (2, 1), "u": (2, 4)}, cache_dir=kernel_cache)
    feeds = {"i": np.array([[3], [-1]], dtype=np.int64), "u": SCATTER_UPDATES}
    np.testing.assert_array_equal(artifact.run(feeds)["y"], run_onnxruntime(model, feeds)[0])
    feeds["i"] = np.array([[3], [-11]], dtype=np.int64)
    with pytest.raises(ExecutionError, match=r"^node 'scatter_nd': index -11 out of range \[-10, 9\] on axis 0 of 'w'"):
        artifact.run(feeds)


INDEX_NODE_TESTS = [
    "test_gather_2d_indices", "test_gather_elements_negative_indices", "test_gathernd_example_int32_batch_dim1",
    "test_gathernd_example_float32", "test_scatter_elements_with_duplicate_indices",
    "test_scatter_elements_with_negative_indices", "test_scatter_elements_with_reduction_min", "test_scatternd_add",
    "test_scatternd_multiply", "test_scatternd_max_with_element_indices",
]


@pytest.mark.parametrize("name", INDEX_NODE_TESTS)
def test_onnx_node_tests_of_index_ops(name, kernel_cache):
    from tests.backends.test_kernel import test_onnx_node_test_through_the_backend

    test_onnx_node_test_through_the_backend(name, kernel_cache)


def test_a_worker_of_a_data_parallel_run_reports_the_bad_index(kernel_cache):
    nodes = [helper.make_node("Gather", ["w", "i"], ["rows"], axis=0, name="embed"),
             helper.make_node("Relu", ["rows"], ["y"], name="relu")]
    model = _model(nodes, [helper.make_tensor_value_info("i", TensorProto.INT64, [4, 3])], [4, 3, 4])
    artifact = compile(model, input_shapes={"i": (4, 3)}, cache_dir=kernel_cache, devices=2, placement="data", profile=False)
    indices = np.zeros((4, 3), dtype=np.int64)
    indices[3, 1] = 12  # in the second half of the batch: rank 1's slice
    with pytest.raises(ExecutionError, match=r"^rank 1: node 'embed': index 12 out of range \[-10, 9\] on axis 0 of 'w'"):
        artifact.run({"i": indices})
