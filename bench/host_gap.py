"""Where a whole run's time goes: inside the kernels, or between them (the host: the program, Python's boundary).

In one process, `--runs` times in turn: a run as bench/latency.py times it (`Artifact.run`, Python's clock
around the call), then a run of the timed copy of the native program on the same inputs (each kernel call
bracketed by the clock; Executor.kernel_samples). Printed, all measured, medians unless said:

- `run`: the whole run; `timed run`: the timed copy's whole run (it reads two clocks per kernel more);
- `kernels`: the timed run's kernel time (its kernels' sum, per run);
- `host`: the timed run's time outside its kernels (whole minus kernels, per run, then the median): the native
  program between calls, and the Python call around it;
- the per-kernel sums: each kernel's own median (the fair bound a run can reach), 25th percentile, and minimum
  over the runs, added up. The sum of minima is optimistic: no run has every kernel at its fastest, and on a
  shared machine each kernel's minimum comes from whichever run was quietest for it.

The machine's load average (1 minute) before and after is printed with them: on a shared machine a run's
kernels wait for their threads, and that shows in `kernels`, not in `host`.

    python bench/host_gap.py MODEL_OR_ARTIFACT_DIR [--runs 100] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.ir.errors import TesselError  # noqa: E402 (after the path the script needs)

WARMUP_S = 0.3


def measure(artifact, feeds, runs: int) -> dict:
    """The breakdown of the module docstring over `runs` pairs of runs (seconds → ms / µs), with the load."""
    executor = artifact.executor()
    given = artifact.with_defaults(feeds)
    executor.kernel_samples(given, 3)
    warm_until = time.perf_counter() + WARMUP_S
    while time.perf_counter() < warm_until:
        artifact.run(feeds)
    load_before = os.getloadavg()[0]
    whole, rows, walls = [], [], []
    for _ in range(runs):
        started = time.perf_counter()
        artifact.run(feeds)
        whole.append(time.perf_counter() - started)
        _, per_site, wall = executor.kernel_samples(given, 1)
        rows.append(per_site[0])
        walls.append(wall[0])
    per_site = np.stack(rows)
    per_site = per_site[:, per_site.any(axis=0)]  # the call sites that ran (not those of branches never taken)
    kernels = per_site.sum(axis=1)
    return {
        "run_ms": 1e3 * statistics.median(whole),
        "timed_run_ms": 1e3 * statistics.median(walls),
        "kernels_ms": 1e3 * float(np.median(kernels)),
        "host_us": 1e6 * float(np.median(np.array(walls) - kernels)),
        "sum_of_kernel_medians_ms": 1e3 * float(np.median(per_site, axis=0).sum()),
        "sum_of_kernel_p25_ms": 1e3 * float(np.percentile(per_site, 25, axis=0).sum()),
        "sum_of_kernel_minima_ms": 1e3 * float(per_site.min(axis=0).sum()),
        "kernel_calls": per_site.shape[1],
        "runs": runs,
        "load": [load_before, os.getloadavg()[0]],
        "measured": True,
    }


def _artifact(name: str):
    """An artifact directory as it is, or a corpus model compiled (its inputs as the corpus fills them)."""
    from tessel.compiler.artifact import Artifact
    from tessel.compiler.corpus import load_corpus

    if Path(name).is_dir():
        artifact = Artifact(name)
        rng = np.random.default_rng(0)
        from tessel.runtime.inputs import random_input

        return artifact, {n: random_input(t, rng) for n, t in artifact.batch_input_types().items()}
    model = next((m for m in load_corpus() if m.name == name), None)
    if model is None:
        raise ValueError(f"{name!r} is neither an artifact directory nor a corpus model")
    from tessel.compiler.api import compile as compile_model

    return compile_model(model.path, input_shapes=model.input_shapes), model.make_inputs()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an artifact directory or a corpus model name")
    parser.add_argument("--runs", type=int, default=100, help="pairs of runs (default 100)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    if args.runs < 1:
        print("host_gap: --runs must be at least 1", file=sys.stderr)
        return 2
    try:
        artifact, feeds = _artifact(args.model)
        result = measure(artifact, feeds, args.runs)
    except (ValueError, TesselError) as exc:
        print(f"host_gap: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.model}: {result['kernel_calls']} kernel calls, {args.runs} runs each way, load "
          f"{result['load'][0]:.2f} -> {result['load'][1]:.2f} (all measured; medians unless said)")
    print(f"  run {result['run_ms']:.3f} ms; timed run {result['timed_run_ms']:.3f} ms = kernels "
          f"{result['kernels_ms']:.3f} ms + host {result['host_us']:.1f} µs")
    print(f"  per-kernel sums: medians {result['sum_of_kernel_medians_ms']:.3f} ms, 25th percentiles "
          f"{result['sum_of_kernel_p25_ms']:.3f} ms, minima {result['sum_of_kernel_minima_ms']:.3f} ms (optimistic)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
