"""JSON round trip and the text printer."""
from __future__ import annotations

import json

import pytest

from tessel import ir
from tessel.ir.printer import format_graph
from tessel.ir.serialize import from_json, to_json
from tests.conftest import POSITIVE, by_name

SMALL = [m for m in POSITIVE if m.name in ("silero_vad", "mtcnn_onet", "minigpt_small", "gru_classifier")]


@pytest.mark.parametrize("model", by_name(SMALL))
def test_json_round_trip_is_exact(model):
    graph = ir.from_onnx(model.path, model.input_shapes)
    text = to_json(graph)
    again = from_json(text)
    ir.verify(again)
    assert to_json(again) == text
    assert ir.to_onnx(again).SerializeToString() == ir.to_onnx(graph).SerializeToString()


def test_json_without_tensor_data_keeps_names_and_types_only():
    model = next(m for m in SMALL if m.name == "gru_classifier")
    graph = ir.from_onnx(model.path, model.input_shapes)
    text = to_json(graph, tensor_data=False)
    doc = json.loads(text)
    assert doc["tensor_data"] is False and '"data"' not in text
    assert [(c["name"], c["type"]) for c in doc["graph"]["constants"]] == [(v.name, v.type.spec()) for v in graph.constants]
    assert [n["name"] for n in doc["graph"]["nodes"]] == [n.name for n in graph.nodes]
    assert len(text) < sum(v.const.nbytes for v in graph.constants) / 10
    with pytest.raises(ir.SerializationError, match="without tensor data"):
        from_json(text)


def test_malformed_json_raises_serialization_error():
    with pytest.raises(ir.SerializationError):
        from_json('{"format": "tessel.graph", "version": 1, "graph": {"name": "g"}}')
    with pytest.raises(ir.SerializationError):
        from_json("not json")


def test_printer_shows_types_ops_and_subgraphs():
    model = next(m for m in POSITIVE if m.name == "silero_vad")
    text = format_graph(ir.from_onnx(model.path, model.input_shapes))
    assert text.startswith("graph ")
    assert "%input: f32[1,512]" in text
    assert "= If(" in text and "then_branch:" in text and "tessel::Unreachable" in text
    assert "= LSTM(" in text
