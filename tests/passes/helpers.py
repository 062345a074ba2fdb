"""Building small graphs and checking passes against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx

from tessel import ir
from tessel.compiler.corpus import CorpusModel
from tessel.compiler.pipeline import PIPELINE
from tessel.ir.graph import Graph
from tests.conftest import run_onnxruntime
from tests.ir.helpers import model

__all__ = ["model", "graph_of", "ops", "assert_graph_matches", "corpus_after", "run_passes_until"]


def graph_of(onnx_model: onnx.ModelProto) -> Graph:
    """The imported graph of a small test model."""
    return ir.from_onnx(onnx_model)


def ops(graph: Graph) -> list[str]:
    """Op types of the graph's top-level nodes, in order."""
    return [n.op_type for n in graph.nodes]


def assert_graph_matches(original, graph: Graph, feeds: dict[str, np.ndarray], rtol=1e-4, atol=1e-5) -> None:
    """The graph, exported to ONNX (checked), gives the original model's outputs in onnxruntime."""
    ir.verify(graph)
    exported = ir.to_onnx(graph)
    onnx.checker.check_model(exported, full_check=True)
    expected = run_onnxruntime(original, feeds)
    got = run_onnxruntime(exported, feeds)
    assert len(expected) == len(got)
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have, want, rtol=rtol, atol=atol)


def run_passes_until(graph: Graph, last: str) -> Graph:
    """Run the pipeline up to and including the pass named `last`, verifying after each."""
    for p in PIPELINE:
        graph = p(graph).graph
        ir.verify(graph)
        if p.name == last:
            return graph
    raise AssertionError(f"no pass {last}")


def corpus_after(corpus_model: CorpusModel, last: str) -> None:
    """A corpus model after the pipeline up to `last` still equals onnxruntime on the original."""
    graph = run_passes_until(ir.from_onnx(str(corpus_model.path), corpus_model.input_shapes), last)
    assert_graph_matches(str(corpus_model.path), graph, corpus_model.make_inputs(), rtol=1e-3, atol=1e-4)
