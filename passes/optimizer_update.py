"""Optimizer updates as graph ops: `add_updates` appends each parameter's next value (and its slots') to a graph.

The rules are plain descriptions (`SGDRule`, `AdamWRule`) with the constant
hyperparameters; what changes from step to step (the learning rate, AdamW's bias
corrections) enters as scalar graph inputs (float32, float64 for float64 parameters) named in `SCALARS`, which the
host computes for each step (compiler/optim.py). Optimizer slots are persistent
inputs named `<param>.momentum`, `<param>.exp_avg` and `<param>.exp_avg_sq`,
zeros before the first step. Each parameter's update is ONE Tessel-domain op,
`SGDUpdate` or `AdamWUpdate` (ir/optimizer_ops.py), whose outputs are the new
parameter and its new slots: one kernel per parameter per step, reading the
parameter, its gradient and its slots once. Its arithmetic is torch.optim.SGD's and
torch.optim.AdamW's, op for op, so a step gives PyTorch's numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

import numpy as np

from tessel.ir.graph import Graph, Value
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.types import TensorType

from .base import add_op

# The per-step scalar inputs, by meaning.
LR = "optim.lr"
# SGD with dampening: the gradient's coefficient in the momentum buffer (1 on the first step, 1 - dampening after).
GRAD_COEF = "optim.grad_coef"
# AdamW: the decoupled weight decay factor 1 - lr * weight_decay, lr / (1 - beta1^t) and sqrt(1 - beta2^t).
DECAY = "optim.decay"
STEP_SIZE = "optim.step_size"
BIAS_CORRECTION2_SQRT = "optim.bias_correction2_sqrt"
SCALARS = (LR, GRAD_COEF, DECAY, STEP_SIZE, BIAS_CORRECTION2_SQRT)


@dataclass(frozen=True)
class SGDRule:
    """torch.optim.SGD's update: weight decay added to the gradient, momentum buffer, Nesterov."""

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    @property
    def slots(self) -> tuple[str, ...]:
        """Slot suffixes each parameter gets."""
        return ("momentum",) if self.momentum else ()

    @property
    def scalars(self) -> tuple[str, ...]:
        """Names of the per-step scalar inputs the update reads."""
        return (LR, GRAD_COEF) if self.momentum and self.dampening else (LR,)


@dataclass(frozen=True)
class AdamWRule:
    """torch.optim.AdamW's update: decoupled weight decay, then Adam with bias corrections."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2

    @property
    def slots(self) -> tuple[str, ...]:
        """Slot suffixes each parameter gets."""
        return ("exp_avg", "exp_avg_sq")

    @property
    def scalars(self) -> tuple[str, ...]:
        """Names of the per-step scalar inputs the update reads."""
        return (DECAY, STEP_SIZE, BIAS_CORRECTION2_SQRT) if self.weight_decay else (STEP_SIZE, BIAS_CORRECTION2_SQRT)


Rule = Union[SGDRule, AdamWRule]


@dataclass
class OptimizerUpdates:
    """What `add_updates` added: each persistent input's next value (parameters and slots), the new slot
    inputs (zeros initially) and the scalar inputs to feed per step."""

    next_values: dict[str, Value]
    slot_inputs: list[Value]
    scalar_inputs: list[Value]

    def initial_slots(self) -> dict[str, np.ndarray]:
        """Zero arrays for every slot input: the optimizer state before the first step."""
        return {v.name: np.zeros(v.type.shape, v.type.dtype) for v in self.slot_inputs}


def slot_name(param: str, slot: str) -> str:
    """The persistent input holding slot `slot` of parameter `param`."""
    return f"{param}.{slot}"


def add_updates(graph: Graph, rule: Rule, params: Mapping[str, tuple[Value, Value]]) -> OptimizerUpdates:
    """Append the update of every parameter, given as name -> (parameter input, its gradient), to `graph`."""
    taken = [name for name in rule.scalars if graph.lookup(name) is not None]
    if taken:
        raise ValueError(f"the graph already has a value named {taken[0]!r}, the optimizer's scalar input")
    # The scalars are float64 where the parameters are (a step compiled in float64), float32 otherwise.
    scalar_dtype = "float64" if any(param.type.dtype == "float64" for param, _ in params.values()) else "float32"
    scalars = {name: graph.add_input(name, TensorType(scalar_dtype, ())) for name in rule.scalars}
    op_type, attrs = _update_op(rule)
    next_values: dict[str, Value] = {}
    slot_inputs: list[Value] = []
    for name, (param, grad) in params.items():
        slots = [graph.add_input(slot_name(name, s), param.type) for s in rule.slots]
        slot_inputs.extend(slots)
        inputs = _update_inputs(rule, param, grad, slots, scalars)
        node = add_op(graph, op_type, inputs, attrs, name=f"optim_{op_type}", num_outputs=1 + len(slots),
                      domain=TESSEL_DOMAIN)
        next_values[name] = node.outputs[0]
        next_values.update({slot.name: value for slot, value in zip(slots, node.outputs[1:])})
    return OptimizerUpdates(next_values, slot_inputs, list(scalars.values()))


def _update_inputs(rule: Rule, param: Value, grad: Value, slots: list[Value],
                   scalars: dict[str, Value]) -> list[Value]:
    """The update op's inputs in its order: SGDUpdate(param, grad, lr[, momentum[, grad_coef]]),
    AdamWUpdate(param, grad, exp_avg, exp_avg_sq, step_size, bias_correction2_sqrt[, decay])."""
    if isinstance(rule, SGDRule):
        return [param, grad, scalars[LR], *slots] + ([scalars[GRAD_COEF]] if GRAD_COEF in scalars else [])
    return [param, grad, *slots, scalars[STEP_SIZE], scalars[BIAS_CORRECTION2_SQRT]] + (
        [scalars[DECAY]] if DECAY in scalars else [])


def _update_op(rule: Rule) -> tuple[str, dict[str, float]]:
    """The update op (ir/optimizer_ops.py) applying `rule`, and its attributes."""
    if isinstance(rule, SGDRule):
        return "SGDUpdate", {"momentum": rule.momentum, "dampening": rule.dampening, "nesterov": int(rule.nesterov),
                             "weight_decay": rule.weight_decay}
    return "AdamWUpdate", {"beta1": rule.beta1, "beta2": rule.beta2, "eps": rule.eps}
