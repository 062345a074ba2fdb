"""The separable CPU AveragePool (backends/cpu/average_pool.py): equal to onnxruntime, scheduled row by row, reading
nothing outside its input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tessel import ir
from tessel.backends.kernel import KernelSpec
from tessel.backends.lower import build, schedule_kernel, workspace_bytes
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import build_program
from tests.conftest import run_onnxruntime
from tests.ir.helpers import model

from .test_max_pool import allocates_workspace

REPO = Path(__file__).resolve().parents[2]
LLVM = parse_target("llvm")

# (input shape, AveragePool attributes): ShuffleNet's 3×3 stride-2 pools with pads of 1 (the divisor counts only the
# input's positions), the same counting the pads, a window that overhangs the pads (ceil mode; the overhang never
# counts), asymmetric SAME pads, a long row split in 16s, a 1×3 window and a batch of two, large enough to run
# parallel; then pools written by hand (`average_pool_by_rows`: stride 1 along rows of one vector): inception_v2's
# 3×3 pools over 576 × 14² (parallel), a batch of two counting the pads, and a 3×2 window with stride 2 down the
# columns, asymmetric pads and a ceil-mode overhang.
CASES = [
    ((1, 24, 56, 56), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 8, 14, 14), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),
    ((1, 3, 10, 10), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    ((1, 3, 12, 12), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1, count_include_pad=1)),
    ((1, 5, 9, 12), dict(kernel_shape=[2, 3], strides=[1, 2], auto_pad="SAME_UPPER")),
    ((1, 2, 3, 160), dict(kernel_shape=[2, 2], strides=[1, 1], pads=[0, 1, 0, 1])),
    ((2, 64, 20, 20), dict(kernel_shape=[1, 3], strides=[1, 1], pads=[0, 1, 0, 1])),
    ((1, 576, 14, 14), dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),
    ((2, 8, 7, 7), dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=1)),
    ((1, 4, 9, 10), dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1], ceil_mode=1)),
]


def _spec(shape, attrs, out, dtype: str = "float32") -> KernelSpec:
    return KernelSpec.from_json({"op_type": "AveragePool", "attrs": attrs,
                                 "outputs": [f"{dtype}[{','.join(map(str, out))}]"],
                                 "inputs": [{"type": f"{dtype}[{','.join(map(str, shape))}]", "role": "arg"}]})


def _pool_model(shape, attrs) -> onnx.ModelProto:
    node = helper.make_node("AveragePool", ["x"], ["y"], **attrs)
    return model([node], [("x", TensorProto.FLOAT, list(shape))], [("y", TensorProto.FLOAT, None)], opset=19)


@pytest.mark.parametrize("shape,attrs", CASES, ids=[f"{'x'.join(map(str, s))}-{i}" for i, (s, _) in enumerate(CASES)])
def test_separable_average_pool_equals_onnxruntime(shape, attrs):
    x = np.random.default_rng(shape[-1]).standard_normal(shape).astype(np.float32)
    expected = run_onnxruntime(_pool_model(shape, attrs), {"x": x})[0]
    spec = _spec(shape, attrs, expected.shape)
    _, scheduled = schedule_kernel(spec, parse_target("llvm"))
    assert scheduled
    executable = build(spec, parse_target("llvm"))
    mod = tvm()
    got = mod.runtime.tensor(np.zeros(expected.shape, np.float32), mod.cpu())
    executable.mod["main"](mod.runtime.tensor(x, mod.cpu()), got)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_pool_alone_with_rows_of_one_vector_runs_by_rows_in_parallel_without_a_padded_copy():
    spec = _spec(*CASES[7], (1, 576, 14, 14))
    func, scheduled = schedule_kernel(spec, LLVM)
    script = func.script()
    assert scheduled and "avg_cols" not in script and "T.parallel" in script and "T.vectorized" in script
    assert "pad" not in script.replace("pads", "")
    assert not allocates_workspace(spec)  # each row's scratch is on its thread's stack
    assert workspace_bytes(spec, LLVM) == 16 * 4  # that scratch: the padded row
    strided, _ = schedule_kernel(_spec((1, 136, 28, 28), CASES[0][1], (1, 136, 14, 14)), LLVM)
    assert 'T.sblock("avg_cols")' in strided.script()  # measured faster in TE


def test_a_pool_fused_with_its_relu_runs_the_two_steps_row_by_row_equal_onnxruntime():
    shape, attrs = (1, 48, 56, 56), CASES[0][1]  # 1344 rows: parallel
    pooled = model([helper.make_node("AveragePool", ["x"], ["p"], **attrs), helper.make_node("Relu", ["p"], ["y"])],
                   [("x", TensorProto.FLOAT, list(shape))], [("y", TensorProto.FLOAT, None)], opset=19)
    graph, _ = run_pipeline(ir.from_onnx(pooled), select_passes([]))
    (spec,) = build_program(graph, LLVM).kernels.values()
    assert [member.spec.op_type for member in spec.members()] == ["AveragePool", "Relu"]
    script = schedule_kernel(spec, LLVM)[0].script()
    assert 'T.sblock("avg_cols")' in script and 'T.sblock("avg_rows")' in script and "T.parallel" in script
    assert not allocates_workspace(spec)
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    expected = run_onnxruntime(pooled, {"x": x})[0]
    mod = tvm()
    got = mod.runtime.tensor(np.zeros(expected.shape, np.float32), mod.cpu())
    build(spec, LLVM).mod["main"](mod.runtime.tensor(x, mod.cpu()), got)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_windows_inside_the_input_dilation_and_other_element_types_keep_the_generic_rule():
    inside, scheduled = schedule_kernel(_spec((1, 16, 7, 7), {"kernel_shape": [7, 7]}, (1, 16, 1, 1)),
                                        parse_target("llvm"))
    assert not scheduled and "avg_rows" not in inside.script()
    dilated, scheduled = schedule_kernel(_spec((1, 4, 9, 9), {"kernel_shape": [2, 2], "dilations": [2, 2]},
                                               (1, 4, 7, 7)), parse_target("llvm"))
    assert not scheduled and "avg_rows" not in dilated.script()
    doubles, scheduled = schedule_kernel(_spec((1, 4, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 4, 4, 4),
                                               "float64"), parse_target("llvm"))
    assert not scheduled and "avg_rows" not in doubles.script()


def test_average_pool_reads_nothing_outside_its_input():
    """Pads on every side, a ceil-mode overhang, SAME pads after: reads whose bounds TVM simplifies (sizes whole
    64-byte lines, so each input can end at its guard page)."""
    cases = [CASES[0], ((1, 16, 10, 10), CASES[2][1]), ((1, 16, 12, 12), CASES[3][1]), ((1, 16, 9, 12), CASES[4][1]),
             ((1, 16, 14, 14), CASES[7][1]), ((1, 16, 9, 12), CASES[9][1])]
    specs = {f"case{i}": _spec(shape, attrs, run_onnxruntime(_pool_model(shape, attrs),
                                                             {"x": np.zeros(shape, np.float32)})[0].shape).to_json()
             for i, (shape, attrs) in enumerate(cases)}
    ran = subprocess.run([sys.executable, "-m", "tests.backends.guarded_kernel_worker"], input=json.dumps(specs),
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, (ran.returncode, ran.stdout[-500:], ran.stderr[-2000:])
    assert ran.stdout.split("\n")[:-1] == [f"ran {name} {at}" for name in specs for at in ("start", "end")]
