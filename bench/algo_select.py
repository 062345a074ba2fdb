"""Micro-batch and algorithm selection: ResNet-18 conv layers at batch 16 under an 8 MiB workspace limit.

Compiles the model twice under the same limit: `--algo-select dp` with
power-of-two micro-batches, and the baseline — the best single algorithm per
layer, whole batch (the same DP restricted to `undivided`). Prints, per layer,
the chosen configuration against the baseline (times measured on this machine
through the backend), the sum over the layers, and the end-to-end latency of
both artifacts (each run in its own process) with the default compile and
onnxruntime at the same batch for reference. Also times the ILP on 50 layers ×
20 configurations (goal < 1 s) with its LP-relaxation gap.

    python bench/algo_select.py [--model resnet18] [--batch 16] [--workspace-limit 8MiB] [--runs 10]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tessel.compiler.api import compile as compile_model  # noqa: E402
from tessel.compiler.corpus import load_corpus  # noqa: E402
from tessel.passes.algo_select import Config, select_ilp  # noqa: E402
from tessel.runtime.launch import run_local  # noqa: E402


def ilp_benchmark(layers: int = 50, configs: int = 20) -> None:
    """Time the ILP on random Pareto-shaped instances; print objective, bound and gap."""
    rng = np.random.default_rng(0)
    instance = []
    for _ in range(layers):
        workspace = np.sort(rng.integers(0, 64 << 20, configs))
        seconds = np.sort(rng.uniform(1e-3, 1e-2, configs))[::-1]  # more workspace, less time
        instance.append([Config((("a", 1),), float(t), int(w)) for t, w in zip(seconds, workspace)])
    budget = int(sum(int(np.median([c.workspace for c in layer])) for layer in instance))
    walls = []
    for _ in range(2):  # the first call also starts HiGHS up
        started = time.perf_counter()
        result = select_ilp(instance, budget)
        walls.append(time.perf_counter() - started)
    print(f"ILP {layers} layers x {configs} configurations: MILP solved in {1e3 * result.seconds_to_solve:.0f} ms "
          f"(goal < 1000 ms); with the LP relaxation {1e3 * walls[1]:.0f} ms, first call {1e3 * walls[0]:.0f} ms; "
          f"objective {1e3 * result.objective:.3f} ms, LP bound {1e3 * result.lp_bound:.3f} ms, gap {100 * result.gap:.3f}%")


def onnxruntime_ms(path: Path, batch: int, feeds: dict, runs: int) -> float:
    """Median milliseconds of onnxruntime (all cores) in this process, on the model re-declared at `batch`."""
    import onnx
    import onnxruntime as ort

    from tessel.ir.onnx_import import with_batch

    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    options.log_severity_level = 3
    session = ort.InferenceSession(with_batch(onnx.load(str(path)), batch).SerializeToString(), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    return 1e3 * float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workspace-limit", default="8MiB")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    ilp_benchmark()
    model = next(m for m in load_corpus() if m.name == args.model)
    (name, shape), = model.input_shapes.items()
    feeds = {name: np.random.default_rng(0).standard_normal((args.batch,) + tuple(shape[1:])).astype(np.float32)}
    started = time.perf_counter()
    # Time every candidate afresh: a time taken while the machine was busy would mislead both compiles.
    chosen = compile_model(model.path, batch=args.batch, algo_select="dp", workspace_limit=args.workspace_limit,
                           reprofile=True)
    print(f"compiled with --algo-select dp in {time.perf_counter() - started:.0f} s (profiling included)")
    single = compile_model(model.path, batch=args.batch, algo_select="dp", workspace_limit=args.workspace_limit,
                           batch_policy="undivided")
    default = compile_model(model.path, batch=args.batch)
    doc = json.loads((chosen.directory / "reports" / "algo.json").read_text())
    print(f"\n{args.model} batch {args.batch}, workspace limit {args.workspace_limit}: "
          f"{doc['profiling']['measured']} candidates measured, {doc['profiling']['estimated']} estimated")
    print(f"{'layer':<22} {'chosen':<26} {'ms':>8} {'workspace':>10} {'best single':>12} {'ms':>8} {'speedup':>8}")
    for row in doc["layers"]:
        base = row["best_single"]
        print(f"{row['node']:<22} {row['chosen']['describe']:<26} {1e3 * row['chosen']['seconds']:8.3f} "
              f"{row['chosen']['workspace_bytes'] / 2**20:9.2f}M {base['algorithm'] if base else 'none fits':>12} "
              f"{1e3 * base['seconds'] if base else float('nan'):8.3f} "
              f"{row['speedup'] or float('nan'):7.2f}x")
    if doc["best_single_total_seconds"]:
        print(f"{'conv/matmul layers':<22} {'':<26} {1e3 * doc['total_seconds']:8.3f} {'':>10} {'':>12} "
              f"{1e3 * doc['best_single_total_seconds']:8.3f} {doc['best_single_total_seconds'] / doc['total_seconds']:7.2f}x")
    rows = [("micro-batched (dp)", chosen), ("best single algorithm", single), ("default (no limit)", default)]
    latency = {label: run_local(artifact.directory, 1, feeds, repeat=args.runs)[1]["latency_s"] for label, artifact in rows}
    ort_ms = onnxruntime_ms(model.path, args.batch, feeds, args.runs)
    print(f"\nend to end, median of {args.runs} runs, each artifact in its own process:")
    for label, _ in rows:
        print(f"  {label:<24} {1e3 * latency[label]:8.2f} ms")
    print(f"  speedup of micro-batching over the best single algorithm: "
          f"{latency['best single algorithm'] / latency['micro-batched (dp)']:.2f}x (goal >= 1.2)")
    print(f"  {'onnxruntime':<24} {ort_ms:8.2f} ms  (micro-batched Tessel / onnxruntime: "
          f"{1e3 * latency['micro-batched (dp)'] / ort_ms:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
