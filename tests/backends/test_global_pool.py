"""The CPU GlobalAveragePool (backends/cpu/global_pool.py): equal to onnxruntime, its planes summed in vector lanes."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tessel.backends.kernel import KernelSpec
from tessel.backends.lower import build, schedule_kernel
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel import ir
from tessel.compiler.api import compile
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import build_program
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model

LLVM = parse_target("llvm")

# SqueezeNet's classifier planes (13 × 13: ten vectors and 9 left over; large enough to run parallel), a batch of
# two 7 × 7 planes (one left over), planes of whole vectors, 33 × 33 planes (four vector accumulators, one element
# left over), and planes shorter than two vectors: 5 × 5 (ONNX's node test) and 3 × 3 (generic rule).
CASES = [(1, 1000, 13, 13), (2, 24, 7, 7), (1, 8, 4, 8), (1, 8, 33, 33), (1, 3, 5, 5), (1, 5, 3, 3)]


def _spec(shape) -> KernelSpec:
    out = f"float32[{shape[0]},{shape[1]},1,1]"
    return KernelSpec.from_json({"op_type": "GlobalAveragePool", "attrs": {}, "outputs": [out],
                                 "inputs": [{"type": f"float32[{','.join(map(str, shape))}]", "role": "arg"}]})


@pytest.mark.parametrize("shape", CASES, ids=["x".join(map(str, s)) for s in CASES])
def test_global_average_pool_equals_onnxruntime(shape):
    rng = np.random.default_rng(shape[1])
    # Away from zero: the sums' rounding is then relative to the mean.
    x = (rng.standard_normal(shape) + 3.0).astype(np.float32)
    node = helper.make_node("GlobalAveragePool", ["x"], ["y"])
    expected = run_onnxruntime(model([node], [("x", TensorProto.FLOAT, list(shape))],
                                     [("y", TensorProto.FLOAT, None)]), {"x": x})[0]
    spec = _spec(shape)
    func, scheduled = schedule_kernel(spec, LLVM)
    lanes = shape[2] * shape[3] >= 2 * 16
    assert scheduled == lanes  # the generic rule leaves the schedule to the generic scheduler
    if lanes:
        assert "T.vectorized(16)" in func.script()
    mod = tvm()
    got = mod.runtime.tensor(np.zeros(expected.shape, np.float32), mod.cpu())
    build(spec, LLVM).mod["main"](mod.runtime.tensor(x, mod.cpu()), got)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_fused_global_average_pool_equals_onnxruntime(kernel_cache):
    # DenseNet's last kernel holds the pool with its prologue (Concat, the folded BatchNorm, ReLU); here an Add and a
    # ReLU before it and a Mul after it, all one kernel.
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Add", ["x", "b"], ["s"]), helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]), helper.make_node("Mul", ["p", "k"], ["y"])]
    consts = [("b", rng.standard_normal((1, 40, 1, 1)).astype(np.float32)), ("k", np.full((1,), 2.0, np.float32))]
    pooled = model(nodes, [("x", F, [1, 40, 9, 9])], [("y", F, None)], consts)
    x = rng.standard_normal((1, 40, 9, 9)).astype(np.float32)
    graph, _ = run_pipeline(ir.from_onnx(pooled), select_passes([]))
    (spec,) = build_program(graph, LLVM).kernels.values()
    assert [m.spec.op_type for m in spec.members()] == ["Add", "Relu", "GlobalAveragePool", "Mul"]
    assert schedule_kernel(spec, LLVM)[1]
    assert_matches_onnxruntime(compile(pooled, cache_dir=kernel_cache).run({"x": x}), run_onnxruntime(pooled, {"x": x}))
