"""pool_concat: a pool over a channel Concat becomes a Concat of the pooled parts, with the same values."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import helper

from tessel.compiler.api import compile
from tessel.passes.pool_concat import pool_concat
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F

from .helpers import assert_graph_matches, graph_of, model, ops

CHANNELS = (16, 32, 8)


def _pool_of_concat(pool: str, axis: int = 1, extra_outputs=(), **attrs):
    """y = pool(Concat(x0, x1, x2)) over 4-D inputs of CHANNELS channels, 11x11 pixels."""
    names = [f"x{i}" for i in range(len(CHANNELS))]
    nodes = [helper.make_node("Concat", names, ["joined"], axis=axis),
             helper.make_node(pool, ["joined"], ["y", *extra_outputs], **attrs)]
    shapes = [[1, c, 11, 11] for c in CHANNELS] if axis == 1 else [[1, 8, 11 + i, 11] for i in range(len(CHANNELS))]
    outputs = [("y", F, None)] + [(name, F if k == 0 else 7, None) for k, name in enumerate(extra_outputs)]
    return model(nodes, [(n, F, s) for n, s in zip(names, shapes)], outputs, opset=13)


def _feeds(m, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in m.graph.input}


@pytest.mark.parametrize("pool, attrs", [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2]}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("AveragePool", {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1], "count_include_pad": 1}),
    ("GlobalAveragePool", {}),
    ("GlobalMaxPool", {}),
])
def test_a_pool_of_a_channel_concat_becomes_a_concat_of_pools(pool, attrs):
    m = _pool_of_concat(pool, **attrs)
    graph = graph_of(m)
    result = pool_concat(graph)
    assert result.changed and result.stats["pools_moved"] == 1
    assert ops(graph) == [pool] * len(CHANNELS) + ["Concat"]
    assert [v.name for v in graph.outputs] == ["y"]
    assert_graph_matches(m, graph, _feeds(m), rtol=1e-6, atol=1e-6)


def test_a_concat_along_the_rows_is_left_alone():
    m = _pool_of_concat("MaxPool", axis=2, kernel_shape=[3, 3], strides=[2, 2])
    graph = graph_of(m)
    assert not pool_concat(graph).changed and ops(graph) == ["Concat", "MaxPool"]


def test_a_concat_read_elsewhere_is_left_alone():
    m = _pool_of_concat("MaxPool", kernel_shape=[3, 3])
    m.graph.output.append(helper.make_tensor_value_info("joined", F, None))
    graph = graph_of(m)
    assert not pool_concat(graph).changed and ops(graph) == ["Concat", "MaxPool"]


def test_a_maxpool_whose_indices_are_read_is_left_alone():
    m = _pool_of_concat("MaxPool", extra_outputs=("indices",), kernel_shape=[3, 3])
    graph = graph_of(m)
    assert not pool_concat(graph).changed and ops(graph) == ["Concat", "MaxPool"]


def _fire_module():
    """SqueezeNet's fire module then its MaxPool, random weights: squeeze 1x1 conv, expand 1x1 and 3x3 convs (each
    ReLU), their Concat pooled 3x3 stride 2, then a 1x1 conv reading the pooled Concat."""
    rng = np.random.default_rng(1)

    def weight(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    nodes = [helper.make_node("Conv", ["x", "ws"], ["s"]), helper.make_node("Relu", ["s"], ["sr"]),
             helper.make_node("Conv", ["sr", "w1"], ["e1"]), helper.make_node("Relu", ["e1"], ["e1r"]),
             helper.make_node("Conv", ["sr", "w3"], ["e3"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["e3"], ["e3r"]),
             helper.make_node("Concat", ["e1r", "e3r"], ["cat"], axis=1),
             helper.make_node("MaxPool", ["cat"], ["pooled"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Conv", ["pooled", "wn"], ["y"])]
    weights = [("ws", weight(16, 32, 1, 1)), ("w1", weight(32, 16, 1, 1)), ("w3", weight(32, 16, 3, 3)),
               ("wn", weight(16, 64, 1, 1))]
    return model(nodes, [("x", F, [1, 32, 23, 23])], [("y", F, [1, 16, 11, 11])], weights, opset=13)


@pytest.mark.slow
def test_a_fire_module_and_its_pool_compile_and_equal_onnxruntime(kernel_cache):
    m = _fire_module()
    feeds = _feeds(m)
    artifact = compile(m, cache_dir=kernel_cache)
    nodes = json.loads((artifact.directory / "graph.json").read_text())["graph"]["nodes"]
    assert sum(node["op_type"] == "MaxPool" for node in nodes) == 2  # one pool per expand conv, not fused with Concat
    assert_matches_onnxruntime(artifact.run(feeds), run_onnxruntime(m, feeds))
