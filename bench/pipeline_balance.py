"""Does a pipeline artifact's cut give its stages equal measured cost? Kernel times against the placement's.

The placement cuts a model into stages by the node times of reports/placement.json (runtime/profile.py, cached in
the profile database). This times each node's kernels in sequence on the native host (Executor.kernel_profile,
one thread, in this process) on a one-device artifact of the same model at the micro-batch size, sums them per
stage of the pipeline artifact, and prints the cut that these times would balance best. With the whole batch on
one device (`--one`) it also prints each node's cost at micro-batch size over its cost in the whole batch.

    python bench/pipeline_balance.py PIPE_DIR MICROBATCHED_DIR [--one BATCH_DIR] [--runs 8]

PIPE_DIR: e.g. resnet18 --batch 8 --devices 2 --placement pipeline --microbatches 4; MICROBATCHED_DIR: the same
with --devices 1 --microbatches 4; BATCH_DIR: --batch 8 --devices 1. Run it under the heavy-jobs lock.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.runtime.executor import Executor  # noqa: E402
from tessel.runtime.inputs import random_input  # noqa: E402


def node_ms(directory: str, runs: int) -> dict[str, float]:
    """Milliseconds per run of each node's kernel calls (one thread), in the program's order."""
    executor = Executor(directory, threads=1)
    rng = np.random.default_rng(0)
    feeds = {name: random_input(t, rng) for name, t in executor.input_types.items()}
    executor.run(feeds)
    spent: dict[str, float] = {}
    for node, _, us in executor.kernel_profile(feeds, runs):
        spent[node] = spent.get(node, 0.0) + us / 1e3
    order = [i.node for i in executor.run_instructions if i.node in spent]
    return {node: spent[node] for node in dict.fromkeys(order)}


def stages(pipeline_dir: str) -> dict[str, int]:
    """Node name -> the worker (stage) that runs it in the pipeline artifact."""
    plan = json.loads((Path(pipeline_dir) / "plan.json").read_text())
    return {i["node"]: rank for rank, worker in enumerate(plan["workers"]) for i in worker["instructions"]}


def main() -> None:
    """Print the pipeline artifact's stages by measured kernel times beside the placement's, and the best cut."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", help="the pipeline artifact (two or more workers)")
    parser.add_argument("microbatched", help="the same model on one device, at the pipeline's micro-batch size")
    parser.add_argument("--one", help="the same model on one device, the whole batch at once")
    parser.add_argument("--runs", type=int, default=8)
    args = parser.parse_args()
    placed = stages(args.pipeline)
    times = node_ms(args.microbatched, args.runs)
    whole = node_ms(args.one, args.runs) if args.one else {}
    report = json.loads((Path(args.pipeline) / "reports" / "placement.json").read_text())
    microbatches = int(report["microbatches"])
    per_stage = [0.0] * (max(placed.values()) + 1)
    print(f"{'node':<28} {'stage':>5} {'ms / micro-batch':>17}" + (f" {'x micro-batches / whole batch':>30}" if whole else ""))
    for node, ms in times.items():
        stage = placed.get(node)
        if stage is not None:
            per_stage[stage] += ms
        ratio = f" {microbatches * ms / whole[node]:>30.3f}" if whole.get(node) else ""
        print(f"{node:<28} {stage if stage is not None else '-':>5} {ms:>17.3f}{ratio}")
    predicted = [1e3 * device["compute_s"] for device in report["per_device"]]
    print("stages, ms per micro-batch: measured " + " / ".join(f"{s:.2f}" for s in per_stage)
          + "; the placement's " + " / ".join(f"{p:.2f}" for p in predicted))
    if len(per_stage) == 2:
        total, running, best = sum(times.values()), 0.0, None
        for node, ms in times.items():
            running += ms
            gap = abs(2 * running - total)
            if best is None or gap < best[0]:
                best = (gap, node, running)
        print(f"best balanced cut by these times: after {best[1]} ({best[2]:.2f} / {total - best[2]:.2f} ms)")
    if whole:
        print(f"one device: whole batch {sum(whole.values()):.1f} ms, {microbatches} micro-batches "
              f"{microbatches * sum(times.values()):.1f} ms")


if __name__ == "__main__":
    main()
