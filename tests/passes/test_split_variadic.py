"""split_variadic: Concat/Sum/Max/Min/Mean with many inputs become trees of bounded fan-in that compute the same."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel.compiler.api import compile
from tessel.passes.split_variadic import MAX_FAN_IN, split_variadic
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F

from .helpers import assert_graph_matches, graph_of, model, ops


def _variadic(op: str, count: int, shapes=None, out_shape=(2, 3), **attrs):
    names = [f"x{i}" for i in range(count)]
    shapes = shapes or [[2, 3]] * count
    return model([helper.make_node(op, names, ["y"], **attrs)], [(n, F, s) for n, s in zip(names, shapes)],
                 [("y", F, list(out_shape))], opset=13)


def _feeds(m, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in m.graph.input}


def _max_fan_in(graph) -> int:
    return max(len(node.inputs) for node in graph.nodes)


@pytest.mark.parametrize("op", ["Sum", "Max", "Min", "Mean"])
def test_a_reduction_of_many_inputs_becomes_a_tree_with_the_same_result(op):
    # Broadcasting inputs: rows, columns and full tensors mixed.
    shapes = [[2, 3], [1, 3], [2, 1], [3]] * 25
    m = _variadic(op, len(shapes), shapes)
    graph = graph_of(m)
    result = split_variadic(graph)
    assert result.changed and result.stats["ops_split"] == 1
    assert _max_fan_in(graph) <= MAX_FAN_IN and "Mean" not in ops(graph)
    assert_graph_matches(m, graph, _feeds(m))


def test_a_concat_of_many_inputs_keeps_their_order():
    m = _variadic("Concat", 1000, [[1, 2]] * 1000, out_shape=(1, 2000), axis=1)
    graph = graph_of(m)
    split_variadic(graph)
    assert _max_fan_in(graph) <= MAX_FAN_IN and set(ops(graph)) == {"Concat"}
    assert len(graph.nodes) == 32 + 1  # 1,000 → 32 groups → root
    assert_graph_matches(m, graph, _feeds(m))


def test_few_inputs_are_left_alone():
    m = _variadic("Sum", MAX_FAN_IN)
    graph = graph_of(m)
    assert not split_variadic(graph).changed and ops(graph) == ["Sum"]


def test_a_graph_output_keeps_its_name():
    m = _variadic("Max", 100)
    graph = graph_of(m)
    split_variadic(graph)
    assert [v.name for v in graph.outputs] == ["y"]


def _wide_model(count: int, concat_count: int, distinct: int | None = None):
    """y = Sum and z = Concat of `count` and `concat_count` [1, 2] inputs: x0, x1, ... (cycling through `distinct`)."""
    distinct = distinct or count
    names = [f"x{i % distinct}" for i in range(count)]
    return model([helper.make_node("Sum", names, ["y"]), helper.make_node("Concat", names[:concat_count], ["z"], axis=1)],
                 [(f"x{i}", F, [1, 2]) for i in range(distinct)], [("y", F, [1, 2]), ("z", F, [1, 2 * concat_count])],
                 opset=13)


def _compiles_and_equals_onnxruntime(m, cache) -> None:
    feeds = _feeds(m)
    artifact = compile(m, cache_dir=cache)
    assert_matches_onnxruntime(artifact.run(feeds), run_onnxruntime(m, feeds), rtol=1e-5, atol=1e-4)


def test_a_concat_of_1500_and_a_sum_of_3000_inputs_compile_and_equal_onnxruntime(kernel_cache):
    _compiles_and_equals_onnxruntime(_wide_model(3000, 1500), kernel_cache)


def test_a_sum_and_a_concat_of_10000_inputs_compile_and_equal_onnxruntime(kernel_cache):
    # 10,000 inputs to each op, over 97 graph inputs (the memory planner is quadratic in graph inputs).
    _compiles_and_equals_onnxruntime(_wide_model(10_000, 10_000, distinct=97), kernel_cache)


@pytest.mark.slow
def test_a_model_of_10000_distinct_inputs_compiles(kernel_cache):
    _compiles_and_equals_onnxruntime(_wide_model(10_000, 10_000), kernel_cache)
