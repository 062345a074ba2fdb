"""Optimizers and learning-rate schedules for training (`tessel.optim`), with PyTorch's semantics.

An optimizer is a plain description: its hyperparameters, the update rule the
step graph is built from (passes/optimizer_update.py) and, on the host,
`step_scalars(step)`, the per-step scalar inputs of that graph (the learning
rate from the schedule; AdamW's bias corrections). `step` counts the steps
already done: 0 for the first. Optimizers and schedules round-trip through
JSON for checkpoints.

Schedules map (base_lr, step) to the learning rate:
- `constant()`: base_lr.
- `step(step_size, gamma=0.1)`: base_lr * gamma ** (step // step_size) (torch StepLR).
- `cosine(total_steps, min_lr=0)`: cosine annealing from base_lr to min_lr over total_steps, then min_lr
  (torch CosineAnnealingLR with T_max=total_steps, eta_min=min_lr, up to total_steps).
- `warmup(steps, then=constant(), start_factor=1/3)`: the lr rises linearly from start_factor * base_lr to
  base_lr over `steps` (torch LinearLR), then follows `then` restarted at 0 (torch SequentialLR).
- `linear_scaling(base_lr, base_batch, batch)`: Goyal et al.'s rule for large batches, the learning rate
  base_lr * batch / base_batch to give the optimizer; their gradual warm-up from base_lr is
  `warmup(steps, then, start_factor=base_batch / batch)`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from tessel.ir.errors import TesselError
from tessel.passes.optimizer_update import (
    BIAS_CORRECTION2_SQRT, DECAY, GRAD_COEF, LR, STEP_SIZE, AdamWRule, SGDRule,
)


class OptimizerConfigError(TesselError, ValueError):
    """An optimizer or schedule with invalid hyperparameters, or JSON that describes none."""


@dataclass(frozen=True)
class Constant:
    """The base learning rate at every step."""

    def lr(self, base_lr: float, step: int) -> float:
        """The learning rate at `step` (0-based)."""
        return base_lr


@dataclass(frozen=True)
class Step:
    """Multiply the learning rate by gamma every step_size steps (torch StepLR)."""

    step_size: int
    gamma: float = 0.1

    def __post_init__(self):
        _require(self.step_size >= 1, f"step schedule: step_size must be >= 1, got {self.step_size}")

    def lr(self, base_lr: float, step: int) -> float:
        """The learning rate at `step` (0-based)."""
        return base_lr * self.gamma ** (step // self.step_size)


@dataclass(frozen=True)
class Cosine:
    """Cosine annealing from base_lr to min_lr over total_steps, min_lr after (torch CosineAnnealingLR)."""

    total_steps: int
    min_lr: float = 0.0

    def __post_init__(self):
        _require(self.total_steps >= 1, f"cosine schedule: total_steps must be >= 1, got {self.total_steps}")

    def lr(self, base_lr: float, step: int) -> float:
        """The learning rate at `step` (0-based)."""
        progress = min(step, self.total_steps) / self.total_steps
        return self.min_lr + (base_lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2


@dataclass(frozen=True)
class Warmup:
    """Linear warm-up from start_factor * base_lr to base_lr over `steps`, then `then` (torch LinearLR,
    SequentialLR)."""

    steps: int
    then: "Schedule" = field(default_factory=Constant)
    start_factor: float = 1.0 / 3

    def __post_init__(self):
        _require(self.steps >= 1, f"warmup schedule: steps must be >= 1, got {self.steps}")
        _require(0 < self.start_factor <= 1,
                 f"warmup schedule: start_factor must be in (0, 1], got {self.start_factor}")

    def lr(self, base_lr: float, step: int) -> float:
        """The learning rate at `step` (0-based)."""
        if step >= self.steps:
            return self.then.lr(base_lr, step - self.steps)
        return base_lr * (self.start_factor + (1 - self.start_factor) * step / self.steps)


Schedule = Union[Constant, Step, Cosine, Warmup]
_SCHEDULES = {"constant": Constant, "step": Step, "cosine": Cosine, "warmup": Warmup}


def constant() -> Constant:
    """The base learning rate at every step."""
    return Constant()


def step(step_size: int, gamma: float = 0.1) -> Step:
    """Multiply the learning rate by gamma every step_size steps (torch StepLR)."""
    return Step(step_size, gamma)


def cosine(total_steps: int, min_lr: float = 0.0) -> Cosine:
    """Cosine annealing to min_lr over total_steps (torch CosineAnnealingLR)."""
    return Cosine(total_steps, min_lr)


def warmup(steps: int, then: Schedule | None = None, start_factor: float = 1.0 / 3) -> Warmup:
    """Linear warm-up over `steps` from start_factor * lr, then the schedule `then` (constant by default)."""
    return Warmup(steps, then or Constant(), start_factor)


def linear_scaling(base_lr: float, base_batch: int, batch: int) -> float:
    """Goyal et al.'s linear scaling rule: the learning rate for `batch` when base_lr suits base_batch.

    Their gradual warm-up from base_lr is `warmup(steps, then, start_factor=base_batch / batch)`.
    """
    _require(base_batch >= 1 and batch >= 1, f"linear_scaling: batch sizes must be >= 1, got {base_batch} and {batch}")
    return base_lr * batch / base_batch


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD: weight decay, momentum (buffer = grad on the first step), dampening, Nesterov."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    schedule: Schedule = field(default_factory=Constant)

    def __post_init__(self):
        _require(self.lr >= 0, f"SGD: lr must be >= 0, got {self.lr}")
        _require(self.momentum >= 0, f"SGD: momentum must be >= 0, got {self.momentum}")
        _require(self.weight_decay >= 0, f"SGD: weight_decay must be >= 0, got {self.weight_decay}")
        _require(not self.nesterov or (self.momentum > 0 and self.dampening == 0),
                 "SGD: Nesterov momentum requires a momentum and zero dampening")
        object.__setattr__(self, "schedule", self.schedule or Constant())

    @property
    def rule(self) -> SGDRule:
        """The update the step graph applies (passes/optimizer_update.py)."""
        return SGDRule(self.momentum, self.dampening, self.nesterov, self.weight_decay)

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        return self.schedule.lr(self.lr, step)

    def step_scalars(self, step: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """The step graph's scalar inputs for step `step` (0-based), in `dtype` (the graph's scalar type)."""
        values = {LR: self.lr_at(step), GRAD_COEF: 1.0 if step == 0 else 1.0 - self.dampening}
        return {name: np.array(values[name], dtype) for name in self.rule.scalars}

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description (see `optimizer_from_json`)."""
        return {"type": "SGD", **_fields(self)}


@dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW: decoupled weight decay w -= lr * wd * w, then Adam with bias corrections."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    schedule: Schedule = field(default_factory=Constant)

    def __post_init__(self):
        _require(self.lr >= 0, f"AdamW: lr must be >= 0, got {self.lr}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"AdamW: betas must be two numbers in [0, 1), got {self.betas}")
        _require(self.eps >= 0, f"AdamW: eps must be >= 0, got {self.eps}")
        _require(self.weight_decay >= 0, f"AdamW: weight_decay must be >= 0, got {self.weight_decay}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        object.__setattr__(self, "schedule", self.schedule or Constant())

    @property
    def rule(self) -> AdamWRule:
        """The update the step graph applies (passes/optimizer_update.py)."""
        return AdamWRule(self.betas[0], self.betas[1], self.eps, self.weight_decay)

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        return self.schedule.lr(self.lr, step)

    def step_scalars(self, step: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """The step graph's scalar inputs for step `step` (0-based), in `dtype` (the graph's scalar type);
        PyTorch's step count is step + 1."""
        lr, t = self.lr_at(step), step + 1
        beta1, beta2 = self.betas
        values = {DECAY: 1.0 - lr * self.weight_decay, STEP_SIZE: lr / (1.0 - beta1 ** t),
                  BIAS_CORRECTION2_SQRT: math.sqrt(1.0 - beta2 ** t)}
        return {name: np.array(values[name], dtype) for name in self.rule.scalars}

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description (see `optimizer_from_json`)."""
        return {"type": "AdamW", **_fields(self)}


Optimizer = Union[SGD, AdamW]
_OPTIMIZERS = {"SGD": SGD, "AdamW": AdamW}


def schedule_to_json(schedule: Schedule) -> dict[str, Any]:
    """A JSON-ready description of a schedule."""
    kind = next(name for name, cls in _SCHEDULES.items() if isinstance(schedule, cls))
    return {"type": kind, **_fields(schedule)}


def schedule_from_json(data: Any) -> Schedule:
    """The schedule `schedule_to_json` described."""
    return _build(data, _SCHEDULES, "schedule")


def optimizer_from_json(data: Any) -> Optimizer:
    """The optimizer `to_json` described (a dict, or its JSON text)."""
    if isinstance(data, str):
        data = json.loads(data)
    return _build(data, _OPTIMIZERS, "optimizer")


def _fields(obj) -> dict[str, Any]:
    values = {}
    for name in obj.__dataclass_fields__:
        value = getattr(obj, name)
        if name in ("schedule", "then"):
            value = schedule_to_json(value)
        elif isinstance(value, tuple):
            value = list(value)
        values[name] = value
    return values


def _build(data: Any, kinds: dict[str, type], what: str):
    if not isinstance(data, dict) or data.get("type") not in kinds:
        raise OptimizerConfigError(f"invalid {what} description {data!r}: expected a type among {', '.join(kinds)}")
    cls = kinds[data["type"]]
    arguments = {k: v for k, v in data.items() if k != "type"}
    unknown = set(arguments) - set(cls.__dataclass_fields__)
    if unknown:
        raise OptimizerConfigError(f"{what} {data['type']}: unknown field(s) {', '.join(sorted(unknown))}")
    for name in ("schedule", "then"):
        if name in arguments:
            arguments[name] = schedule_from_json(arguments[name])
    if "betas" in arguments:
        arguments["betas"] = tuple(arguments["betas"])
    try:
        return cls(**arguments)
    except TypeError as exc:
        raise OptimizerConfigError(f"{what} {data['type']}: {exc}") from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise OptimizerConfigError(message)


__all__ = ["SGD", "AdamW", "Optimizer", "Schedule", "OptimizerConfigError", "constant", "step", "cosine", "warmup",
           "linear_scaling", "optimizer_from_json", "schedule_to_json", "schedule_from_json"]

