"""Micro-batches of the backward convolutions (backends/micro_batch.py): a ConvGradFilter run as pieces of its
batch, each piece after the first adding its partial dW to the output buffer it also reads, equals the numpy
reference on the whole batch, for both algorithms (tiled, generic)."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.backends.kernel import ALGORITHM, ARG, KernelInput, KernelSpec
from tessel.backends.lower import build
from tessel.backends.micro_batch import accumulating, resize_batch
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel.ir.grad_ops import REFERENCE
from tessel.ir.schema import TESSEL_DOMAIN, get_schema
from tessel.ir.types import TensorType

LLVM = parse_target("llvm")


def _grad_filter_spec(algorithm: str, x: np.ndarray, dy: np.ndarray, raw_attrs: dict):
    schema = get_schema("ConvGradFilter", TESSEL_DOMAIN)
    attrs = schema.make_attributes(raw_attrs, "test")
    types = [TensorType.of(x), TensorType.of(dy)]
    out = schema.infer(attrs, types, [None, None], 1)[0]
    spec = KernelSpec("ConvGradFilter", tuple(sorted(attrs.items())) + ((ALGORITHM, algorithm),),
                      tuple(KernelInput(t.spec(), ARG) for t in types), (out.spec(),))
    return spec, attrs, out


@pytest.mark.parametrize("algorithm", ["tiled", "generic"])
def test_grad_filter_micro_batches_accumulate(algorithm):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    dy = rng.standard_normal((4, 8, 4, 4)).astype(np.float32)
    spec, attrs, out = _grad_filter_spec(algorithm, x, dy, dict(kernel_shape=(3, 3), pads=(1, 1, 1, 1),
                                                                strides=(2, 2)))
    piece = resize_batch(spec, frozenset({0, 1}), 1)
    assert TensorType.parse(piece.outputs[0]) == out  # dW has no batch axis: a piece's is whole
    runtime = tvm().runtime
    first, rest = build(piece, LLVM)["main"], build(accumulating(piece), LLVM)["main"]
    result = runtime.tensor(np.full(out.shape, np.nan, np.float32))  # the first piece writes, never reads, it
    first(runtime.tensor(x[:1]), runtime.tensor(dy[:1]), result)
    for n in range(1, 4):
        rest(runtime.tensor(x[n:n + 1]), runtime.tensor(dy[n:n + 1]), result, result)  # the output is the sum so far
    (want,) = REFERENCE["ConvGradFilter"](attrs, [x.astype(np.float64), dy.astype(np.float64)])
    np.testing.assert_allclose(result.numpy(), want, rtol=1e-4, atol=1e-4)


def test_only_batch_summing_kernels_accumulate():
    spec = KernelSpec("Relu", (), (KernelInput("float32[2,3]", ARG),), ("float32[2,3]",))
    with pytest.raises(ValueError, match="ConvGradFilter"):
        accumulating(spec)
