"""Tessel's optimizer update ops (domain "tessel"): one parameter's whole update as one op, so it runs as one kernel.

- `SGDUpdate(param, grad, lr[, momentum_buffer[, grad_coef]])` -> (param'[, momentum_buffer']): torch.optim.SGD.
  Attributes momentum, dampening, nesterov (0/1), weight_decay. The momentum buffer is given (and updated) exactly
  when momentum != 0; grad_coef (the gradient's coefficient in the buffer: 1 on the first step, 1 - dampening
  after) exactly when momentum and dampening are both non-zero.
- `AdamWUpdate(param, grad, exp_avg, exp_avg_sq, step_size, bias_correction2_sqrt[, decay])`
  -> (param', exp_avg', exp_avg_sq'): torch.optim.AdamW. Attributes beta1, beta2, eps. The decoupled weight decay
  enters as the per-step factor `decay` = 1 - lr * weight_decay (lr follows a schedule), given exactly when the
  weight decay is non-zero; step_size = lr / (1 - beta1^t), bias_correction2_sqrt = sqrt(1 - beta2^t).

The per-step scalars are 0-d float tensors of any float type (cast to the parameter's); param, grad and the slots
share one type. The arithmetic is torch.optim's, operation for operation and in the same order, so an update gives
PyTorch's numbers to rounding; `REFERENCE` (used by ir/interpret.py) and the TVM lowering
(backends/lowering/optimizer.py) both spell it out through `sgd_update` / `adamw_update`, which take any array
type with +, -, * and /, plus a square root.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .attributes import AttrSpec, Attributes
from .errors import InferenceFailure
from .types import TensorType

SGD_UPDATE_ATTRS = {
    "momentum": AttrSpec("momentum", "float", False, 0.0),
    "dampening": AttrSpec("dampening", "float", False, 0.0),
    "nesterov": AttrSpec("nesterov", "int", False, 0),
    "weight_decay": AttrSpec("weight_decay", "float", False, 0.0),
}
ADAMW_UPDATE_ATTRS = {
    "beta1": AttrSpec("beta1", "float", False, 0.9),
    "beta2": AttrSpec("beta2", "float", False, 0.999),
    "eps": AttrSpec("eps", "float", False, 1e-8),
}


def sgd_update(attrs: Attributes, param, grad, lr, buffer=None, grad_coef=None, const: Callable = float):
    """(param', buffer' or None), torch.optim.SGD's arithmetic; `const` makes a constant of the arrays' type."""
    weight_decay, momentum = attrs.get("weight_decay", 0.0), attrs.get("momentum", 0.0)
    if weight_decay:
        grad = grad + param * const(weight_decay)
    if not momentum:
        return param - lr * grad, None
    # The buffer starts at zero and grad_coef is 1 on the first step, so the first buffer is grad, as in PyTorch.
    contribution = grad_coef * grad if grad_coef is not None else grad
    buffer = buffer * const(momentum) + contribution
    direction = grad + buffer * const(momentum) if attrs.get("nesterov", 0) else buffer
    return param - lr * direction, buffer


def adamw_update(attrs: Attributes, param, grad, exp_avg, exp_avg_sq, step_size, bias_correction2_sqrt,
                 decay=None, *, sqrt: Callable, const: Callable = float):
    """(param', exp_avg', exp_avg_sq'), torch.optim.AdamW's arithmetic; `const` makes a constant of the arrays' type."""
    beta1, beta2 = attrs.get("beta1", 0.9), attrs.get("beta2", 0.999)
    decayed = param * decay if decay is not None else param
    # torch's lerp: m + (1 - beta1) * (g - m).
    exp_avg = exp_avg + (grad - exp_avg) * const(1.0 - beta1)
    exp_avg_sq = exp_avg_sq * const(beta2) + (grad * grad) * const(1.0 - beta2)
    denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + const(attrs.get("eps", 1e-8))
    return decayed - step_size * (exp_avg / denom), exp_avg, exp_avg_sq


def _numpy_const(dtype) -> Callable[[float], np.ndarray]:
    return lambda number: np.asarray(number, dtype)


def _sgd_reference(attrs: Attributes, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    param, grad, lr, *slots = inputs
    cast = [np.asarray(s, param.dtype) for s in [lr, *slots[1:]]]
    buffer = slots[0] if slots else None
    new_param, new_buffer = sgd_update(attrs, param, grad, cast[0], buffer, cast[1] if len(cast) > 1 else None,
                                       const=_numpy_const(param.dtype))
    return [new_param] if new_buffer is None else [new_param, new_buffer]


def _adamw_reference(attrs: Attributes, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    param, grad, exp_avg, exp_avg_sq, *scalars = inputs
    scalars = [np.asarray(s, param.dtype) for s in scalars]
    return list(adamw_update(attrs, param, grad, exp_avg, exp_avg_sq, *scalars, sqrt=np.sqrt,
                             const=_numpy_const(param.dtype)))


def _check_operands(op_type: str, tensors: Sequence[TensorType | None], scalars: Sequence[TensorType | None]) -> None:
    """Raise InferenceFailure unless the tensors share one float type and the scalars are 0-d floats."""
    if any(t is None for t in list(tensors) + list(scalars)):
        raise InferenceFailure(f"{op_type} has no optional inputs in the middle")
    first = tensors[0]
    if not first.dtype.startswith(("float", "bfloat")):
        raise InferenceFailure(f"{op_type} updates float tensors, the parameter is {first}")
    for t in tensors[1:]:
        if t != first:
            raise InferenceFailure(f"{op_type}: every tensor operand must be {first} like the parameter, got {t}")
    for t in scalars:
        if t.shape != () or not t.dtype.startswith(("float", "bfloat")):
            raise InferenceFailure(f"{op_type}: the per-step scalars must be 0-d floats, got {t}")


def _infer_sgd_update(attrs, input_types, input_data, num_outputs):
    momentum, dampening = attrs.get("momentum", 0.0), attrs.get("dampening", 0.0)
    tensors = 3 if momentum else 2
    expected = tensors + 1 + (1 if momentum and dampening else 0)
    if len(input_types) != expected:
        raise InferenceFailure(f"SGDUpdate with momentum {momentum} and dampening {dampening} takes {expected} "
                               f"inputs, got {len(input_types)}")
    if attrs.get("nesterov", 0) and not momentum:
        raise InferenceFailure("SGDUpdate: Nesterov momentum requires a momentum")
    outputs = 2 if momentum else 1
    if num_outputs != outputs:
        raise InferenceFailure(f"SGDUpdate with momentum {momentum} has {outputs} output(s), got {num_outputs}")
    operands = [input_types[0], input_types[1]] + ([input_types[3]] if momentum else [])
    _check_operands("SGDUpdate", operands, [input_types[2]] + list(input_types[4:]))
    return [input_types[0]] * outputs


def _infer_adamw_update(attrs, input_types, input_data, num_outputs):
    if num_outputs != 3:
        raise InferenceFailure(f"AdamWUpdate has 3 outputs, got {num_outputs}")
    _check_operands("AdamWUpdate", input_types[:4], input_types[4:])
    return [input_types[0]] * 3


# op type -> (min inputs, max inputs, min outputs, max outputs, attributes, type inference); ir/schema.py makes
# them Tessel-domain schemas.
OPTIMIZER_OPS = {
    "SGDUpdate": (3, 5, 1, 2, SGD_UPDATE_ATTRS, _infer_sgd_update),
    "AdamWUpdate": (6, 7, 3, 3, ADAMW_UPDATE_ATTRS, _infer_adamw_update),
}

# op type -> for each output, the position of the input it is the next value of (param, then the slots). The
# lowering reads every operand at one position before writing there, so an output may overwrite that input.
NEXT_VALUE_OF = {
    "SGDUpdate": (0, 3),
    "AdamWUpdate": (0, 2, 3),
}

REFERENCE = {
    "SGDUpdate": _sgd_reference,
    "AdamWUpdate": _adamw_reference,
}
