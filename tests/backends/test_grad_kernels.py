"""The gradient ops' compiled CPU kernels (backends/lowering/grad.py, backends/cpu/conv_grad_filter.py) equal their
numpy references (ir/grad_ops.py, themselves checked against PyTorch in tests/ir/test_grad_ops.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.backends.kernel import ARG, KernelInput, KernelSpec
from tessel.backends.lower import build
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel.ir.grad_ops import REFERENCE
from tessel.ir.schema import TESSEL_DOMAIN, get_schema
from tessel.ir.types import TensorType

LLVM = parse_target("llvm")


def run_kernel(op_type: str, raw_attrs: dict, arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(the compiled kernel's output, the reference's) for one gradient op on `arrays`."""
    schema = get_schema(op_type, TESSEL_DOMAIN)
    attrs = schema.make_attributes(raw_attrs, "test")
    types = [TensorType.of(a) for a in arrays]
    out = schema.infer(attrs, types, [None] * len(types), 1)[0]
    spec = KernelSpec(op_type, tuple(sorted(attrs.items())), tuple(KernelInput(t.spec(), ARG) for t in types),
                      (out.spec(),))
    runtime = tvm().runtime
    result = runtime.tensor(np.zeros(out.shape, np.float32))
    build(spec, LLVM)["main"](*(runtime.tensor(a) for a in arrays), result)
    (want,) = REFERENCE[op_type](attrs, [a.astype(np.float64) for a in arrays])
    return result.numpy(), want


def _random(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("x_shape,dy_shape,attrs", [
    ((2, 8, 9, 9), (2, 16, 9, 9), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1))),
    ((2, 3, 15, 12), (2, 20, 7, 6), dict(kernel_shape=(5, 3), pads=(2, 1, 1, 1), strides=(2, 2))),  # odd sizes
    ((3, 16, 6, 6), (3, 32, 3, 3), dict(kernel_shape=(1, 1), strides=(2, 2))),
    ((2, 4, 8, 8), (2, 6, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), group=2)),
    ((2, 6, 9, 9), (2, 6, 9, 9), dict(kernel_shape=(3, 3), pads=(2, 2, 2, 2), dilations=(2, 2), group=6)),
    ((2, 5, 12), (2, 7, 6), dict(kernel_shape=(3,), pads=(1, 1), strides=(2,))),
])
def test_conv_grad_filter_kernel(x_shape, dy_shape, attrs):
    got, want = run_kernel("ConvGradFilter", attrs, [_random(0, *x_shape), _random(1, *dy_shape)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x_shape,dy_shape,attrs", [
    ((2, 3, 8, 8), (2, 3, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2))),
    ((1, 2, 7, 7), (1, 2, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), ceil_mode=1)),
    ((1, 2, 9, 9), (1, 2, 4, 4), dict(kernel_shape=(2, 2), strides=(2, 2), dilations=(2, 2))),
    ((2, 3, 10), (2, 3, 6), dict(kernel_shape=(3,), pads=(1, 1), strides=(2,), ceil_mode=1)),
])
def test_max_pool_grad_kernel_with_ties(x_shape, dy_shape, attrs):
    x = np.round(_random(2, *x_shape))  # many ties: the first maximum takes the gradient
    x.reshape(-1)[:3] = [np.nan, -np.inf, np.nan]
    got, want = run_kernel("MaxPoolGrad", attrs, [x, _random(3, *dy_shape)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dy_shape,attrs", [
    ((2, 3, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), count_include_pad=1)),
    ((1, 2, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), ceil_mode=1)),
    ((1, 2, 4, 4), dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2), ceil_mode=1, count_include_pad=1)),
    ((2, 2, 4), dict(kernel_shape=(4,), pads=(2, 2), strides=(3,))),
])
def test_average_pool_grad_kernel(dy_shape, attrs):
    input_shape = {4: (dy_shape[:2] + (8, 8)), 3: dy_shape[:2] + (9,)}[len(dy_shape)]
    if attrs.get("ceil_mode"):
        input_shape = dy_shape[:2] + (7, 7)
    got, want = run_kernel("AveragePoolGrad", dict(attrs, input_shape=input_shape), [_random(4, *dy_shape)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
