"""compiler/optim.py (tessel.optim): schedules match torch.optim.lr_scheduler, the update graph fed with
`step_scalars` matches torch.optim step by step, and everything round-trips through JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import tessel
from tessel import optim
from tessel.ir.graph import Graph
from tessel.ir.interpret import interpret
from tessel.ir.types import TensorType
from tessel.passes.optimizer_update import add_updates

STEPS = 12


def _torch_lrs(base_lr: float, make_scheduler, steps: int = STEPS) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    scheduler = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


S = torch.optim.lr_scheduler


@pytest.mark.parametrize("schedule, make_scheduler", [
    (optim.constant(), lambda o: S.ConstantLR(o, factor=1.0)),
    (optim.step(4, gamma=0.5), lambda o: S.StepLR(o, step_size=4, gamma=0.5)),
    (optim.cosine(STEPS, min_lr=0.01), lambda o: S.CosineAnnealingLR(o, T_max=STEPS, eta_min=0.01)),
    (optim.warmup(5), lambda o: S.LinearLR(o, start_factor=1 / 3, total_iters=5)),
    (optim.warmup(3, optim.cosine(8), start_factor=0.1),
     lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=3), S.CosineAnnealingLR(o, T_max=8)],
                              milestones=[3])),
], ids=["constant", "step", "cosine", "warmup", "warmup_cosine"])
def test_schedules_match_torch(schedule, make_scheduler):
    want = _torch_lrs(0.2, make_scheduler)
    got = [optim.SGD(lr=0.2, schedule=schedule).lr_at(t) for t in range(STEPS)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_cosine_stays_at_min_lr_after_its_steps():
    assert optim.cosine(10, min_lr=0.001).lr(0.1, 25) == pytest.approx(0.001)


def test_linear_scaling_with_goyal_warmup():
    lr = optim.linear_scaling(0.1, base_batch=256, batch=1024)
    assert lr == pytest.approx(0.4)
    # Goyal et al.: from base_lr (0.1) up to the scaled lr (0.4) over the warm-up, then the schedule.
    schedule = optim.warmup(4, optim.step(10, 0.1), start_factor=256 / 1024)
    lrs = [optim.SGD(lr, schedule=schedule).lr_at(t) for t in range(16)]
    np.testing.assert_allclose(lrs[:5], [0.1, 0.175, 0.25, 0.325, 0.4])
    assert lrs[13] == pytest.approx(0.4) and lrs[14] == pytest.approx(0.04)


SHAPES = {"w": (4, 3), "b": (3,)}


def _compare_with_torch(optimizer, make_torch_optimizer, steps: int = 3) -> None:
    """Run `steps` updates as a Tessel graph (ir.interpret, float32) and with torch.optim on the same gradients."""
    rng = np.random.default_rng(0)
    start = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = [{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()} for _ in range(steps)]

    graph = Graph()
    params = {n: (graph.add_input(n, TensorType("float32", s)), graph.add_input(f"{n}.grad", TensorType("float32", s)))
              for n, s in SHAPES.items()}
    updates = add_updates(graph, optimizer.rule, params)
    graph.outputs = list(updates.next_values.values())
    state = {**start, **updates.initial_slots()}

    tensors = {n: torch.tensor(a, requires_grad=True) for n, a in start.items()}
    reference = make_torch_optimizer(list(tensors.values()))
    for t in range(steps):
        feeds = {**state, **{f"{n}.grad": g for n, g in grads[t].items()}, **optimizer.step_scalars(t)}
        outputs = interpret(graph, feeds)
        state = {name: outputs[value.name] for name, value in updates.next_values.items()}
        for n, tensor in tensors.items():
            tensor.grad = torch.from_numpy(grads[t][n])
        reference.step()
        for n, tensor in tensors.items():
            np.testing.assert_allclose(state[n], tensor.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=f"step {t}")


@pytest.mark.parametrize("kwargs", [
    {}, {"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.3}, {"momentum": 0.9, "nesterov": True},
    {"momentum": 0.8, "weight_decay": 0.05},
], ids=["plain", "momentum", "dampening", "nesterov", "weight_decay"])
def test_sgd_steps_match_torch(kwargs):
    _compare_with_torch(optim.SGD(lr=0.1, **kwargs), lambda p: torch.optim.SGD(p, lr=0.1, **kwargs))


@pytest.mark.parametrize("kwargs", [{}, {"weight_decay": 0.0}, {"betas": (0.5, 0.7), "eps": 1e-3, "weight_decay": 0.3}],
                         ids=["defaults", "no_decay", "custom"])
def test_adamw_steps_match_torch(kwargs):
    _compare_with_torch(optim.AdamW(lr=0.01, **kwargs), lambda p: torch.optim.AdamW(p, lr=0.01, **kwargs))


def test_scheduled_lr_reaches_the_update():
    sgd = optim.SGD(lr=0.1, schedule=optim.step(1, gamma=0.5))
    assert float(sgd.step_scalars(2)["optim.lr"]) == pytest.approx(0.025)
    adamw = optim.AdamW(lr=0.1, schedule=optim.step(1, gamma=0.5))
    assert float(adamw.step_scalars(1)["optim.step_size"]) == pytest.approx(0.05 / (1 - 0.9 ** 2))


@pytest.mark.parametrize("optimizer", [
    optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, schedule=optim.warmup(5, optim.cosine(100))),
    optim.AdamW(lr=3e-4, betas=(0.8, 0.99), schedule=optim.warmup(10, optim.step(30, 0.1), start_factor=0.25)),
    optim.AdamW(),
])
def test_json_round_trip(optimizer):
    text = json.dumps(optimizer.to_json())
    assert optim.optimizer_from_json(text) == optimizer
    assert optim.optimizer_from_json(json.loads(text)) == optimizer


@pytest.mark.parametrize("make, message", [
    (lambda: optim.SGD(lr=-1), "lr must be >= 0"),
    (lambda: optim.SGD(lr=0.1, nesterov=True), "Nesterov"),
    (lambda: optim.AdamW(betas=(0.9, 1.0)), "betas"),
    (lambda: optim.cosine(0), "total_steps"),
    (lambda: optim.linear_scaling(0.1, 0, 64), "batch sizes"),
    (lambda: optim.warmup(2, start_factor=0), "start_factor"),
    (lambda: optim.optimizer_from_json({"type": "Adagrad"}), "invalid optimizer description"),
    (lambda: optim.optimizer_from_json({"type": "SGD", "lr": 0.1, "foo": 1}), "unknown field"),
    (lambda: optim.optimizer_from_json({"type": "SGD"}), "missing"),
])
def test_bad_hyperparameters_are_one_line_errors(make, message):
    with pytest.raises(optim.OptimizerConfigError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_tessel_optim_is_an_attribute_of_tessel():
    # A fresh interpreter: here tessel.optim is already imported, which sets the attribute anyway.
    code = "import tessel; print(tessel.optim.SGD(lr=0.1).lr)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tessel.IMPORT_ROOT)
    assert result.stdout.strip() == "0.1", result.stderr
