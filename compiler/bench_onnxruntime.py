"""The onnxruntime side of `tessel bench --compare onnxruntime`, in a process of its own (its thread pool must not
share a process with TVM's): `python -m tessel.compiler.bench_onnxruntime MODEL IN.npz --threads N ...`.

Prints one JSON document: the latency statistics (compiler/bench_command.py's) and the threads used.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from tessel.compiler.bench_command import latency_stats, time_calls


def main(argv=None) -> int:
    """Time MODEL on the inputs in IN.npz with onnxruntime; print the statistics as JSON."""
    parser = argparse.ArgumentParser(prog="python -m tessel.compiler.bench_onnxruntime")
    parser.add_argument("model")
    parser.add_argument("inputs")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--duration", type=float)
    parser.add_argument("--iterations", type=int)
    args = parser.parse_args(argv)
    try:
        return _time(args)
    except Exception as exc:  # noqa: BLE001 - the parent reports one line
        print(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, file=sys.stderr)
        return 1


def _time(args: argparse.Namespace) -> int:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
    with np.load(args.inputs, allow_pickle=False) as data:
        wanted = {i.name for i in session.get_inputs()}
        feeds = {name: data[name] for name in data.files if name in wanted}
    samples = time_calls(lambda: session.run(None, feeds), args.warmup, args.duration, args.iterations)
    print(json.dumps({"threads": args.threads, "iterations": len(samples), "latency_ms": latency_stats(samples),
                      "throughput_per_s": len(samples) / sum(samples)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
