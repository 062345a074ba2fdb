"""The Trainer on a hand-built step (linear regression): steps, evaluate, checkpoints, ONNX export."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tessel.compiler import trainer as trainer_module
from tessel.compiler.api import ModelSource
from tessel.compiler.options import CompileOptions
from tessel.compiler.trainer import Trainer, compile_step, load_training
from tessel.runtime.errors import ArtifactError, InputError
from tests.compiler.step_graphs import ConstantSGD, batch, inference_model, linear_step_graph, numpy_step

LR = 0.1


def _compile(kernel_cache, with_mask: bool = False) -> Trainer:
    options = CompileOptions.create(None, cache_dir=kernel_cache)
    return compile_step(linear_step_graph(with_mask), ModelSource("linear", inference_model(), None, {}, 0.0), "mse",
                        ConstantSGD(LR), 7, options)


@pytest.fixture(scope="module")
def compiled(kernel_cache):
    return _compile(kernel_cache)


@pytest.fixture(scope="module")
def compiled_with_mask(kernel_cache):
    return _compile(kernel_cache, with_mask=True)


def _fresh(trainer: Trainer) -> Trainer:
    """A new Trainer on the same artifacts, from the starting state."""
    return Trainer(trainer.step_artifact, trainer.eval_artifact, trainer.names, trainer.optimizer, trainer.seed,
                   trainer._model_bytes)


@pytest.fixture
def reads_constant_sgd(monkeypatch):
    monkeypatch.setattr(trainer_module, "optimizer_from_json", lambda doc: ConstantSGD(doc["lr"]))


def test_steps_follow_sgd_and_reduce_the_loss(compiled):
    trainer = _fresh(compiled)
    w, b = trainer.state["W"], trainer.state["b"]
    losses = []
    for seed in range(30):
        x, y = batch(seed)
        losses.append(trainer.step({"x": x}, y))
        want, w, b = numpy_step(w, b, x, y, LR)
        assert losses[-1] == pytest.approx(want, rel=1e-4)
    assert trainer.steps_done == 30 and losses[-1] < 1e-3 * losses[0]
    np.testing.assert_allclose(trainer.state["W"], w, rtol=1e-4, atol=1e-6)


def test_evaluate_runs_the_model_on_the_current_state(compiled):
    trainer = _fresh(compiled)
    for seed in range(3):
        trainer.step(dict(x=batch(seed)[0]), batch(seed)[1])
    x = batch(100)[0]
    state = trainer.state
    np.testing.assert_allclose(trainer.evaluate({"x": x})["pred"], x @ state["W"] + state["b"], rtol=1e-5, atol=1e-6)


def test_step_refuses_inputs_that_do_not_match(compiled):
    trainer = _fresh(compiled)
    x, y = batch(0)
    with pytest.raises(InputError, match=r"missing 'x'; unknown 'X'\); it takes x: float32\[8,3\]"):
        trainer.step({"X": x}, y)
    with pytest.raises(InputError, match="this loss needs labels"):
        trainer.step({"x": x})
    assert trainer.steps_done == 0


def test_a_loaded_checkpoint_continues_identically(compiled_with_mask, tmp_path, reads_constant_sgd):
    trainer = _fresh(compiled_with_mask)
    for seed in range(3):
        trainer.step({"x": batch(seed)[0]}, batch(seed)[1])
    trainer.save(tmp_path / "ckpt")
    resumed = load_training(tmp_path / "ckpt")
    assert resumed.steps_done == 3 and resumed.seed == 7 and resumed.names == trainer.names
    for seed in range(3, 6):
        x, y = batch(seed)
        assert resumed.step({"x": x}, y) == trainer.step({"x": x}, y)
    for name, value in trainer.state.items():
        np.testing.assert_array_equal(resumed.state[name], value)


def test_dropout_masks_are_seeded_by_seed_and_step(compiled_with_mask):
    trainer = _fresh(compiled_with_mask)
    first, again, other = trainer.dropout_masks(4)["x_mask"], trainer.dropout_masks(4)["x_mask"], trainer.dropout_masks(5)["x_mask"]
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert set(np.unique(first)) <= {0.0, np.float32(1 / 0.75)}


def test_save_refuses_to_overwrite_unless_forced(compiled, tmp_path):
    trainer = _fresh(compiled)
    trainer.save(tmp_path / "ckpt")
    with pytest.raises(ArtifactError, match="already exists and is not empty; choose another directory or pass force=True"):
        trainer.save(tmp_path / "ckpt")
    trainer.step({"x": batch(0)[0]}, batch(0)[1])
    trainer.save(tmp_path / "ckpt", force=True)
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="force replaces only a Tessel checkpoint"):
        trainer.save(tmp_path / "project", force=True)


def test_load_refuses_an_edited_state(compiled, tmp_path, reads_constant_sgd):
    _fresh(compiled).save(tmp_path / "ckpt")
    np.savez(tmp_path / "ckpt" / "state.npz", W=np.ones((3, 1), np.float32), b=np.ones(1, np.float32))
    with pytest.raises(ArtifactError, match="state.npz: missing, or its content does not match its hash"):
        load_training(tmp_path / "ckpt")
    with pytest.raises(ArtifactError, match="not a Tessel checkpoint"):
        load_training(tmp_path)


def test_exported_onnx_runs_in_onnxruntime_as_evaluate(compiled, tmp_path):
    trainer = _fresh(compiled)
    for seed in range(5):
        trainer.step({"x": batch(seed)[0]}, batch(seed)[1])
    path = trainer.export_onnx(tmp_path / "trained.onnx")
    x = batch(200)[0]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], trainer.evaluate({"x": x})["pred"], rtol=1e-5, atol=1e-6)
