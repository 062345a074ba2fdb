"""one_hot_gather: a one-hot matrix times a constant weight becomes a Gather of the weight's rows."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from tessel import ir
from tessel.compiler.api import compile
from tessel.passes.constant_fold import constant_fold
from tessel.passes.one_hot_gather import one_hot_gather
from tests.conftest import POSITIVE, assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F

from .helpers import assert_graph_matches, graph_of, model, ops, run_passes_until

RNG = np.random.default_rng(11)
ROWS, CLASSES, N = 6, 10, 4


def _one_hot_model(classes=None, product: str = "Gemm", alpha: float = 1.0, beta: float = 1.0, extra_read=False,
                   index_type=TensorProto.INT32):
    """magika's embedding, small: x int32 [1, ROWS] → Equal with range(CLASSES) → float → [ROWS, CLASSES] · W
    (+ C). `classes` replaces the range; `extra_read` also returns the one-hot matrix; `index_type`: x's type."""
    dtype = helper.tensor_dtype_to_np_dtype(index_type)
    classes = np.arange(CLASSES, dtype=dtype) if classes is None else classes
    weights = [("w", RNG.standard_normal((CLASSES, N)).astype(np.float32)),
               ("c", RNG.standard_normal(N).astype(np.float32)), ("r", classes.reshape(1, 1, CLASSES)),
               ("column", np.array([-1, ROWS, 1], np.int64)), ("flat", np.array([-1, CLASSES], np.int64))]
    nodes = [helper.make_node("Reshape", ["x", "column"], ["xc"]), helper.make_node("Equal", ["xc", "r"], ["hot"]),
             helper.make_node("Cast", ["hot"], ["hotf"], to=TensorProto.FLOAT),
             helper.make_node("Reshape", ["hotf", "flat"], ["a"])]
    if product == "Gemm":
        nodes.append(helper.make_node("Gemm", ["a", "w", "c"], ["y"], alpha=alpha, beta=beta))
    else:
        nodes.append(helper.make_node("MatMul", ["a", "w"], ["y"]))
    outputs = [("y", F, None)] + ([("hotf", F, None)] if extra_read else [])
    return model(nodes, [("x", index_type, [1, ROWS])], outputs, weights)


# In range, the ends of the range, and outside it on both sides (a row of zeros: the bias alone).
FEEDS = {"x": np.array([[3, 0, 9, -1, 10, 57]], np.int32)}


def test_one_hot_products_become_gathers():
    for m in (_one_hot_model(), _one_hot_model(alpha=0.5, beta=2.0), _one_hot_model(product="MatMul")):
        graph = graph_of(m)
        constant_fold(graph)
        result = one_hot_gather(graph)
        assert result.changed and result.stats == {"one_hot_products": 1}
        assert "Gather" in ops(graph) and not {"Gemm", "MatMul", "Equal", "Cast"} & set(ops(graph))
        assert_graph_matches(m, graph, FEEDS)


def test_other_products_are_left_alone():
    # Classes that are not 0..K-1, a one-hot matrix read elsewhere too, and indices of a type Gather does not take.
    for m in (_one_hot_model(classes=np.arange(CLASSES, dtype=np.int32) * 2), _one_hot_model(extra_read=True),
              _one_hot_model(index_type=TensorProto.UINT8)):
        graph = graph_of(m)
        constant_fold(graph)
        assert not one_hot_gather(graph).changed and "Gemm" in ops(graph)


def test_gathered_embedding_compiles_and_equals_onnxruntime(kernel_cache):
    m = _one_hot_model()
    artifact = compile(m, cache_dir=kernel_cache)
    assert_matches_onnxruntime(artifact.run(FEEDS), run_onnxruntime(m, FEEDS))


def test_magika_embedding_is_a_gather():
    magika = next(m for m in POSITIVE if m.name == "magika")
    graph = run_passes_until(ir.from_onnx(str(magika.path), magika.input_shapes), "one_hot_gather")
    assert "Gather" in ops(graph) and "Equal" not in ops(graph)
    assert_graph_matches(str(magika.path), graph, magika.make_inputs(), rtol=1e-3, atol=1e-4)

