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

from tessel.compiler.api import compile as compile_model  # noqa: E402
from tessel.compiler.corpus import load_corpus  # noqa: E402
from tessel.runtime.calibrate import calibrate, link_path  # noqa: E402
from tessel.runtime.launch import run_local  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    if not link_path().is_file():
        fit, _ = calibrate()
        print(f"calibrated link: {fit.describe()}")
    model = next(m for m in load_corpus() if m.name == args.model)
    (name, shape), = model.input_shapes.items()
    feeds = {name: np.random.default_rng(0).standard_normal((args.batch,) + tuple(shape[1:])).astype(np.float32)}
    single = compile_model(model.path, batch=args.batch)
    placed = compile_model(model.path, batch=args.batch, devices=args.workers, placement="pipeline",
                           microbatches=args.microbatches)
    one_core = run_local(single.directory, 1, feeds, repeat=args.runs, threads=1)[1]
    all_cores = run_local(single.directory, 1, feeds, repeat=args.runs)[1]
    spread = run_local(placed.directory, args.workers, feeds, repeat=args.runs, threads=1)[1]
    doc = json.loads((placed.directory / "reports" / "placement.json").read_text())
    print(f"{args.model} batch {args.batch}, {args.microbatches} micro-batches, pipeline on {args.workers} workers "
          f"(one core each); {args.runs} batches streamed back to back")
    rows = (("1 worker, 1 core", one_core), (f"{args.workers} workers", spread), ("1 worker, all cores", all_cores))
    for label, measured in rows:
        per_batch = measured["seconds_per_batch"]
        print(f"  {label:<20} {1e3 * per_batch:8.2f} ms/batch  {args.batch / per_batch:7.1f} images/s   "
              f"(one batch alone: {1e3 * measured['latency_s']:.2f} ms)")
    ratio = one_core["seconds_per_batch"] / spread["seconds_per_batch"]
    print(f"  throughput ratio {args.workers} workers / 1 worker (one core each): {ratio:.2f}x (goal >= 1.6x)")
    for label, predicted, measured in (("streamed", doc["predicted_steady_s"], spread["seconds_per_batch"]),
                                       ("one batch", doc["predicted_makespan_s"], spread["latency_s"])):
        print(f"  {label}: predicted {1e3 * predicted:.2f} ms/batch, measured {1e3 * measured:.2f}: "
              f"prediction error {100 * (predicted - measured) / measured:+.1f}% (goal within 15%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
