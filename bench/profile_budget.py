"""Does `--profile-budget` hold? Time the algorithm-selection profiling stage of a model against its budget.

Runs the compile's stages up to the candidate timing (import, passes, program)
and then `time_candidates` with every candidate measured anew (`--reprofile`,
so cached times do not make the budget look kept), and prints the stage's
wall time against the budget and how many candidates were measured.

    flock /tmp/tessel_heavy.lock python bench/profile_budget.py [--model resnet18] [--batch 4] [--budget 10]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel import ir  # noqa: E402
from tessel.backends.cache import KernelCache  # noqa: E402
from tessel.backends.target import parse_target  # noqa: E402
from tessel.compiler.algo import find_layers, time_candidates  # noqa: E402
from tessel.compiler.corpus import load_corpus  # noqa: E402
from tessel.compiler.pipeline import run_pipeline  # noqa: E402
from tessel.compiler.program import selection_builder  # noqa: E402
from tessel.ir.onnx_import import with_batch  # noqa: E402
from tessel.runtime.profile_db import ProfileDB  # noqa: E402


def main() -> int:
    """Print the profiling stage's wall time against the budget."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budget", type=float, default=10.0)
    parser.add_argument("--policy", default="powers-of-two")
    args = parser.parse_args()
    path = next(entry.path for entry in load_corpus() if entry.name == args.model)
    graph = ir.from_onnx(with_batch(ir.load_model(path), args.batch))
    graph, _ = run_pipeline(graph)
    spec = parse_target("llvm")
    layers = find_layers(graph, spec.kind, args.policy)
    started = time.perf_counter()
    timing = time_candidates(layers, selection_builder(graph, spec), spec, KernelCache(), ProfileDB(), args.budget,
                             remeasure=True)
    wall = time.perf_counter() - started
    total = timing.measured + timing.estimated
    print(f"{args.model} batch {args.batch}: profiling (building and timing kernels) took {timing.seconds:.2f} s for "
          f"a budget of {args.budget:.1f} s ({100 * (timing.seconds / args.budget - 1):+.1f}%), after "
          f"{timing.enumerate_seconds:.2f} s making the candidates' specs ({wall:.2f} s in all); {timing.measured} of "
          f"{total} candidates measured ({timing.cached} of them from the profile database), {timing.estimated} "
          "estimated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
