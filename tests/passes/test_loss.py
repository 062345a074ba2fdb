"""passes/loss.py: each loss gives torch.nn.functional's number, and bad specs get one clear error."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from tessel import ir
from tessel.ir.graph import Graph
from tessel.passes.loss import LABELS, LossError, LossSpec, add_loss
from tests.conftest import run_onnxruntime


def _identity_model(shape, extra_output_shape=None) -> Graph:
    """A graph returning its input "x" (the logits) and, optionally, a second output "aux" = ReduceSum(x)."""
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if extra_output_shape is not None:
        nodes.append(helper.make_node("ReduceSum", ["x"], ["aux"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("aux", TensorProto.FLOAT, extra_output_shape))
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs)
    return ir.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))


def _loss_value(graph: Graph, spec: LossSpec, feeds: dict[str, np.ndarray]) -> float:
    added = add_loss(graph, spec)
    assert added.loss.type.shape == () and added.loss.type.dtype == "float32"
    graph.outputs = [added.loss]
    ir.verify(graph)
    model = ir.to_onnx(graph)
    onnx.checker.check_model(model, full_check=True)
    (loss,) = run_onnxruntime(model, feeds)
    return float(loss)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 4)])
def test_cross_entropy_matches_torch(shape, smoothing):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, shape[1], (shape[0], *shape[2:])).astype(np.int64)
    got = _loss_value(_identity_model(shape), LossSpec("cross_entropy", label_smoothing=smoothing),
                      {"x": x, LABELS: labels})
    want = F.cross_entropy(torch.from_numpy(x), torch.from_numpy(labels), label_smoothing=smoothing).item()
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("kind, torch_loss", [("mse", F.mse_loss), ("l1", F.l1_loss),
                                              ("bce_with_logits", F.binary_cross_entropy_with_logits)])
def test_regression_losses_match_torch(kind, torch_loss):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 4)) * 4).astype(np.float32)
    target = rng.random((3, 4)).astype(np.float32)
    got = _loss_value(_identity_model((3, 4)), LossSpec.parse(kind), {"x": x, LABELS: target})
    assert got == pytest.approx(torch_loss(torch.from_numpy(x), torch.from_numpy(target)).item(), rel=1e-6)


def test_model_output_is_the_loss():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for spec in (LossSpec.parse("output:1"), LossSpec.parse("aux")):
        graph = _identity_model((2, 3), extra_output_shape=[])
        assert add_loss(graph, spec).labels is None
        assert _loss_value(_identity_model((2, 3), extra_output_shape=[]), spec, {"x": x}) == 15.0


def test_one_element_output_is_reshaped_to_a_scalar():
    graph = _identity_model((1, 1))
    added = add_loss(graph, LossSpec.parse("output:0"))
    assert added.loss.type.shape == ()


@pytest.mark.parametrize("spec, message", [
    (LossSpec("hinge"), "unknown loss 'hinge'"),
    (LossSpec.parse("nope"), "unknown loss 'nope'"),
    (LossSpec.parse("output:3"), "no output 3"),
    (LossSpec.parse("output:0"), "is not a loss"),
    (LossSpec("mse", label_smoothing=0.1), "cross_entropy only"),
    (LossSpec("cross_entropy", label_smoothing=1.5), "must be in [0, 1]"),
])
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(LossError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        add_loss(_identity_model((2, 3)), spec)
    assert "\n" not in str(info.value)


def test_output_k_needs_a_number():
    with pytest.raises(LossError, match="output:K"):
        LossSpec.parse("output:x")
