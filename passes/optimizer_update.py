"""Optimizer updates as graph ops: `add_updates` appends each parameter's next value (and its slots') to a graph.

The rules are plain descriptions (`SGDRule`, `AdamWRule`) with the constant
hyperparameters; what changes from step to step (the learning rate, AdamW's bias
corrections) enters as scalar float32 graph inputs named in `SCALARS`, which the
host computes for each step (compiler/optim.py). Optimizer slots are persistent
inputs named `<param>.momentum`, `<param>.exp_avg` and `<param>.exp_avg_sq`,
zeros before the first step. The arithmetic follows torch.optim.SGD and
torch.optim.AdamW op for op, so a step gives PyTorch's numbers. Every update op is
elementwise, so the fuse pass makes each update a few kernels: a fused group returns
one value and grows from one producer, which gives per parameter 1 kernel for SGD,
2 with momentum (+1 with weight decay) and 5 for AdamW.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

import numpy as np

from tessel.ir.graph import Graph, Value
from tessel.ir.types import TensorType, dtype_to_onnx

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
    scalars = {name: graph.add_input(name, TensorType("float32", ())) for name in rule.scalars}
    builder = _Builder(graph, scalars)
    next_values: dict[str, Value] = {}
    slot_inputs: list[Value] = []
    for name, (param, grad) in params.items():
        slots = {s: graph.add_input(slot_name(name, s), param.type) for s in rule.slots}
        slot_inputs.extend(slots.values())
        if isinstance(rule, SGDRule):
            new_param, new_slots = builder.sgd(rule, param, grad, slots)
        else:
            new_param, new_slots = builder.adamw(rule, param, grad, slots)
        next_values[name] = new_param
        next_values.update({slots[s].name: value for s, value in new_slots.items()})
    return OptimizerUpdates(next_values, slot_inputs, list(scalars.values()))


class _Builder:
    """Adds update ops; scalars and constants take the parameter's dtype."""

    def __init__(self, graph: Graph, scalars: dict[str, Value]):
        self.graph = graph
        self.scalars = scalars

    def sgd(self, rule: SGDRule, param: Value, grad: Value, slots: dict[str, Value]):
        grad = self.add(grad, self.mul(param, self.const(rule.weight_decay, param))) if rule.weight_decay else grad
        if not rule.momentum:
            return self.sub(param, self.mul(self.scalar(LR, param), grad)), {}
        # The buffer starts at zero, so momentum * buf + coef * grad is grad on the first step, as in PyTorch.
        contribution = self.mul(self.scalar(GRAD_COEF, param), grad) if rule.dampening else grad
        buffer = self.add(self.mul(slots["momentum"], self.const(rule.momentum, param)), contribution)
        direction = self.add(grad, self.mul(buffer, self.const(rule.momentum, param))) if rule.nesterov else buffer
        return self.sub(param, self.mul(self.scalar(LR, param), direction)), {"momentum": buffer}

    def adamw(self, rule: AdamWRule, param: Value, grad: Value, slots: dict[str, Value]):
        decayed = self.mul(param, self.scalar(DECAY, param)) if rule.weight_decay else param
        exp_avg, exp_avg_sq = slots["exp_avg"], slots["exp_avg_sq"]
        # torch's lerp: m + (1 - beta1) * (g - m).
        new_avg = self.add(exp_avg, self.mul(self.sub(grad, exp_avg), self.const(1.0 - rule.beta1, param)))
        new_sq = self.add(self.mul(exp_avg_sq, self.const(rule.beta2, param)),
                          self.mul(self.mul(grad, grad), self.const(1.0 - rule.beta2, param)))
        denom = self.add(self.op("Div", self.op("Sqrt", new_sq), self.scalar(BIAS_CORRECTION2_SQRT, param)),
                         self.const(rule.eps, param))
        step = self.mul(self.scalar(STEP_SIZE, param), self.op("Div", new_avg, denom))
        return self.sub(decayed, step), {"exp_avg": new_avg, "exp_avg_sq": new_sq}

    def scalar(self, name: str, like: Value) -> Value:
        value = self.scalars[name]
        if like.type.dtype == value.type.dtype:
            return value
        return add_op(self.graph, "Cast", [value], {"to": dtype_to_onnx(like.type.dtype)}, name="optim_Cast").outputs[0]

    def const(self, number: float, like: Value) -> Value:
        return self.graph.add_constant(self.graph.unique_name("optim_const"), np.array(number, like.type.dtype))

    def add(self, a: Value, b: Value) -> Value:
        return self.op("Add", a, b)

    def sub(self, a: Value, b: Value) -> Value:
        return self.op("Sub", a, b)

    def mul(self, a: Value, b: Value) -> Value:
        return self.op("Mul", a, b)

    def op(self, op_type: str, *inputs: Value) -> Value:
        return add_op(self.graph, op_type, list(inputs), name=f"optim_{op_type}").outputs[0]
