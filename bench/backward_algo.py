"""Algorithm and micro-batch selection of a training step's backward convolutions, measured on a ResNet-18-shaped
block: x (batch, C, S, S) → Conv 3×3 → Relu → Conv 3×3 → global average pool → linear, cross-entropy, SGD.

The step has the second conv's data gradient (ConvTranspose, fused with Relu's gradient) and both convs' filter
gradients (ConvGradFilter, micro-batches summed into dW). Compiles the step with --algo-select dp (every
candidate measured again, unless the budget runs out), then prints each backward layer's choice against its best
whole-batch algorithm from reports/algo.json, and the step time with and without the selection.

    flock /tmp/tessel_heavy.lock nice -n 5 python bench/backward_algo.py [--channels 128] [--size 28] [--batch 16]
        [--policy powers-of-two] [--budget 300] [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import tessel  # noqa: E402

CLASSES = 10


def block_model(channels: int, size: int, batch: int):
    """The two-conv classifier (ONNX) with random weights."""
    rng = np.random.default_rng(0)
    weights = {"w1": (0.05 * rng.standard_normal((channels, channels, 3, 3))).astype(np.float32),
               "w2": (0.05 * rng.standard_normal((channels, channels, 3, 3))).astype(np.float32),
               "w3": (0.05 * rng.standard_normal((CLASSES, channels))).astype(np.float32),
               "b3": np.zeros(CLASSES, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["h2"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["h2"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             [batch, channels, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, CLASSES])],
                              [numpy_helper.from_array(a, n) for n, a in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def step_ms(trainer, batch: int, channels: int, size: int, steps: int) -> float:
    """Median milliseconds of a training step (after one warm-up step)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, channels, size, size)).astype(np.float32)
    labels = rng.integers(0, CLASSES, batch).astype(np.int64)
    trainer.step({"x": x}, labels)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        trainer.step({"x": x}, labels)
        times.append(1e3 * (time.perf_counter() - began))
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--policy", default="powers-of-two")
    parser.add_argument("--budget", type=float, default=300.0, help="profiling budget, seconds")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    model = block_model(args.channels, args.size, args.batch)
    common = dict(loss="cross_entropy", optimizer=tessel.optim.SGD(lr=0.01, momentum=0.9),
                  input_shapes={"x": (args.batch, args.channels, args.size, args.size)})
    began = time.perf_counter()
    chosen = tessel.compile_training(model, algo_select="dp", batch_policy=args.policy, profile_budget=args.budget,
                                     reprofile=True, **common)
    print(f"compiled with selection in {time.perf_counter() - began:.0f} s")
    doc = json.loads((chosen.step_artifact.directory / "reports" / "algo.json").read_text())
    profiling = doc["profiling"]
    print(f"candidates: {profiling['measured']} measured, {profiling['estimated']} estimated "
          f"(profiling {profiling['seconds']:.0f} s)")
    print(f"{'layer':34} {'op':15} {'pieces':10} {'chosen':24} {'ms':>9} {'workspace':>11} "
          f"{'whole batch':12} {'ms':>9} {'speedup':>8}")
    for row in doc["layers"]:
        c, base = row["chosen"], row["best_single"]
        print(f"{row['node'][:34]:34} {row['op']:15} {row['micro_batches']:10} {c['describe'][:24]:24} "
              f"{1e3 * c['seconds']:9.3f} {c['workspace_bytes']:11d} {base['algorithm']:12} "
              f"{1e3 * base['seconds']:9.3f} {row['speedup']:7.2f}x  ({c['source']}/{base['source']})")
    whole = tessel.compile_training(model, **common)
    print(f"step: {step_ms(chosen, args.batch, args.channels, args.size, args.steps):.1f} ms with selection, "
          f"{step_ms(whole, args.batch, args.channels, args.size, args.steps):.1f} ms without (median of "
          f"{args.steps})")


if __name__ == "__main__":
    main()
