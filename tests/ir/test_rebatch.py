"""Re-batching a graph: the same graph at another batch, types inferred again, weights shared."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel import ir
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.ir.onnx_import import with_batch
from tessel.ir.rebatch import RebatchError, batch_size, clone, rebatched
from tests.conftest import CORPUS, by_name

from .helpers import F, model


def _types(graph):
    return {v.name: v.type for node in graph.nodes for v in node.outputs if v is not None}


def test_clone_is_independent_and_shares_weights():
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
              [("x", F, [4, 3])], [("z", F, [4, 2])], [("w", np.ones((3, 2), np.float32))])
    graph = ir.from_onnx(m)
    copy = clone(graph)
    ir.verify(copy)
    assert [n.name for n in copy.nodes] == [n.name for n in graph.nodes]
    assert copy.constants[0].const is graph.constants[0].const
    copy.inputs[0].type = ir.TensorType("float32", (2, 3))
    assert graph.inputs[0].type.shape == (4, 3)


def test_time_major_reshape_and_uniform_constants_follow_the_batch():
    # [T, B, C] → [T * B, C] → back to [T, B, C], plus a zero state of the batch's shape (as folded at import).
    m = model([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
               helper.make_node("Reshape", ["t", "flat"], ["f"]),
               helper.make_node("Reshape", ["f", "back"], ["b"]),
               helper.make_node("Add", ["b", "zeros"], ["y"])],
              [("x", F, [8, 5, 3])], [("y", F, [5, 8, 3])],
              [("flat", np.array([40, 3], np.int64)), ("back", np.array([5, 8, 3], np.int64)),
               ("zeros", np.zeros((5, 8, 3), np.float32))])
    graph = ir.from_onnx(m)
    small = rebatched(graph, 2)
    ir.verify(small)
    assert small.outputs[0].type.shape == (5, 2, 3) and batch_size(small) == 2
    assert graph.outputs[0].type.shape == (5, 8, 3)  # the original is untouched


def test_a_batch_pinned_beyond_recovery_names_the_node():
    m = model([helper.make_node("Add", ["x", "bias"], ["y"])], [("x", F, [4, 3])], [("y", F, [4, 3])],
              [("bias", np.arange(12, dtype=np.float32).reshape(4, 3))])
    with pytest.raises(RebatchError, match=r"node '.*' \(Add\) cannot run at batch 2 \(compiled at 4\)"):
        rebatched(ir.from_onnx(m), 2)


def test_inputs_disagreeing_on_the_batch_are_refused():
    m = model([helper.make_node("Add", ["x", "y"], ["z"])], [("x", F, [4, 3]), ("y", F, [1, 3])], [("z", F, [4, 3])])
    with pytest.raises(RebatchError, match="do not share a batch size"):
        rebatched(ir.from_onnx(m), 2)


REBATCHABLE = [m for m in CORPUS if m.name in ("captcha_crnn", "minigpt_small", "ppocr_v4_rec", "magika")]


@pytest.mark.parametrize("corpus_model", by_name(REBATCHABLE))
def test_optimized_corpus_graph_rebatched_types_match_an_import_at_that_batch(corpus_model):
    def optimized(batch):
        shapes = {k: (batch,) + tuple(v["shape"][1:]) for k, v in corpus_model.inputs.items() if v["shape"]}
        graph = ir.from_onnx(with_batch(ir.load_model(corpus_model.path), batch), shapes)
        return run_pipeline(graph, select_passes(()))[0]

    got = _types(rebatched(optimized(8), 2))
    want = _types(optimized(2))
    assert got.keys() == want.keys() and all(got[k] == want[k] for k in want)
