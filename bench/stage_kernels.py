"""Where does a pipeline stage's CPU go? Each stage program's kernels against the one-worker program's, node by node.

Times every kernel call of each worker program of a pipeline artifact (its transfers skipped, what they would bring
filled with random data) and of the one-worker program of the same batch, on the native host, one thread, in
this process, as compiler/step_kernels.py times a step's kernels for its predictions. Each stage
runs its program once per micro-batch, so a stage's cost per request is `microbatches` x its program; the table
gives, per node, that cost against the node's cost in the one-worker program, and the sums per stage.

    python bench/stage_kernels.py PIPE_DIR ONE_DIR [--runs 8]

PIPE_DIR: e.g. resnet18 --batch 8 --devices 2 --placement pipeline --microbatches 4; ONE_DIR: --batch 8 on one
device. Run it under the heavy-jobs lock.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.backends.tvm_env import set_threads  # noqa: E402
from tessel.compiler.step_kernels import worker_kernel_sites  # noqa: E402


def node_us(directory: str, worker: int, runs: int) -> dict[str, float]:
    """Microseconds per run of each node's kernel calls in worker `worker`'s program, in the program's order: each
    call timed where the program makes it (compiler/step_kernels.py `worker_kernel_sites`, the median of `runs`),
    its inputs and what its transfers would bring filled with random data."""
    spent: dict[str, float] = {}
    for node, ms in worker_kernel_sites(Path(directory), worker, runs, by_node=True):
        spent[node] = spent.get(node, 0.0) + 1e3 * ms
    return spent


def main() -> None:
    """Print each node's cost per request in its stage against the one-worker program, and the stage sums."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", help="the pipeline artifact (two or more workers)")
    parser.add_argument("one", help="the same model and batch on one device")
    parser.add_argument("--runs", type=int, default=8)
    args = parser.parse_args()
    set_threads(1)
    plan = json.loads((Path(args.pipeline) / "plan.json").read_text())
    microbatches = int(plan.get("microbatches", 1))
    one = node_us(args.one, 0, args.runs)
    stages = [node_us(args.pipeline, w, args.runs) for w in range(len(plan["workers"]))]
    print(f"{'node':<34} {'stage':>5} {'stage us/request':>17} {'one worker us':>14} {'ratio':>6}")
    totals = [[0.0, 0.0] for _ in stages]
    for node, us in one.items():
        for s, times in enumerate(stages):
            if node in times:
                mine = microbatches * times[node]
                totals[s][0] += mine
                totals[s][1] += us
                print(f"{node:<34} {s:>5} {mine:>17.1f} {us:>14.1f} {mine / us if us else float('nan'):>6.2f}")
                break
        else:
            print(f"{node:<34} {'-':>5} {'-':>17} {us:>14.1f}")
    for s, times in enumerate(stages):
        for node in times.keys() - one.keys():
            print(f"{node:<34} {s:>5} {microbatches * times[node]:>17.1f} {'(not in one)':>14}")
            totals[s][0] += microbatches * times[node]
    for s, (mine, theirs) in enumerate(totals):
        print(f"stage {s}: {mine / 1e3:.1f} ms of kernels per request ({microbatches} x its program) against "
              f"{theirs / 1e3:.1f} ms for the same nodes on one worker: {mine / theirs:.2f}x")
    print(f"one worker: {sum(one.values()) / 1e3:.1f} ms of kernels per request; stages together "
          f"{sum(t[0] for t in totals) / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
