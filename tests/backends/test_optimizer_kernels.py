"""The optimizer update ops' compiled CPU kernels (backends/lowering/optimizer.py) equal their numpy references
(ir/optimizer_ops.py), and a few steps of them equal torch.optim's."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tessel.backends.kernel import ARG, KernelInput, KernelSpec
from tessel.backends.lower import build
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel.compiler import optim
from tessel.ir.optimizer_ops import REFERENCE
from tessel.ir.schema import TESSEL_DOMAIN, get_schema
from tessel.ir.types import TensorType
from tessel.passes.optimizer_update import BIAS_CORRECTION2_SQRT, DECAY, GRAD_COEF, LR, STEP_SIZE

LLVM = parse_target("llvm")
# A 3x3 filter (innermost axis 3, a vector tail) and one large enough to run in parallel.
SHAPES = [(5, 4, 3, 3), (37, 29, 17)]


class UpdateKernel:
    """One update op compiled for CPU, called on numpy arrays."""

    def __init__(self, op_type: str, raw_attrs: dict, types: list[TensorType], num_outputs: int):
        schema = get_schema(op_type, TESSEL_DOMAIN)
        self.attrs = schema.make_attributes(raw_attrs, "test")
        self.outputs = schema.infer(self.attrs, types, [None] * len(types), num_outputs)
        spec = KernelSpec(op_type, tuple(sorted(self.attrs.items())), tuple(KernelInput(t.spec(), ARG) for t in types),
                          tuple(o.spec() for o in self.outputs))
        self.op_type = op_type
        self.function = build(spec, LLVM)["main"]

    def __call__(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        runtime = tvm().runtime
        results = [runtime.tensor(np.zeros(o.shape, np.float32)) for o in self.outputs]
        self.function(*(runtime.tensor(a) for a in arrays), *results)
        return [r.numpy() for r in results]

    def reference(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The numpy reference's outputs, in float64."""
        return REFERENCE[self.op_type](self.attrs, [a.astype(np.float64) for a in arrays])


def _compiled(op_type: str, raw_attrs: dict, arrays: list[np.ndarray]) -> UpdateKernel:
    return UpdateKernel(op_type, raw_attrs, [TensorType.of(a) for a in arrays], 1 + _slot_count(op_type, raw_attrs))


def _slot_count(op_type: str, raw_attrs: dict) -> int:
    return 2 if op_type == "AdamWUpdate" else int(bool(raw_attrs.get("momentum")))


def _tensor(rng, shape, positive: bool = False) -> np.ndarray:
    values = rng.standard_normal(shape).astype(np.float32)
    return np.abs(values) if positive else values


def _scalar(value: float) -> np.ndarray:
    return np.array(value, np.float32)


@pytest.mark.parametrize("shape, attrs", [
    (SHAPES[0], {}), (SHAPES[1], {"weight_decay": 0.01}), (SHAPES[0], {"momentum": 0.9}),
    (SHAPES[1], {"momentum": 0.9, "nesterov": 1, "weight_decay": 0.1}),
    (SHAPES[0], {"momentum": 0.8, "dampening": 0.3, "weight_decay": 0.05}),
], ids=["plain", "weight_decay", "momentum", "nesterov", "dampening"])
def test_sgd_update_kernel(shape, attrs):
    rng = np.random.default_rng(0)
    arrays = [_tensor(rng, shape), _tensor(rng, shape), _scalar(0.1)]
    if attrs.get("momentum"):
        arrays.append(_tensor(rng, shape))
        if attrs.get("dampening"):
            arrays.append(_scalar(0.7))
    kernel = _compiled("SGDUpdate", attrs, arrays)
    for got, want in zip(kernel(arrays), kernel.reference(arrays), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, decay", [(SHAPES[1], 0.99), (SHAPES[0], None)], ids=["decay", "no_decay"])
def test_adamw_update_kernel(shape, decay):
    rng = np.random.default_rng(1)
    arrays = [_tensor(rng, shape), _tensor(rng, shape), _tensor(rng, shape), _tensor(rng, shape, positive=True),
              _scalar(0.5), _scalar(0.3)] + ([_scalar(decay)] if decay is not None else [])
    kernel = _compiled("AdamWUpdate", {"beta1": 0.8, "beta2": 0.9, "eps": 1e-3}, arrays)
    for got, want in zip(kernel(arrays), kernel.reference(arrays), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _steps_match_torch(optimizer, torch_optimizer, op_type: str, raw_attrs: dict, steps: int = 3) -> None:
    """`steps` kernel calls and torch.optim steps on the same gradients give the same parameters (float32)."""
    rng = np.random.default_rng(2)
    shape = SHAPES[0]
    param = _tensor(rng, shape)
    slots = [np.zeros(shape, np.float32) for _ in range(_slot_count(op_type, raw_attrs))]
    reference = torch.tensor(param, requires_grad=True)
    stepper = torch_optimizer([reference])
    kernel = None
    for t in range(steps):
        grad = _tensor(rng, shape)
        scalars = optimizer.step_scalars(t)
        if op_type == "SGDUpdate":
            arrays = [param, grad, scalars[LR], *slots] + ([scalars[GRAD_COEF]] if GRAD_COEF in scalars else [])
        else:
            arrays = [param, grad, *slots, scalars[STEP_SIZE], scalars[BIAS_CORRECTION2_SQRT]]
            arrays += [scalars[DECAY]] if DECAY in scalars else []
        kernel = kernel or _compiled(op_type, raw_attrs, arrays)
        param, *slots = kernel(arrays)
        reference.grad = torch.from_numpy(grad)
        stepper.step()
        np.testing.assert_allclose(param, reference.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=f"step {t}")


def test_sgd_kernel_steps_match_torch():
    kwargs = {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05}
    _steps_match_torch(optim.SGD(lr=0.1, **kwargs), lambda p: torch.optim.SGD(p, lr=0.1, **kwargs), "SGDUpdate",
                       kwargs)


def test_adamw_kernel_steps_match_torch():
    _steps_match_torch(optim.AdamW(lr=0.01, weight_decay=0.1),
                       lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), "AdamWUpdate",
                       {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8})


@pytest.mark.parametrize("op_type, raw_attrs", [
    ("SGDUpdate", {"momentum": 0.9, "nesterov": 1, "weight_decay": 0.1}),
    ("AdamWUpdate", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}),
], ids=["sgd", "adamw"])
def test_update_in_place_equals_out_of_place(op_type, raw_attrs):
    """Called with its results over the parameter and the slots (as the step's program runs it), an update gives
    bit for bit what it gives into fresh buffers: every element is loaded before any result is stored."""
    rng = np.random.default_rng(3)
    shape = SHAPES[1]
    tensors = [_tensor(rng, shape), _tensor(rng, shape), _tensor(rng, shape)]
    if op_type == "SGDUpdate":
        arrays = [tensors[0], tensors[1], _scalar(0.1), tensors[2]]
        state = [0, 3]
    else:
        arrays = [*tensors, _tensor(rng, shape, positive=True), _scalar(0.01), _scalar(0.3), _scalar(0.99)]
        state = [0, 2, 3]
    kernel = _compiled(op_type, raw_attrs, arrays)
    fresh = kernel(arrays)
    runtime = tvm().runtime
    buffers = [runtime.tensor(a) for a in arrays]
    kernel.function(*buffers, *(buffers[k] for k in state))
    for k, want in zip(state, fresh, strict=True):
        np.testing.assert_array_equal(buffers[k].numpy(), want)


@pytest.mark.parametrize("op_type, raw_attrs, arrays", [
    ("SGDUpdate", {"momentum": 0.9, "weight_decay": 0.1}, 4),
    ("AdamWUpdate", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}, 7),
], ids=["sgd", "adamw"])
def test_update_kernel_loads_every_element_before_its_first_store(op_type, raw_attrs, arrays):
    """By construction, not by the code generator's choice: in the generated loop body no buffer is read after
    the first result is stored."""
    from tessel.backends.lower import schedule_kernel

    rng = np.random.default_rng(4)
    shape = SHAPES[0]
    values = [_tensor(rng, shape) for _ in range(2)] + ([_scalar(0.1), _tensor(rng, shape)] if op_type == "SGDUpdate"
                                                        else [_tensor(rng, shape), _tensor(rng, shape, positive=True),
                                                              _scalar(0.01), _scalar(0.3), _scalar(0.99)])
    assert len(values) == arrays
    schema = get_schema(op_type, TESSEL_DOMAIN)
    attrs = schema.make_attributes(raw_attrs, "test")
    types = [TensorType.of(a) for a in values]
    outputs = schema.infer(attrs, types, [None] * len(types), 1 + _slot_count(op_type, raw_attrs))
    spec = KernelSpec(op_type, tuple(sorted(attrs.items())), tuple(KernelInput(t.spec(), ARG) for t in types),
                      tuple(o.spec() for o in outputs))
    func, _ = schedule_kernel(spec, LLVM)
    lines = func.script().splitlines()
    stores = [k for k, line in enumerate(lines) if re.match(r"\s*\w+\[[^\]]+\] = ", line)]
    assert len(stores) == len(outputs)
    # From the first store on, nothing reads an element (0-d scalars, `x[()]`, are the step's lr and the like).
    reads = [line.split(" = ", 1)[1] for line in lines[stores[0]:] if " = " in line]
    assert not any(re.search(r"\w\[(?!\(\)\])[^\]]+\]", expression) for expression in reads), "\n".join(lines)
