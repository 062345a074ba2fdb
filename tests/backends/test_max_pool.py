"""The separable CPU MaxPool (backends/cpu/max_pool.py): equal to onnxruntime, NaN kept, scheduled row by row.

The corpus models with MaxPools (mtcnn_*, resnet18, yolov8n_320, captcha_crnn, oww_embedding) are checked against
onnxruntime in tests/compiler/test_api.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tessel import ir
from tessel.backends.kernel import ARG_BLOCKS, RESULT_BLOCKS, KernelSpec
from tessel.backends.lower import build, schedule_kernel
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import build_program
from tests.conftest import run_onnxruntime
from tests.ir.helpers import model

REPO = Path(__file__).resolve().parents[2]

# (input shape, MaxPool attributes): mtcnn's 3×3 stride-2 pools (SAME_UPPER pads one column and row after, VALID),
# ResNet's stem (pads 1, large enough to run parallel), YOLO's 5×5 stride-1 SPPF, a ceil-mode window that overhangs
# the input, dilation, a 1×2 window (oww_embedding), stride larger than the window, rows longer than one vector
# (split in 16s; and one no vector width divides), a batch of two. The second and the 1×2 window keep the generic
# rule (no padding, rows a vector width divides).
CASES = [
    ((1, 28, 22, 22), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    ((1, 48, 9, 9), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="VALID")),
    ((1, 32, 56, 56), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 16, 20, 20), dict(kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2])),
    ((1, 3, 10, 10), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ((1, 3, 12, 11), dict(kernel_shape=[3, 2], strides=[1, 2], dilations=[2, 3], pads=[1, 0, 2, 1])),
    ((1, 4, 6, 32), dict(kernel_shape=[1, 2], strides=[1, 2])),
    ((1, 4, 5, 17), dict(kernel_shape=[2, 2], strides=[3, 3], auto_pad="SAME_LOWER")),
    ((1, 2, 4, 128), dict(kernel_shape=[2, 2], strides=[1, 1], pads=[0, 1, 0, 1])),
    ((1, 2, 3, 300), dict(kernel_shape=[1, 3], strides=[1, 1])),
    ((2, 5, 7, 7), dict(kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_UPPER")),
]


def _pool_model(shape, attrs) -> onnx.ModelProto:
    node = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
    return model([node], [("x", TensorProto.FLOAT, list(shape))], [("y", TensorProto.FLOAT, None)])


def _spec(shape, attrs, out, indices: bool, dtype: str = "float32") -> KernelSpec:
    outputs = [f"{dtype}[{','.join(map(str, out))}]"] + ([f"int64[{','.join(map(str, out))}]"] if indices else [])
    return KernelSpec.from_json({"op_type": "MaxPool", "attrs": attrs, "outputs": outputs,
                                 "inputs": [{"type": f"{dtype}[{','.join(map(str, shape))}]", "role": "arg"}]})


def _run_kernel(shape, attrs, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(this kernel's result, onnxruntime's) for a MaxPool of `x`: the kernel built alone, without the pipeline."""
    proto = _pool_model(shape, attrs)
    expected = run_onnxruntime(proto, {"x": x})[0]
    spec = _spec(shape, attrs, expected.shape, False)
    executable = build(spec, parse_target("llvm"))
    mod = tvm()
    got = mod.runtime.tensor(np.zeros(expected.shape, np.float32), mod.cpu())
    executable.mod["main"](mod.runtime.tensor(x, mod.cpu()), got)
    return got.numpy(), expected


@pytest.mark.parametrize("shape,attrs", CASES, ids=[f"{'x'.join(map(str, s))}-{i}" for i, (s, _) in enumerate(CASES)])
def test_separable_max_pool_equals_onnxruntime(shape, attrs):
    x = np.random.default_rng(len(shape) + shape[-1]).standard_normal(shape).astype(np.float32)
    x[..., 0] = -np.inf
    got, expected = _run_kernel(shape, attrs, x)
    # onnxruntime pads with the lowest finite float, which a window of padding and -inf then returns; Tessel's pools
    # (the generic rule too) return -inf there, the max of the window's real elements.
    np.testing.assert_array_equal(got, np.where(expected == np.finfo(np.float32).min, -np.inf, expected))


def test_a_nan_in_a_window_is_the_window_max():
    shape, attrs = CASES[0]
    x = np.zeros(shape, np.float32)
    x[0, 3, 4, 4] = np.nan  # inside windows (1, 1), (1, 2), (2, 1), (2, 2) of channel 3: rows and columns 3..4
    x[0, 5, 21, 21] = np.nan  # the last row's and column's window, beside the padding
    got, _ = _run_kernel(shape, attrs, x)
    assert np.argwhere(np.isnan(got)).tolist() == [[0, 3, 1, 1], [0, 3, 1, 2], [0, 3, 2, 1], [0, 3, 2, 2],
                                                   [0, 5, 10, 10]]


def test_the_blocked_pool_is_vectorized_and_keeps_nan():
    """ResNet-18's stem pool on NCHW[16]c: equal to onnxruntime, NaN the max of the window holding one (onnxruntime's
    is not), with no gather or scatter (its NaN test once kept TVM from vectorizing the lanes)."""
    shape, attrs = (1, 32, 112, 112), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    x[0, 17, 50, 60] = np.nan
    expected = run_onnxruntime(_pool_model(shape, attrs), {"x": x})[0]
    spec = KernelSpec.from_json({"op_type": "MaxPool", "attrs": {**attrs, ARG_BLOCKS: [16], RESULT_BLOCKS: [16]},
                                 "outputs": [f"float32[{','.join(map(str, expected.shape))}]"],
                                 "inputs": [{"type": "float32[1,2,112,112,16]", "role": "arg"}]})
    executable = build(spec, parse_target("llvm"))
    assert not re.search(r"vgather|vscatter", executable.mod.inspect_source("asm"))
    mod = tvm()
    blocked = np.ascontiguousarray(x.reshape(1, 2, 16, 112, 112).transpose(0, 1, 3, 4, 2))
    got = mod.runtime.tensor(np.zeros((1, 2, 56, 56, 16), np.float32), mod.cpu())
    executable.mod["main"](mod.runtime.tensor(blocked, mod.cpu()), got)
    got = got.numpy().transpose(0, 1, 4, 2, 3).reshape(expected.shape)
    assert np.argwhere(np.isnan(got)).tolist() == [[0, 17, 25, 30]]  # the one window holding x's NaN
    keep = ~np.isnan(got)
    np.testing.assert_array_equal(got[keep], expected[keep])


def test_the_two_steps_run_row_by_row_and_small_pools_on_one_thread():
    func, scheduled = schedule_kernel(_spec((1, 28, 22, 22), {"kernel_shape": [3, 3], "strides": [2, 2],
                                                              "auto_pad": "SAME_UPPER"}, (1, 28, 11, 11), False),
                                      parse_target("llvm"))
    script = func.script()
    assert scheduled and 'T.sblock("pool_cols")' in script and 'T.sblock("pool_rows")' in script
    assert "pool_pad" not in script and "T.parallel" not in script  # no padded copy; 3.1 µs is too little to split
    large = _spec((1, 64, 112, 112), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (1, 64, 56, 56),
                  False)
    assert "T.parallel" in schedule_kernel(large, parse_target("llvm"))[0].script()
    assert not allocates_workspace(large)


def allocates_workspace(spec) -> bool:
    """Whether the built kernel asks TVM's runtime for a workspace (a row scratch left off the stack calls it once
    per row)."""
    return "TVMBackendAllocWorkspace" in build(spec, parse_target("llvm")).mod.inspect_source("asm")


def test_unpadded_windows_over_rows_of_whole_vectors_keep_the_generic_rule():
    kept, scheduled = schedule_kernel(_spec((1, 24, 72, 32), {"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 24, 36, 16),
                                            False), parse_target("llvm"))
    assert not scheduled and "pool_rows" not in kept.script()
    odd, scheduled = schedule_kernel(_spec((1, 64, 21, 21), {"kernel_shape": [3, 3], "strides": [2, 2]}, (1, 64, 10, 10),
                                           False), parse_target("llvm"))
    assert scheduled and "pool_rows" in odd.script()  # 10 pixels: no vector width divides the row


def test_indices_and_other_element_types_keep_the_generic_rule():
    indices, scheduled = schedule_kernel(_spec((1, 4, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 4, 4, 4),
                                               True), parse_target("llvm"))
    assert not scheduled and "pool_rows" not in indices.script()
    doubles, scheduled = schedule_kernel(_spec((1, 4, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 4, 4, 4),
                                               False, "float64"), parse_target("llvm"))
    assert not scheduled and "pool_rows" not in doubles.script()


def _blocked_pool_spec(channels: int, size: int, attrs) -> KernelSpec:
    """The MaxPool kernel of conv -> pool -> conv, its input kept NCHW[16]c between the convs."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["a"], ["p"], **attrs),
             helper.make_node("Conv", ["p", "w2"], ["y"])]
    weights = [("w", rng.standard_normal((channels, channels, 3, 3)).astype(np.float32)),
               ("w2", rng.standard_normal((channels, channels, 1, 1)).astype(np.float32))]
    proto = model(nodes, [("x", TensorProto.FLOAT, [1, channels, size, size])], [("y", TensorProto.FLOAT, None)],
                  weights)
    graph, _ = run_pipeline(ir.from_onnx(proto), select_passes([]))
    program = build_program(graph, parse_target("llvm"))
    [spec] = [program.kernels[call.kernel] for call in program.instructions if getattr(call, "op", None) == "MaxPool"]
    assert dict(spec.attrs)[ARG_BLOCKS] == (16,)
    return spec


# Windows that read padding on every side, one that overhangs the input (ceil mode), and the blocked kernel's
# stem-like and SPPF-like pools: the reads TVM may simplify the bounds of, at the input's first and last rows.
STEM_POOL = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
GUARDED = [
    ("stem", lambda: _spec((1, 64, 112, 112), STEM_POOL, (1, 64, 56, 56), False)),
    ("same-upper", lambda: _spec((1, 32, 22, 22), {"kernel_shape": [3, 3], "strides": [2, 2],
                                                   "auto_pad": "SAME_UPPER"}, (1, 32, 11, 11), False)),
    ("ceil", lambda: _spec((1, 16, 10, 10), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
                           (1, 16, 5, 5), False)),
    ("blocked-stem", lambda: _blocked_pool_spec(64, 56, STEM_POOL)),
    ("blocked-sppf", lambda: _blocked_pool_spec(16, 20, {"kernel_shape": [5, 5], "strides": [1, 1],
                                                         "pads": [2, 2, 2, 2]})),
]


def test_max_pool_reads_nothing_outside_its_input():
    specs = {name: make().to_json() for name, make in GUARDED}
    ran = subprocess.run([sys.executable, "-m", "tests.backends.guarded_kernel_worker"], input=json.dumps(specs),
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, (ran.returncode, ran.stdout[-500:], ran.stderr[-2000:])
    assert ran.stdout.split("\n")[:-1] == [f"ran {name} {at}" for name in specs for at in ("start", "end")]
