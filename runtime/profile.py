"""Kernel timing: one compiled kernel in this process, or every step of an artifact in a fresh one.

`time_kernel` times a kernel library on random data. `profile_steps` asks the
profile database first and measures what it lacks by running
`python -m tessel.runtime.profile DIR --threads N --out TIMES.json` (TVM fixes
its thread pool when first imported, so a compiler process that already
imported TVM measures through this). Inputs are random; `time_kernel` gives the
median over its runs, `profile_steps` each step's fastest of --runs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tessel import IMPORT_ROOT
from tessel.backends.kernel import ARG, KernelSpec
from tessel.ir.types import TensorType, numpy_dtype

from .inputs import random_input
from .memory import aligned_copy
from .profile_db import ProfileDB


# Shortest stretch of time one timing sample covers.
SAMPLE_S = 2e-3


def time_kernel(library: Path, spec: KernelSpec, runs: int, deadline: float | None = None) -> float | None:
    """Median milliseconds of one call of a compiled kernel on random data.

    With a `deadline` (a `time.perf_counter()` instant) the samples stop once it has passed: the median is then over
    fewer than `runs` samples, and None (not measured) when the deadline passed before the first sample.
    """
    types = [TensorType.parse(i.type) for i in spec.inputs if i is not None and i.role == ARG]
    types += [TensorType.parse(o) for o in spec.outputs if o is not None]
    return time_library(library, types, runs, deadline)


def time_library(library: Path, types: Sequence[TensorType], runs: int, deadline: float | None = None) -> float | None:
    """`time_kernel` for a kernel library whose "main" takes arguments of `types` (inputs, then outputs)."""
    from tessel.backends.tvm_env import tvm

    tvm_mod = tvm()
    fn = tvm_mod.runtime.load_module(str(library))["main"]
    rng = np.random.default_rng(0)
    arrays = [aligned_copy(random_input(t, rng).astype(numpy_dtype(t.dtype))) for t in types]
    args = [tvm_mod.runtime.from_dlpack(a) for a in arrays]
    fn(*args)  # the first calls fault the pages in and grow TVM's workspace pool
    begin = time.perf_counter()
    fn(*args)
    # A sample is several calls when one is short: timer and scheduler noise stay small against it.
    calls = max(1, int(SAMPLE_S / max(time.perf_counter() - begin, 1e-7)))
    samples = []
    for _ in range(runs):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        begin = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        samples.append(1e3 * (time.perf_counter() - begin) / calls)
    return float(np.median(samples)) if samples else None


class ProfilingFailed(Exception):
    """The model did not run on random inputs, so its kernels could not be timed; `details` holds the
    measuring process's stderr."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def profile_steps(artifact_dir: Path, kernels: Mapping[str, str], threads: int, db: ProfileDB,
                  runs: int = 5, remeasure: bool = False) -> dict[str, tuple[float, bool]]:
    """Milliseconds per kernel call (node name → (ms, measured)) of `kernels` (node name → kernel key),
    measuring what the database lacks (everything, with `remeasure`: times taken while the machine was busy
    are wrong forever after).

    Measurement runs in a fresh process (this module's `main`) with `threads` TVM threads.
    """
    if remeasure or any(db.get(k, threads) is None for k in kernels.values()):
        with tempfile.TemporaryDirectory(prefix="tessel-profile-") as scratch:
            out = Path(scratch) / "times.json"
            done = subprocess.run([sys.executable, "-m", "tessel.runtime.profile", str(Path(artifact_dir).resolve()),
                                   "--threads", str(threads), "--runs", str(runs), "--out", str(out)],
                                  capture_output=True, text=True, cwd=IMPORT_ROOT)
            if done.returncode != 0:
                # Random inputs can drive a model where it cannot run (an If into a branch that fails at
                # these shapes): then every node time is an estimate.
                raise ProfilingFailed(f"the profiling process exited with status {done.returncode}", done.stderr)
            measured = json.loads(out.read_text())
        db.put({ProfileDB.key(kernels[node], threads): ms for node, ms in measured.items() if node in kernels})
    return {node: (db.get(key, threads), True) for node, key in kernels.items()}


def main(argv=None) -> int:
    """Measure every step of an artifact and write node → fastest milliseconds of --runs as JSON."""
    parser = argparse.ArgumentParser(prog="python -m tessel.runtime.profile", description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from tessel.backends.tvm_env import set_threads

    set_threads(args.threads)
    from .executor import Executor

    executor = Executor(args.artifact, host="python")  # profile times the python host's per-instruction calls
    rng = np.random.default_rng(0)
    feeds = {name: random_input(t, rng) for name, t in executor.input_types.items()}
    # The fastest sample, not the median: the placement compares kernels with each other, and another process
    # competing for the cores or memory bandwidth for part of the measurement inflates some kernels' medians
    # (ResNet-18's weight-bound last convs by half) and moves a pipeline's cut. Runs interleave the kernels,
    # so each kernel's fastest sample comes from the quietest moment it saw.
    rows = executor.profile(feeds, runs=args.runs, statistic=np.min)
    Path(args.out).write_text(json.dumps({node: ms for node, _, ms in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
