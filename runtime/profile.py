"""Per-step times of a single-device artifact, measured in a fresh process with a chosen thread count.

`python -m tessel.runtime.profile DIR --threads N --out TIMES.json` (TVM fixes its
thread pool when first imported, so a compiler process that already imported
TVM measures through this). Inputs are random; times are medians over --runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessel.runtime.profile", description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from tessel.backends.tvm_env import set_threads

    set_threads(args.threads)
    from tessel.runtime.inputs import random_input
    from tessel.runtime.executor import Executor

    executor = Executor(args.artifact)
    rng = np.random.default_rng(0)
    feeds = {name: random_input(t, rng) for name, t in executor.input_types.items()}
    rows = executor.profile(feeds, runs=args.runs)
    Path(args.out).write_text(json.dumps({node: ms for node, _, ms in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
