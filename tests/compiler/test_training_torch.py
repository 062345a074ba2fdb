"""Tessel's training step against PyTorch: models written in PyTorch (bench/training_models.py), exported to ONNX
from the same weights, trained 20 steps on the same batches with SGD (momentum 0.9) and with AdamW: every step's
loss within 1e-4 relative of PyTorch's, every final weight and BatchNorm running statistic within 1e-3 relative
(per tensor: |tessel - torch| / |torch| in the Frobenius norm).

ResNet-18 at batch 4 is compared in float64 (precision "fp64": Tessel compiles the step in float64, PyTorch runs
the model .double()), at 224x224, because no float32 engine can follow another there: its steps are chaotic in
float32 rounding. A pre-activation within rounding of zero (a ReLU's mask) or two near-equal values in a max-pool
window route one element's gradient differently; the bias gradients, small sums that cancel, then differ by up to
1e-2 relative, and BatchNorm over a few values per channel amplifies the difference from step to step. Measured:
PyTorch float32 against PyTorch float64 over these 20 steps differs in loss by 43% with SGD (lr 0.05), 11% with
AdamW (lr 1e-3) and still 4.5e-4 with SGD at lr 2e-4 (at 32x32: 2.7x, 0.7x, 14%). In float64 the steps follow
PyTorch to rounding (see RESNET18 for the settings). The compiled float32 step's first update is checked against
PyTorch float64 as loosely as PyTorch float32 itself would pass, and the step graph in float64 against PyTorch
float64 (every gradient within 1e-8: the autodiff, exactly)."""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import tessel
from bench.training_models import SPECS, ModelSpec, export, torch_loss, torch_optimizer
from tessel import optim

STEPS = 20
LR = {"sgd": 0.05, "adamw": 1e-3}
# ResNet-18 at batch 4 is compared at its own 224x224 input and, for SGD, a learning rate of 0.01: at 32x32 (one
# pixel, four values per channel for layer4's BatchNorm) or at SGD lr 0.05 (its loss climbs to 54) the 20 steps are
# chaotic even in float64 (a 1e-13 random change of the weights grows to 5e-4..0.9 of the loss in PyTorch itself);
# at these settings it stays below 3e-11, so a float64 engine can be held to the tolerance.
RESNET18 = dataclasses.replace(SPECS["resnet18"], input_shape=(4, 3, 224, 224))
RESNET18_LR = {"sgd": 0.01, "adamw": 1e-3}
LOSS_RTOL, WEIGHT_RTOL = 1e-4, 1e-3
# The default run keeps one case per optimizer (seconds to a minute each on two cores, mostly kernel builds):
# the MLP with AdamW and the CNN with BatchNorm (conv, pool and BN gradients) with SGD. The rest run with
# `pytest -m slow` (ResNet-18 takes minutes).
DEFAULT_RUN = {("mlp", "adamw"), ("cnn_bn", "sgd")}


def _batches(spec: ModelSpec) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [spec.batch(rng) for _ in range(STEPS)]


def _torch_run(model: torch.nn.Module, spec: ModelSpec, optimizer: str, lr: float, batches,
               dtype: torch.dtype = torch.float32) -> tuple[list[float], dict]:
    """PyTorch's losses per step and its final weights and running statistics, by name, computing in `dtype`."""
    model.to(dtype).train()
    opt = torch_optimizer(optimizer, model.parameters(), lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        labels = torch.from_numpy(y)
        loss = torch_loss(spec.loss, model(torch.from_numpy(x).to(dtype)),
                          labels.to(dtype) if labels.is_floating_point() else labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {name: value.detach().numpy().copy() for name, value in model.state_dict().items()
             if value.dtype.is_floating_point}
    return losses, state


def _tessel_run(path, spec: ModelSpec, optimizer: str, lr: float, batches, out, cache,
                precision: str = "fp32") -> tuple[list[float], dict]:
    """Tessel's losses per step and the initializers of the model it exports after training (float32 batches:
    a float64 step widens them itself). The export is the model as given, in float32; a float64 step's values are
    compared as the step holds them, those of the export with the names it has."""
    opt = optim.SGD(lr, momentum=0.9) if optimizer == "sgd" else optim.AdamW(lr)
    trainer = tessel.compile_training(str(path), loss=spec.loss, optimizer=opt, input_shapes={"x": spec.input_shape},
                                      cache_dir=str(cache), precision=precision)
    losses = [trainer.step({"x": x}, y) for x, y in batches]
    trainer.export_onnx(str(out))
    exported = {init.name: numpy_helper.to_array(init) for init in onnx.load(str(out)).graph.initializer}
    assert {array.dtype for array in exported.values()} <= {np.dtype(np.float32), np.dtype(np.int64)}
    if precision == "fp64":
        state = trainer.state
        return losses, {name: state.get(name, value) for name, value in exported.items()}
    return losses, exported


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-12))


def _check_against_pytorch(spec: ModelSpec, optimizer: str, tmp_path, cache, precision: str = "fp32",
                           lr: Mapping[str, float] = LR, loss_rtol: float = LOSS_RTOL,
                           weight_rtol: float = WEIGHT_RTOL) -> None:
    """Train `spec`'s model STEPS steps in PyTorch and in Tessel from the same weights on the same batches (both in
    float64 with precision "fp64"); compare every step's loss and every final weight and running statistic."""
    model = spec.model()
    path = export(model, spec.input_shape, tmp_path / f"{spec.name}.onnx")
    batches = _batches(spec)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    want_losses, want_state = _torch_run(model, spec, optimizer, lr[optimizer], batches, dtype)
    got_losses, got_state = _tessel_run(path, spec, optimizer, lr[optimizer], batches, tmp_path / "trained.onnx", cache,
                                        precision)

    np.testing.assert_allclose(got_losses, want_losses, rtol=loss_rtol, err_msg="per-step losses")
    missing = sorted(set(want_state) - set(got_state) - {n for n in want_state if n.endswith("num_batches_tracked")})
    assert not missing, f"not in the exported model: {missing}"
    errors = {n: _relative(got_state[n], want_state[n]) for n in want_state if n in got_state}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= weight_rtol, f"{worst}: relative error {errors[worst]:.2e} (all: {errors})"


@pytest.mark.parametrize("name, optimizer", [
    pytest.param(name, optimizer, id=f"{name}-{optimizer}",
                 marks=() if (name, optimizer) in DEFAULT_RUN else pytest.mark.slow)
    for name in SPECS if name != "resnet18" for optimizer in ("sgd", "adamw")])
def test_training_steps_match_pytorch(tmp_path, kernel_cache, name, optimizer):
    _check_against_pytorch(SPECS[name], optimizer, tmp_path, kernel_cache)


def test_float64_steps_match_pytorch_float64(tmp_path, kernel_cache):
    """precision="fp64" compiles the step in float64: the MLP then follows PyTorch float64 to rounding."""
    _check_against_pytorch(SPECS["mlp"], "sgd", tmp_path, kernel_cache, "fp64", loss_rtol=1e-12, weight_rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_resnet18_steps_match_pytorch_in_float64(tmp_path, kernel_cache, optimizer):
    """ResNet-18 at batch 4, 20 steps: the Done-when check itself, in the precision where it means something (the
    module docstring says why float32 cannot), at the settings where the steps are not chaotic (RESNET18)."""
    _check_against_pytorch(RESNET18, optimizer, tmp_path, kernel_cache, "fp64", RESNET18_LR)


def _float64_gradients(spec: ModelSpec, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """PyTorch's loss and parameter gradients in float64 (the model's float32 weights widened)."""
    model = spec.model().double().train()
    loss = torch_loss(spec.loss, model(torch.from_numpy(x).double()), torch.from_numpy(y))
    loss.backward()
    return loss.item(), {name: p.grad.numpy() for name, p in model.named_parameters()}


def test_resnet18_step_graph_in_float64_gives_pytorch_gradients(tmp_path):
    from tessel.compiler.training import build_step_graph
    from tessel.ir.interpret import interpret

    spec = SPECS["resnet18"]
    path = export(spec.model(), spec.input_shape, tmp_path / "resnet18.onnx")
    x, y = spec.batch(np.random.default_rng(7))
    want_loss, want = _float64_gradients(spec, x, y)
    sgd = optim.SGD(1.0)  # no momentum, lr 1: the next weights are the weights less their gradients
    step = build_step_graph(onnx.load(str(path)), {"x": spec.input_shape}, spec.loss, sgd)
    feeds = {"x": x.astype(np.float64), step.label_input: y,
             **{name: value.astype(np.float64) for name, value in step.state.items()},
             **{name: np.asarray(value, np.float64) for name, value in sgd.step_scalars(0).items()}}
    got = interpret(step.graph, feeds)
    assert abs(float(got[step.loss_output]) - want_loss) <= 1e-9 * abs(want_loss)
    for name, gradient in want.items():
        ours = step.state[name].astype(np.float64) - got[step.state_updates[name]]
        assert _relative(ours, gradient) <= 1e-8, name


@pytest.mark.slow
def test_resnet18_compiled_first_update_matches_pytorch(tmp_path, kernel_cache):
    spec = SPECS["resnet18"]
    path = export(spec.model(), spec.input_shape, tmp_path / "resnet18.onnx")
    x, y = spec.batch(np.random.default_rng(7))
    want_loss, want = _float64_gradients(spec, x, y)
    trainer = tessel.compile_training(str(path), loss=spec.loss, optimizer=optim.SGD(1.0),
                                      input_shapes={"x": spec.input_shape}, cache_dir=str(kernel_cache))
    before = trainer.state
    loss = trainer.step({"x": x}, y)
    after = trainer.state
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    # PyTorch float32 is within 8e-5 of float64 here; one flipped ReLU mask moves a bias gradient by ~1e-2.
    errors = {name: _relative(before[name].astype(np.float64) - after[name], gradient) for name, gradient in want.items()}
    assert max(errors.values()) <= 2e-2, errors
    assert np.median(list(errors.values())) <= 1e-3, errors
