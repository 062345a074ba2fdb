"""Pipelined multi-worker throughput: ResNet-18, batch 8, 4 micro-batches, 2 workers against 1.

Each worker is one device with one core (TVM thread) of its own, so "1 worker"
is the same model on one such device. Prints the throughput of each, their
ratio (goal ≥ 1.6), and the placement's predicted time per batch against the
measured one (goal: within 15%). The link cost is calibrated first (`tessel
calibrate`) unless a calibration is cached. Also prints the 1-worker run with
every core, for reference.

    python bench/distributed.py [--model resnet18] [--batch 8] [--microbatches 4] [--workers 2] [--runs 10]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from compiler.api import compile as compile_model  # noqa: E402
from compiler.corpus import load_corpus  # noqa: E402
from compiler.distribute import cache_root  # noqa: E402
from runtime.launch import run_local  # noqa: E402


def _median(times) -> float:
    return float(np.median(times[1:] if len(times) > 1 else times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    if not (cache_root() / "link.json").is_file():
        from runtime.calibrate import calibrate

        alpha, beta, _ = calibrate()
        print(f"calibrated link: alpha {1e6 * alpha:.1f} us, beta {1e9 * beta:.3f} ns/B")
    model = next(m for m in load_corpus() if m.name == args.model)
    (name, shape), = model.input_shapes.items()
    shapes = {name: (args.batch,) + tuple(shape[1:])}
    feeds = {name: np.random.default_rng(0).standard_normal(shapes[name]).astype(np.float32)}
    single = compile_model(model.path, input_shapes=shapes)
    placed = compile_model(model.path, input_shapes=shapes, devices=args.workers, placement="pipeline",
                           microbatches=args.microbatches)
    one_core = _median(run_local(single.directory, 1, feeds, repeat=args.runs, threads=1)[1]["seconds"])
    all_cores = _median(run_local(single.directory, 1, feeds, repeat=args.runs)[1]["seconds"])
    spread = _median(run_local(placed.directory, args.workers, feeds, repeat=args.runs, threads=1)[1]["seconds"])
    predicted = json.loads((placed.directory / "reports" / "placement.json").read_text())["predicted_makespan_s"]
    error = (predicted - spread) / spread
    print(f"{args.model} batch {args.batch}, {args.microbatches} micro-batches, pipeline on {args.workers} workers "
          f"(one core each)")
    print(f"  1 worker, 1 core:    {1e3 * one_core:8.2f} ms/batch  {args.batch / one_core:7.1f} images/s")
    print(f"  {args.workers} workers:           {1e3 * spread:8.2f} ms/batch  {args.batch / spread:7.1f} images/s")
    print(f"  throughput ratio {args.workers} workers / 1 worker: {one_core / spread:.2f}x (goal >= 1.6x)")
    print(f"  predicted {1e3 * predicted:.2f} ms/batch, measured {1e3 * spread:.2f}: prediction error {100 * error:+.1f}% "
          f"(goal within 15%)")
    print(f"  (1 worker with all cores: {1e3 * all_cores:.2f} ms/batch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
