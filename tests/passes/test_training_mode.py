"""passes/training_mode.py: PyTorch models exported to ONNX, given training and evaluation semantics, equal
PyTorch's train-mode and eval-mode forward passes and, through passes/autodiff.py, its parameter gradients
(graphs run by ir/interpret.py)."""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from tessel import ir
from tessel.compiler.api import compile
from tessel.ir.errors import ModelImportError
from tessel.ir.interpret import interpret
from tessel.passes.autodiff import differentiate
from tessel.passes.base import add_op
from tessel.passes.training_mode import TrainingModel, prepare_eval, prepare_training
from tests.conftest import run_onnxruntime

# The legacy exporter's tracer warns about every RNN it traces; the tests export fixed shapes on purpose.
pytestmark = [pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
              pytest.mark.filterwarnings("ignore:Exporting a model to ONNX with a batch_size:UserWarning")]


def _export(module: torch.nn.Module, x: torch.Tensor, outputs: list[str],
            training=torch.onnx.TrainingMode.EVAL) -> bytes:
    f = io.BytesIO()
    torch.onnx.export(module, (x,), f, dynamo=False, do_constant_folding=False, input_names=["x"],
                      output_names=outputs, training=training)
    return f.getvalue()


def _run(graph: ir.Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The graph's outputs by name (from ir/interpret.py)."""
    return interpret(graph, {v.name: feeds[v.name] for v in graph.inputs})


def _gradients(model: TrainingModel, output: str, feeds: dict[str, np.ndarray],
               weights: np.ndarray) -> dict[str, np.ndarray]:
    """d sum(output * weights) / d parameter for every parameter, by autodiff on the training graph."""
    graph = model.graph
    product = add_op(graph, "Mul", [graph.lookup(output), graph.add_constant("loss_weights", weights)]).outputs[0]
    loss = add_op(graph, "ReduceSum", [product], {"keepdims": 0}).outputs[0]
    grads = differentiate(graph, loss, [graph.lookup(name) for name in model.parameters])
    graph.outputs += list(grads.values())
    outputs = _run(graph, feeds)
    return {name: outputs[grad.name] for name, grad in grads.items()}


def _check_gradients(model: TrainingModel, module: torch.nn.Module, output, feeds, rtol=1e-4, atol=1e-5) -> None:
    """Autodiff's parameter gradients of the training graph equal PyTorch's (after its forward gave `output`)."""
    weights = np.random.default_rng(2).standard_normal(output.shape).astype(np.float32)
    module.zero_grad()
    (output * torch.from_numpy(weights)).sum().backward()
    expected = {name: p.grad.numpy() for name, p in module.named_parameters()}
    got = _gradients(model, model.model_outputs[0], feeds, weights)
    assert set(got) == set(expected)
    for name, grad in got.items():
        np.testing.assert_allclose(grad, expected[name], rtol=rtol, atol=atol, err_msg=name)


class _Masked(torch.nn.Module):
    """Dropout with a given mask (already scaled by 1/(1-p)), as the training graph's mask input does."""

    def __init__(self, mask: np.ndarray):
        super().__init__()
        self.mask = torch.from_numpy(mask)

    def forward(self, x):
        return x * self.mask


# The CNN's BatchNorm buffers: persistent, not trainable.
_RUNNING = {f"{bn}.running_{stat}" for bn in ("bn", "bn1") for stat in ("mean", "var")}


class _CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.3)
        self.fc = torch.nn.Linear(64, 3)
        self.bn1 = torch.nn.BatchNorm1d(3, momentum=0.2)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.bn1(self.fc(self.drop(y.flatten(1))))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _check_updates(model, outputs: dict, module: torch.nn.Module) -> None:
    buffers = {k: v.numpy() for k, v in module.named_buffers() if "running" in k}
    assert set(model.state_updates) == set(buffers)
    for name, output in model.state_updates.items():
        np.testing.assert_allclose(outputs[output], buffers[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_cnn_exported_for_inference_trains_with_batch_statistics():
    module, x = _CNN(), torch.randn(3, 1, 8, 8)
    data = _export(module.eval(), x, ["y"])
    model = prepare_training(ir.from_onnx(data, training=True))
    # A fresh BN's running stats equal bn.weight/bn.bias: the exporter wrote them as Identity aliases.
    assert model.parameters == ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias",
                                "bn1.weight", "bn1.bias"]
    assert set(model.state) == set(model.parameters) | _RUNNING
    assert {v.name for v in model.graph.inputs} == {"x"} | set(model.state)
    assert not model.dropout_masks and model.model_outputs == ["y"]
    assert {n.op_type for n in model.graph.nodes}.isdisjoint({"BatchNormalization", "Identity"})
    with torch.no_grad():
        expected_eval = module.eval()(x).numpy()
    module.train()
    module.drop.eval()  # the inference export has no Dropout left
    expected = module(x)
    feeds = {"x": x.numpy(), **model.state}
    outputs = _run(model.graph, feeds)
    np.testing.assert_allclose(outputs["y"], expected.detach().numpy(), rtol=1e-4, atol=1e-5)
    _check_updates(model, outputs, module)
    evaluation = prepare_eval(ir.from_onnx(data, training=True), model.state)
    assert [v.name for v in evaluation.inputs] == [v.name for v in model.graph.inputs]
    np.testing.assert_allclose(_run(evaluation, feeds)["y"], expected_eval, rtol=1e-4, atol=1e-5)
    _check_gradients(model, module, expected, feeds)


def test_cnn_exported_for_training_takes_a_dropout_mask_and_updates_running_stats():
    module, x = _CNN(), torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        for bn in (module.bn, module.bn1):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    data = _export(module.train(), x, ["y"], torch.onnx.TrainingMode.TRAINING)
    model = prepare_training(ir.from_onnx(data, training=True))
    (mask_name, ratio), = model.dropout_masks.items()
    assert ratio == 0.3 and model.graph.lookup(mask_name).type.shape == (3, 64)
    mask = (np.random.default_rng(0).random((3, 64)) >= ratio).astype(np.float32) / (1 - ratio)
    with torch.no_grad():
        expected_eval = module.eval()(x).numpy()
    module.train()
    module.drop = _Masked(mask)
    expected = module(x)
    feeds = {"x": x.numpy(), mask_name: mask, **model.state}
    outputs = _run(model.graph, feeds)
    np.testing.assert_allclose(outputs["y"], expected.detach().numpy(), rtol=1e-4, atol=1e-5)
    _check_updates(model, outputs, module)
    evaluation = prepare_eval(ir.from_onnx(data, training=True), model.state)
    assert {n.op_type for n in evaluation.nodes}.isdisjoint({"Dropout"})
    np.testing.assert_allclose(_run(evaluation, feeds)["y"], expected_eval, rtol=1e-4, atol=1e-5)
    _check_gradients(model, module, expected, feeds)


def test_trainable_and_frozen_select_parameters_and_frozen_ones_stay_constants():
    data = _export(_CNN().eval(), torch.randn(3, 1, 8, 8), ["y"])
    model = prepare_training(ir.from_onnx(data, training=True), trainable=r"^(fc|bn)\.", frozen=r"bias$")
    assert model.parameters == ["bn.weight", "fc.weight"]
    assert set(model.state) == {"bn.weight", "fc.weight"} | _RUNNING
    constants = {v.name for v in model.graph.constants}
    assert {"conv.weight", "conv.bias", "bn.bias", "fc.bias", "bn1.weight"} <= constants
    frozen_stats = prepare_training(ir.from_onnx(data, training=True), frozen=r"running")
    assert not frozen_stats.state_updates and not any("running" in name for name in frozen_stats.state)
    cases = [(True, {"trainable": "^decoder"}, r"trainable='\^decoder' leave\(s\) no parameter to train; the "
                                               r"model's float initializers are conv.weight, conv.bias"),
             (True, {"frozen": "("}, r"frozen='\(' is not a valid regular expression"),
             (False, {}, r"no float initializers to train \(import it with from_onnx\(\.\.\., training=True\)")]
    for training, options, message in cases:
        with pytest.raises(ModelImportError, match=message):
            prepare_training(ir.from_onnx(data, training=training), **options)


class _Classifier(torch.nn.Module):
    def __init__(self, cell, bidirectional: bool):
        super().__init__()
        self.rnn = cell(5, 6, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.fc = torch.nn.Linear(12 if bidirectional else 6, 3)

    def forward(self, x):
        y, state = self.rnn(x)
        return self.fc(y[:, -1]), state[0] if isinstance(state, tuple) else state


@pytest.mark.parametrize("bidirectional", [False, True], ids=["forward", "bidirectional"])
@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU], ids=["lstm", "gru"])
def test_rnn_classifier_unrolls_to_primitive_ops_equal_to_pytorch(cell, bidirectional):
    module, x = _Classifier(cell, bidirectional).eval(), torch.randn(2, 4, 5)
    data = _export(module, x, ["y", "h"])
    model = prepare_training(ir.from_onnx(data, training=True))
    assert {n.op_type for n in model.graph.nodes}.isdisjoint({"LSTM", "GRU"})
    assert set(model.parameters) == {name for name, _ in module.named_parameters()}
    assert set(model.state) == set(model.parameters)
    for name, parameter in module.named_parameters():
        np.testing.assert_array_equal(model.state[name], parameter.detach().numpy())
    expected = module(x)
    feeds = {"x": x.numpy(), **model.state}
    outputs = _run(model.graph, feeds)
    for name, want in zip(("y", "h"), expected):
        np.testing.assert_allclose(outputs[name], want.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    evaluation = prepare_eval(ir.from_onnx(data, training=True), model.state)
    assert cell.__name__ in {n.op_type for n in evaluation.nodes}
    np.testing.assert_allclose(_run(evaluation, feeds)["y"], expected[0].detach().numpy(), rtol=1e-5, atol=1e-6)
    _check_gradients(model, module, expected[0], feeds)


def _rnn_model(op: str, attrs: dict, sequence_lens: bool = False) -> onnx.ModelProto:
    """x [2, 1, 3] -> op (hidden 2) -> y, with random W, R, B."""
    gates = 4 if op == "LSTM" else 3
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("W", (1, gates * 2, 3)), ("R", (1, gates * 2, 2)), ("B", (1, gates * 4)))]
    inputs = ["x", "W", "R", "B"]
    if sequence_lens:
        inits.append(numpy_helper.from_array(np.array([2], np.int32), "lens"))
        inputs.append("lens")
    node = helper.make_node(op, inputs, ["y"], hidden_size=2, **attrs)
    graph = helper.make_graph([node], "rnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op, attrs, lens, message", [
    ("LSTM", {}, True, "sequence_lens is not supported"),
    ("GRU", {"activations": ["Sigmoid", "Relu"]}, False, "activations .* are not supported"),
    ("LSTM", {"clip": 1.0}, False, "'clip' is not supported"),
], ids=["sequence_lens", "activations", "clip"])
def test_rnn_features_the_unrolling_does_not_model_fail_with_one_clear_line(op, attrs, lens, message):
    graph = ir.from_onnx(_rnn_model(op, attrs, lens), training=True)
    with pytest.raises(ModelImportError, match=message) as error:
        prepare_training(graph)
    assert "\n" not in str(error.value) and f"({op})" in str(error.value)


def _onnx_rnn(op: str, direction: str, attrs: dict, initial_state: bool, peepholes: bool, rng) -> onnx.ModelProto:
    """x [3, 2, 2] -> op (hidden 3) -> every output, with random W, R, B and optional initial states, peepholes."""
    gates, dirs = (4 if op == "LSTM" else 3), (2 if direction == "bidirectional" else 1)
    shapes = {"W": (dirs, gates * 3, 2), "R": (dirs, gates * 3, 3), "B": (dirs, gates * 6)}
    names = ["x", "W", "R", "B", ""]
    if initial_state:
        shapes.update({"h0": (dirs, 2, 3), **({"c0": (dirs, 2, 3)} if op == "LSTM" else {})})
        names += ["h0", "c0"] if op == "LSTM" else ["h0"]
    if peepholes:
        shapes["P"] = (dirs, 9)
        names += [""] * (7 - len(names)) + ["P"]
    outputs = ["y", "y_h", "y_c"] if op == "LSTM" else ["y", "y_h"]
    node = helper.make_node(op, names, outputs, hidden_size=3, direction=direction, **attrs)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in shapes.items()]
    graph = helper.make_graph([node], "rnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2, 2])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_unrolled_lstm_and_gru_equal_onnx_semantics_in_every_form(direction):
    rng = np.random.default_rng(0)
    forms = [("LSTM", {}, state, peep) for state in (False, True) for peep in (False, True)]
    forms += [("GRU", {"linear_before_reset": lbr}, state, False) for lbr in (0, 1) for state in (False, True)]
    for op, attrs, initial_state, peepholes in forms:
        onnx_model = _onnx_rnn(op, direction, attrs, initial_state, peepholes, rng)
        x = rng.standard_normal((3, 2, 2)).astype(np.float32)
        model = prepare_training(ir.from_onnx(onnx_model, training=True))
        got = _run(model.graph, {"x": x, **model.state})
        for name, want in zip(got, run_onnxruntime(onnx_model, {"x": x})):
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{op} {attrs} {name}")


def test_unrolled_gru_compiles_and_runs_through_the_inference_pipeline(kernel_cache):
    onnx_model = _rnn_model("GRU", {"linear_before_reset": 1})
    model = prepare_training(ir.from_onnx(onnx_model, training=True))
    artifact = compile(ir.to_onnx(model.graph), cache_dir=kernel_cache)
    x = np.random.default_rng(1).standard_normal((2, 1, 3)).astype(np.float32)
    expected, = run_onnxruntime(onnx_model, {"x": x})
    np.testing.assert_allclose(artifact.run({"x": x, **model.state})["y"], expected, rtol=1e-4, atol=1e-5)


def test_training_import_keeps_the_path_from_an_initializer_that_inference_import_folds():
    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"]),
             helper.make_node("Mul", ["y", "two"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 2])],
                              [numpy_helper.from_array(weight, "w"),
                               numpy_helper.from_array(np.array(2, np.float32), "two"),
                               numpy_helper.from_array(np.array([7], np.int64), "unused")])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert [n.op_type for n in ir.from_onnx(onnx_model).nodes] == ["MatMul", "Mul"]
    imported = ir.from_onnx(onnx_model, training=True)
    assert imported.initializers == {"w", "two"}
    model = prepare_training(imported, frozen="two")
    assert [n.op_type for n in model.graph.nodes] == ["Transpose", "MatMul", "Mul"]
    assert model.parameters == ["w"] and [v.name for v in model.graph.inputs] == ["x", "w"]
    x = np.ones((4, 3), np.float32)
    np.testing.assert_array_equal(_run(model.graph, {"x": x, **model.state})["z"], 2 * x @ weight.T)


def test_dropout_of_ratio_zero_passes_its_input_through():
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Dropout", ["xw", "ratio"], ["y"]),
             helper.make_node("Relu", ["y"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.full(3, 2, np.float32), "w"),
                               numpy_helper.from_array(np.array(0.0, np.float32), "ratio")])
    model = prepare_training(ir.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                          training=True))
    assert [n.op_type for n in model.graph.nodes] == ["Mul", "Relu"] and not model.dropout_masks
    assert model.parameters == ["w"]  # the ratio is the op's setting, not a parameter


def test_training_mode_batch_norm_whose_running_stat_outputs_are_read_returns_pytorchs_updates():
    rng = np.random.default_rng(0)
    values = {"scale": rng.standard_normal(2), "bias": rng.standard_normal(2), "mean": rng.standard_normal(2),
              "var": rng.uniform(0.5, 2, 2)}
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "new_mean", "new_var"],
                            training_mode=1, momentum=0.8)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2, 4])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in values.items()])
    model = prepare_training(ir.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                          training=True))
    assert model.model_outputs == ["y", "new_mean", "new_var"] and set(model.state_updates) == {"mean", "var"}
    x = rng.standard_normal((3, 2, 4)).astype(np.float32)
    outputs = _run(model.graph, {"x": x, **model.state})
    mean, var = x.mean(axis=(0, 2)), x.var(axis=(0, 2))
    expected_mean, expected_var = 0.8 * values["mean"] + 0.2 * mean, 0.8 * values["var"] + 0.2 * var * 12 / 11
    for name, want in (("new_mean", expected_mean), ("new_var", expected_var)):
        np.testing.assert_allclose(outputs[name], want, rtol=1e-5)
        stat = name.removeprefix("new_")
        np.testing.assert_allclose(outputs[model.state_updates[stat]], want, rtol=1e-5)
    normalized = (x - mean[:, None]) / np.sqrt(var[:, None] + 1e-5)
    np.testing.assert_allclose(outputs["y"], normalized * values["scale"][:, None] + values["bias"][:, None],
                               rtol=1e-4, atol=1e-5)
