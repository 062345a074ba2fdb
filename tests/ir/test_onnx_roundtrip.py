"""Every corpus model imports, verifies, exports, and its export equals onnxruntime on the original."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from tessel import ir
from tests.conftest import NEGATIVE, POSITIVE, by_name, run_onnxruntime


@pytest.mark.parametrize("model", by_name(POSITIVE))
def test_corpus_model_import_export_matches_onnxruntime(model):
    graph = ir.from_onnx(model.path, model.input_shapes)
    ir.verify(graph)
    exported = ir.to_onnx(graph)
    onnx.checker.check_model(exported, full_check=True)
    feeds = model.make_inputs()
    expected = run_onnxruntime(str(model.path), feeds)
    actual = run_onnxruntime(exported, feeds)
    assert len(actual) == len(expected)
    for want, got in zip(expected, actual):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", by_name(NEGATIVE))
def test_unsupported_model_lists_every_unsupported_op(model):
    with pytest.raises(ir.UnsupportedModelError) as info:
        ir.from_onnx(model.path, model.input_shapes)
    reported = {(op, domain or "ai.onnx") for op, domain, *_ in info.value.unsupported}
    proto = onnx.load(str(model.path))
    foreign = {(n.op_type, n.domain) for n in proto.graph.node if n.domain not in ("", "ai.onnx")}
    assert foreign <= reported
    message = str(info.value)
    for op, domain in reported:
        assert op in message and domain in message
    assert "\n" not in message


def test_silero_runtime_if_stays_an_if_with_two_typed_branches():
    model = next(m for m in POSITIVE if m.name == "silero_vad")
    graph = ir.from_onnx(model.path, model.input_shapes)
    ifs = [n for n in graph.nodes if n.op_type == "If"]
    assert len(ifs) == 1
    then_branch, else_branch = ifs[0].attrs["then_branch"], ifs[0].attrs["else_branch"]
    assert [v.type for v in then_branch.outputs] == [v.type for v in else_branch.outputs]
    # At 512 samples only the 16 kHz branch can run; the other fails at run time, as in onnxruntime.
    assert any(n.op_type == "Unreachable" for n in else_branch.nodes)
    assert any(n.op_type == "LSTM" for n in then_branch.walk_nodes())


def test_every_tensor_is_static_after_import_of_a_dynamic_model():
    model = next(m for m in POSITIVE if m.name == "yolov8n_320")
    graph = ir.from_onnx(model.path, model.input_shapes)
    shape_ops = {"Shape", "Range", "ConstantOfShape", "Size"}
    assert not shape_ops & {n.op_type for n in graph.walk_nodes()}
    assert all(all(d >= 0 for d in v.type.shape) for v in graph.values())
