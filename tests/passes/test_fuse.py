"""Fusion: groups follow the op patterns, never form cycles, export as ONNX functions and compile to one kernel."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel import ir
from tessel.compiler.api import compile
from tessel.ir.schema import FUSED
from tessel.passes.fuse import fuse, kernel_count
from tests.conftest import POSITIVE, assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F

from .helpers import assert_graph_matches, corpus_after, graph_of, model, ops, run_passes_until

RNG = np.random.default_rng(3)
X = ("x", F, [1, 4, 6, 6])


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _conv(inp, out, name="w"):
    return helper.make_node("Conv", [inp, name], [out], pads=[1, 1, 1, 1])


def _bodies(graph):
    return [ops(n.attrs["body"]) for n in graph.nodes if n.op_type == FUSED]


def test_conv_epilogue_fuses():
    m = model([_conv("x", "c"), helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])],
              [X], [("y", F, [1, 4, 6, 6])], [("w", _rand(4, 4, 3, 3))])
    graph = graph_of(m)
    result = fuse(graph)
    assert _bodies(graph) == [["Conv", "Relu", "Add"]] and ops(graph) == [FUSED]
    assert result.stats["groups"] == 1 and result.stats["intermediate_bytes_saved"] == 2 * 4 * 36 * 4
    assert_graph_matches(m, graph, {"x": _rand(1, 4, 6, 6)})


def _silu():
    return model([_conv("x", "c"), helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])],
                 [X], [("y", F, [1, 4, 6, 6])], [("w", _rand(4, 4, 3, 3))])


def test_silu_diamond_joins_the_conv():
    m = _silu()
    graph = graph_of(m)
    fuse(graph)
    assert _bodies(graph) == [["Conv", "Sigmoid", "Mul"]]
    assert_graph_matches(m, graph, {"x": _rand(1, 4, 6, 6)})


def test_injective_chain_and_reduction_with_producers_fuse():
    m = model([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]), helper.make_node("Neg", ["t"], ["n"]),
               helper.make_node("Softmax", ["n"], ["s"], axis=-1), helper.make_node("Exp", ["s"], ["y"])],
              [X], [("y", F, [1, 6, 6, 4])])
    graph = graph_of(m)
    fuse(graph)
    assert _bodies(graph) == [["Transpose", "Neg", "Softmax", "Exp"]]
    assert_graph_matches(m, graph, {"x": _rand(1, 4, 6, 6)})


def test_diverging_readers_and_opaque_ops_do_not_fuse():
    # The conv's output feeds two graph outputs: no single value could leave a group.
    m = model([_conv("x", "c"), helper.make_node("Relu", ["c"], ["a"]), helper.make_node("Sigmoid", ["c"], ["b"])],
              [X], [("a", F, [1, 4, 6, 6]), ("b", F, [1, 4, 6, 6])], [("w", _rand(4, 4, 3, 3))])
    graph = graph_of(m)
    assert not fuse(graph).changed and ops(graph) == ["Conv", "Relu", "Sigmoid"]


def test_a_group_never_waits_on_its_own_output():
    # Relu could join the conv, but MaxPool (not fusable) also reads the conv and feeds the Add:
    # fusing Relu with the conv and Add would make a cycle through MaxPool.
    m = model([_conv("x", "c"), helper.make_node("Relu", ["c"], ["r"]),
               helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
               helper.make_node("Add", ["r", "p"], ["y"])],
              [X], [("y", F, [1, 4, 6, 6])], [("w", _rand(4, 4, 3, 3))])
    graph = graph_of(m)
    fuse(graph)
    assert all("MaxPool" not in body or "Conv" not in body for body in _bodies(graph))
    assert_graph_matches(m, graph, {"x": _rand(1, 4, 6, 6)})


@pytest.mark.parametrize("name", ["resnet18", "yolov8n_320", "ppocr_v4_det", "minigpt_small"])
def test_fusion_halves_the_kernel_count(name):
    corpus_model = next(m for m in POSITIVE if m.name == name)
    graph = run_passes_until(ir.from_onnx(str(corpus_model.path), corpus_model.input_shapes), "dce")
    before = kernel_count(graph)
    fuse(graph)
    ir.verify(graph)
    assert kernel_count(graph) * 2 <= before


def test_corpus_model_after_fuse():
    """yolov8n_320: SiLU epilogues, concats and the detection head, exported with ONNX functions."""
    corpus_after(next(m for m in POSITIVE if m.name == "yolov8n_320"), "fuse")


def test_fused_kernels_compile_and_match(kernel_cache, tmp_path):
    m = _silu()
    feeds = {"x": _rand(1, 4, 6, 6)}
    artifact = compile(m, cache_dir=kernel_cache)
    assert artifact.report()["kernel_calls"] == 1
    unfused = compile(m, cache_dir=kernel_cache, skip_passes=["fuse"])
    assert unfused.report()["kernel_calls"] == 3
    expected = run_onnxruntime(m, feeds)
    assert_matches_onnxruntime(artifact.run(feeds), expected)
    assert_matches_onnxruntime(unfused.run(feeds), expected)
