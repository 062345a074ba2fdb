"""The Trainer: a hand-built step (linear regression, exact SGD numbers) and a tiny model through
compile_training (Gemm, BatchNormalization, Dropout, cross-entropy, SGD with momentum): steps, evaluate,
checkpoints, ONNX export."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import tessel
from tessel.compiler.api import ModelSource
from tessel.compiler.checkpoint import StepNames
from tessel.compiler.optim import SGD
from tessel.compiler.options import CompileOptions
from tessel.compiler.trainer import Trainer, compile_step, load_training
from tessel.passes.loss import LossSpec
from tessel.passes.recompute import RecomputeError
from tessel.runtime.errors import ArtifactError, InputError
from tests.compiler.step_graphs import batch, inference_model, linear_step_graph, numpy_step
from tests.ir.helpers import F, model

RATE = 0.1
CLASSES = 3


def _fresh(trainer: Trainer) -> Trainer:
    """A new Trainer on the same artifacts, from the starting state."""
    return Trainer(trainer.step_artifact, trainer.eval_artifact, trainer.names, trainer.optimizer, trainer.seed,
                   trainer.model_bytes)


@pytest.fixture(scope="module")
def linear(kernel_cache):
    options = CompileOptions.create(None, cache_dir=kernel_cache)
    return compile_step(linear_step_graph(), ModelSource("linear", inference_model(), None, {}, 0.0), "mse",
                        SGD(lr=RATE), 7, options)


def _classifier():
    """logits = Dropout(BatchNormalization(x @ W^T + b), 0.25): a linear classifier."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h"], transB=1),
             helper.make_node("BatchNormalization", ["h", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["n"]),
             helper.make_node("Dropout", ["n", "ratio"], ["logits"])]
    return model(nodes, [("x", F, [8, 4])], [("logits", F, [8, CLASSES])],
                 [("W", (0.3 * rng.standard_normal((CLASSES, 4))).astype(np.float32)),
                  ("b", np.zeros(CLASSES, np.float32)), ("bn.scale", np.ones(CLASSES, np.float32)),
                  ("bn.bias", np.zeros(CLASSES, np.float32)), ("bn.mean", np.zeros(CLASSES, np.float32)),
                  ("bn.var", np.ones(CLASSES, np.float32)), ("ratio", np.array(0.25, np.float32))])


@pytest.fixture(scope="module")
def classifier(kernel_cache):
    return tessel.compile_training(_classifier(), loss="cross_entropy", optimizer=tessel.optim.SGD(lr=0.2, momentum=0.9),
                                   input_shapes={"x": (8, 4)}, seed=5, cache_dir=kernel_cache)


def _classes(seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)
    return {"x": x}, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)


def test_steps_follow_sgd_and_reduce_the_loss(linear):
    trainer = _fresh(linear)
    w, b = trainer.state["W"], trainer.state["b"]
    losses = []
    for seed in range(30):
        x, y = batch(seed)
        losses.append(trainer.step({"x": x}, y))
        want, w, b = numpy_step(w, b, x, y, RATE)
        assert losses[-1] == pytest.approx(want, rel=1e-4)
    assert trainer.steps_done == 30 and losses[-1] < 1e-3 * losses[0]
    np.testing.assert_allclose(trainer.state["W"], w, rtol=1e-4, atol=1e-6)


def test_evaluate_runs_the_model_on_the_current_state(linear):
    trainer = _fresh(linear)
    for seed in range(3):
        trainer.step({"x": batch(seed)[0]}, batch(seed)[1])
    x = batch(100)[0]
    state = trainer.state
    np.testing.assert_allclose(trainer.evaluate({"x": x})["pred"], x @ state["W"] + state["b"], rtol=1e-5, atol=1e-6)


def test_step_refuses_inputs_that_do_not_match(linear):
    trainer = _fresh(linear)
    x, y = batch(0)
    with pytest.raises(InputError, match=r"missing 'x'; unknown 'X'\); it takes x: float32\[8,3\]"):
        trainer.step({"X": x}, y)
    with pytest.raises(InputError, match="this loss needs labels"):
        trainer.step({"x": x})
    assert trainer.steps_done == 0


def test_a_compiled_model_trains(classifier):
    trainer = _fresh(classifier)
    assert trainer.names.dropout_masks and trainer.names.label_input == "labels"
    inputs, labels = _classes(0)
    losses = [trainer.step(inputs, labels) for _ in range(25)]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_a_loaded_checkpoint_continues_identically(classifier, tmp_path):
    trainer = _fresh(classifier)
    for seed in range(3):
        trainer.step(*_classes(seed))
    trainer.save(tmp_path / "ckpt")
    resumed = load_training(tmp_path / "ckpt")
    assert resumed.steps_done == 3 and resumed.seed == 5 and resumed.names == trainer.names
    assert resumed.optimizer == trainer.optimizer
    for seed in range(3, 6):
        assert resumed.step(*_classes(seed)) == trainer.step(*_classes(seed))
    for name, value in trainer.state.items():
        np.testing.assert_array_equal(resumed.state[name], value)


def test_dropout_masks_are_seeded_by_seed_and_step(classifier):
    trainer = _fresh(classifier)
    (name, first), = trainer.dropout_masks(4).items()
    np.testing.assert_array_equal(trainer.dropout_masks(4)[name], first)
    assert not np.array_equal(trainer.dropout_masks(5)[name], first)
    assert set(np.unique(first)) == {0.0, np.float32(1 / 0.75)}


def test_exported_onnx_runs_in_onnxruntime_as_evaluate(classifier, tmp_path):
    trainer = _fresh(classifier)
    for seed in range(5):
        trainer.step(*_classes(seed))
    assert not np.array_equal(trainer.state["bn.mean"], np.zeros(CLASSES))  # running statistics were updated
    path = trainer.export_onnx(tmp_path / "trained.onnx")
    inputs = _classes(99)[0]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, inputs)[0], trainer.evaluate(inputs)["logits"], rtol=1e-5, atol=1e-6)


def test_save_refuses_to_overwrite_unless_forced(linear, tmp_path):
    trainer = _fresh(linear)
    trainer.save(tmp_path / "ckpt")
    with pytest.raises(ArtifactError, match="already exists and is not empty; choose another directory or pass force=True"):
        trainer.save(tmp_path / "ckpt")
    trainer.step({"x": batch(0)[0]}, batch(0)[1])
    trainer.save(tmp_path / "ckpt", force=True)
    assert load_training(tmp_path / "ckpt").steps_done == 1
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="force replaces only a Tessel checkpoint"):
        trainer.save(tmp_path / "project", force=True)


def test_load_refuses_an_edited_state(linear, tmp_path):
    _fresh(linear).save(tmp_path / "ckpt")
    np.savez(tmp_path / "ckpt" / "state.npz", W=np.ones((3, 1), np.float32), b=np.ones(1, np.float32))
    with pytest.raises(ArtifactError, match="state.npz: missing, or its content does not match its hash"):
        load_training(tmp_path / "ckpt")
    with pytest.raises(ArtifactError, match="not a Tessel checkpoint"):
        load_training(tmp_path)


def test_device_memory_adds_recomputation_to_the_step_and_refuses_a_step_that_cannot_fit(kernel_cache):
    def compile_with(device_memory: int) -> Trainer:
        options = CompileOptions.create(None, cache_dir=kernel_cache, device_memory=device_memory)
        return compile_step(linear_step_graph(), ModelSource("linear", inference_model(), None, {}, 0.0), "mse",
                            SGD(lr=RATE), 0, options)

    report = compile_with(1 << 20).step_artifact.report()
    assert "recompute" in [record["name"] for record in report["passes"]]
    with pytest.raises(RecomputeError, match="the weights and training state take"):
        compile_with(16)


def test_a_checkpoint_records_the_loss_kind():
    assert StepNames.of(linear_step_graph(), "mse").loss == "mse"
    assert StepNames.of(linear_step_graph(), LossSpec.parse("cross_entropy", 0.1)).loss == "cross_entropy"


def test_a_float64_step_trains_with_dropout_and_exports_the_model_as_given(classifier, kernel_cache, tmp_path):
    trainer = tessel.compile_training(_classifier(), loss="cross_entropy", optimizer=tessel.optim.SGD(lr=0.2),
                                      input_shapes={"x": (8, 4)}, seed=5, cache_dir=kernel_cache, precision="fp64")
    (name, mask), = trainer.dropout_masks(0).items()
    assert mask.dtype == np.float64
    np.testing.assert_array_equal(mask > 0, classifier.dropout_masks(0)[name] > 0)  # the same draws
    inputs, labels = _classes(0)  # float32 data, widened by the step
    losses = [trainer.step(inputs, labels) for _ in range(10)]
    assert losses[-1] < losses[0] and trainer.state["W"].dtype == np.float64
    exported = onnx.load(str(trainer.export_onnx(tmp_path / "trained.onnx")))
    assert {init.name: init.data_type for init in exported.graph.initializer}["W"] == onnx.TensorProto.FLOAT
