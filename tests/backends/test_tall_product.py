"""Gemm with transA over tall operands (backends/cpu/tall_product.py), a weight gradient's product: equal to numpy in
every chunking (whole chunks, a tail chunk, one chunk), with padded rows and columns, alpha, beta and C; a
transformer block's training steps, whose weight gradients run it, equal PyTorch's."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.backends.cpu.tall_product import MAX_CHUNKS, MAX_OUTPUT, MIN_DEPTH, WORKSPACE_BYTES, chunk_rows
from tessel.backends.kernel import ARG, KernelInput, KernelSpec
from tessel.backends.lower import build, schedule_kernel
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel.ir.schema import get_schema
from tessel.ir.types import TensorType

LLVM = parse_target("llvm")


def _gemm(arrays: list[np.ndarray], **raw_attrs) -> KernelSpec:
    attrs = get_schema("Gemm").make_attributes({"transA": 1, **raw_attrs}, "test")
    types = [TensorType.of(a) for a in arrays]
    out = TensorType("float32", (arrays[0].shape[1], arrays[1].shape[1]))
    return KernelSpec("Gemm", tuple(sorted(attrs.items())), tuple(KernelInput(t.spec(), ARG) for t in types),
                      (out.spec(),))


def _run(arrays: list[np.ndarray], **attrs) -> np.ndarray:
    spec = _gemm(arrays, **attrs)
    runtime = tvm().runtime
    result = runtime.tensor(np.zeros((arrays[0].shape[1], arrays[1].shape[1]), np.float32))
    build(spec, LLVM)["main"](*(runtime.tensor(a) for a in arrays), result)
    return result.numpy()


def _random(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("depth,m,n", [
    (8192, 32, 96),   # whole chunks, whole tiles (a transformer's qkv weight gradient at batch 512)
    (4099, 33, 17),   # a tail chunk; rows and columns padded
    (300, 7, 3),      # one chunk
    (20000, 8, 16),   # chunk count capped at MAX_CHUNKS
])
def test_equals_numpy(depth, m, n):
    a, b = _random(0, depth, m), _random(1, depth, n)
    want = a.astype(np.float64).T @ b
    np.testing.assert_allclose(_run([a, b]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_alpha_beta_and_bias():
    a, b, c = _random(0, 512, 9), _random(1, 512, 20), _random(2, 20)
    want = 0.5 * (a.astype(np.float64).T @ b) + 2.0 * c
    np.testing.assert_allclose(_run([a, b, c], alpha=0.5, beta=2.0), want, rtol=1e-4, atol=1e-3)


def test_the_tiled_kernel_runs_only_tall_products():
    tall = schedule_kernel(_gemm([_random(0, MIN_DEPTH, 8), _random(1, MIN_DEPTH, 16)]), LLVM)[0]
    short = schedule_kernel(_gemm([_random(0, MIN_DEPTH - 1, 8), _random(1, MIN_DEPTH - 1, 16)]), LLVM)[0]
    wide = schedule_kernel(_gemm([_random(0, MIN_DEPTH, 256), _random(1, MIN_DEPTH, MAX_OUTPUT // 256 + 16)]),
                           LLVM)[0]
    assert "tall_partial" in tall.script()
    assert "tall_partial" not in short.script() and "tall_partial" not in wide.script()


@pytest.mark.parametrize("depth,m,n", [(16384, 32, 96), (4099, 33, 17), (300, 7, 3), (10**6, 16, 16),
                                       (16384, 256, 256)])
def test_chunks_fit_and_are_capped(depth, m, n):
    rows = chunk_rows(depth, m, n)
    assert 1 <= rows <= depth
    chunks = -(-depth // rows)
    assert chunks <= MAX_CHUNKS and (chunks == 1 or chunks * 4 * m * n <= WORKSPACE_BYTES)
    if rows < depth and depth % rows:
        assert rows % 16 == 0


def test_a_transformer_blocks_training_steps_through_it_equal_pytorch(tmp_path, kernel_cache):
    """At batch 32 the block's weight gradients reduce over 512 rows: the tiled kernel runs them."""
    import dataclasses

    from bench.training_models import SPECS
    from tests.compiler.test_training_torch import _check_against_pytorch

    spec = dataclasses.replace(SPECS["transformer_block"], input_shape=(32, 16, 32))
    assert spec.input_shape[0] * spec.input_shape[1] >= MIN_DEPTH
    _check_against_pytorch(spec, "sgd", tmp_path, kernel_cache)
