"""Depthwise and grouped conv kernels: each algorithm's time and GFLOP/s per shape, against onnxruntime's Conv.

The shapes are ShuffleNet's (topology_shufflenet: grouped 1×1 convs with 4 groups,
3×3 depthwise convs) and PP-OCRv4-det's depthwise convs. Every kernel is a
Conv + bias + ReLU built as the compiler builds it (backends/cpu/algorithms.py's
candidates: "nchwc" or "grouped_gemm", and "generic"), timed with TVM's
time_evaluator (median of 25 repeats); onnxruntime runs the same one-node model
in its own process (its thread pool would skew TVM's), its time including the
~2.5 µs Python call. Run under the heavy lock:

    flock /tmp/tessel_heavy.lock nice -n 5 python bench/grouped_conv.py
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

REPEATS = 25
# name: (in channels, out channels, group, kernel, size, stride)
SHAPES = {
    "shufflenet gconv 136→136 g4 28²": (136, 136, 4, 1, 28, 1),
    "shufflenet gconv 272→272 g4 14²": (272, 272, 4, 1, 14, 1),
    "shufflenet gconv 544→544 g4 7²": (544, 544, 4, 1, 7, 1),
    "shufflenet dw 136 3×3 28²": (136, 136, 136, 3, 28, 1),
    "shufflenet dw 272 3×3 14²": (272, 272, 272, 3, 14, 1),
    "shufflenet dw 112 3×3 s2 56²": (112, 112, 112, 3, 56, 2),
    "ppocr dw 96 3×3 80²": (96, 96, 96, 3, 80, 1),
    "ppocr dw 192 5×5 20²": (192, 192, 192, 5, 20, 1),
}


def conv_model(cin, cout, group, kernel, size, stride):
    """One Conv (with bias) + Relu on a 1 × cin × size × size input."""
    from onnx import helper

    from tests.ir.helpers import F, model

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((cout, cin // group, kernel, kernel)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group, pads=[kernel // 2] * 4,
                              strides=[stride, stride]),
             helper.make_node("Relu", ["c"], ["y"])]
    return model(nodes, [("x", F, [1, cin, size, size])], [("y", F, None)], [("w", weight), ("b", bias)])


def flop_count(cin, cout, group, kernel, size, stride) -> int:
    """Multiply-adds × 2 of the conv."""
    out = -(-size // stride)
    return 2 * cout * (cin // group) * kernel * kernel * out * out


def time_tessel(shape) -> dict[str, float]:
    """Milliseconds per algorithm candidate of the shape's conv kernel."""
    from tessel import ir
    from tessel.backends.lower import build
    from tessel.backends.target import parse_target
    from tessel.backends.tvm_env import tvm
    from tessel.compiler.algo import find_layers
    from tessel.compiler.pipeline import run_pipeline, select_passes
    from tessel.compiler.program import ProgramBuilder
    from tessel.runtime.memory import aligned_copy

    tvm_mod = tvm()
    target = parse_target("llvm")
    graph, _ = run_pipeline(ir.from_onnx(conv_model(*shape)), select_passes([]))
    (layer,) = find_layers(graph, "llvm", "all")
    builder = ProgramBuilder(target)
    x = np.random.default_rng(1).standard_normal(layer.node.inputs[0].type.shape).astype(np.float32)
    times = {}
    for algorithm in layer.algorithms:
        spec, args = builder.candidate(layer.node, algorithm, 1)
        executable = build(spec, target)
        tensors = [tvm_mod.runtime.from_dlpack(aligned_copy(x if name == "x" else builder.weights[name]))
                   for name in args]
        tensors.append(tvm_mod.runtime.from_dlpack(aligned_copy(np.zeros(layer.node.outputs[0].type.shape, np.float32))))
        executable["main"](*tensors)
        started = time.perf_counter()
        executable["main"](*tensors)
        number = max(1, int(5e-3 / max(time.perf_counter() - started, 1e-6)))
        timer = executable.mod.time_evaluator("main", tvm_mod.cpu(), number=number, repeat=REPEATS)
        times[algorithm] = timer(*tensors).median * 1e3
    return times


def time_onnxruntime(shape) -> float:
    """Median milliseconds of onnxruntime running the one-node model (2 threads)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(conv_model(*shape).SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(1).standard_normal((1, shape[0], shape[4], shape[4])).astype(np.float32)}
    for _ in range(20):
        session.run(None, feeds)
    samples = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(20):
            session.run(None, feeds)
        samples.append((time.perf_counter() - started) / 20)
    return float(np.median(samples)) * 1e3


def _in_process(fn, shape):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, (shape,))


def main() -> int:
    """Print per shape each algorithm's ms and GFLOP/s and onnxruntime's."""
    print(f"{'conv':<34} {'algorithm':<13} {'ms':>8} {'GFLOP/s':>8} {'/ort':>6}")
    for name, shape in SHAPES.items():
        ort_ms = _in_process(time_onnxruntime, shape)
        gflop = flop_count(*shape) / 1e9
        for algorithm, ms in _in_process(time_tessel, shape).items():
            print(f"{name:<34} {algorithm:<13} {ms:8.4f} {gflop / (ms / 1e3):8.1f} {ms / ort_ms:6.2f}")
        print(f"{name:<34} {'onnxruntime':<13} {ort_ms:8.4f} {gflop / (ort_ms / 1e3):8.1f} {1:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
