"""Seconds of each kernel a multi-worker step artifact calls, for predicting its step time
(compiler/step_timeline.py): measured on this machine where the profile database has it (runtime/profile_db.py),
else timed now in a fresh process (`python -m tessel.compiler.step_kernels`: TVM fixes its thread pool when first
imported, and each worker runs its kernels on its share of the cores), else a FLOP/byte roofline estimate of the
node that calls it (the artifact's graph.json), marked estimated.
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from tessel import IMPORT_ROOT
from tessel.ir.costs import bytes_moved, flops
from tessel.ir.types import TensorType
from tessel.runtime.profile_db import ESTIMATE_BYTES_PER_S, ESTIMATE_FLOPS_PER_S, ProfileDB

_log = logging.getLogger("tessel.compile")

TIMING_RUNS = 7


@dataclass(frozen=True)
class KernelTime:
    """One kernel's seconds per call and whether they were measured on this machine (else estimated)."""

    seconds: float
    measured: bool


def kernel_times(directory: Path, plan: Mapping, calls: Iterable[tuple[str, str]], threads: int,
                 measure: bool = True) -> dict[str, KernelTime]:
    """Each kernel of `calls` ((kernel key, calling node) pairs of the artifact in `directory` with `plan`) by key:
    the profile database's time with `threads` threads, timed now when missing and `measure`, else estimated."""
    calls = dict((kernel, node) for kernel, node in calls)
    db = ProfileDB()
    missing = [k for k in calls if db.get(k, threads) is None]
    if missing and measure:
        measured = _time_in_fresh_process(directory, plan, missing, threads)
        if measured:
            db.put({ProfileDB.key(kernel, threads): ms for kernel, ms in measured.items()})
    estimates = _node_estimates(directory) if any(db.get(k, threads) is None for k in calls) else {}
    times = {}
    for kernel, node in calls.items():
        ms = db.get(kernel, threads)
        if ms is not None:
            times[kernel] = KernelTime(ms / 1e3, True)
        else:
            times[kernel] = KernelTime(estimates.get(node, _signature_estimate(plan["kernels"][kernel])), False)
    return times


def _time_in_fresh_process(directory: Path, plan: Mapping, kernels: list[str], threads: int) -> dict[str, float]:
    """Median milliseconds of `kernels`, timed by this module's `main` with `threads` TVM threads; {} (with a note)
    when that process fails."""
    with tempfile.TemporaryDirectory(prefix="tessel-kernels-") as scratch:
        request, out = Path(scratch) / "kernels.json", Path(scratch) / "times.json"
        request.write_text(json.dumps({k: {"file": str(Path(directory) / plan["kernels"][k]["file"]),
                                           "signature": plan["kernels"][k]["signature"]} for k in kernels}))
        done = subprocess.run([sys.executable, "-m", "tessel.compiler.step_kernels", str(request), str(out),
                               "--threads", str(threads)], capture_output=True, text=True, cwd=IMPORT_ROOT)
        if done.returncode != 0:
            _log.info("note: kernels not timed (status %d), their times are estimates: %s", done.returncode,
                      done.stderr.strip().splitlines()[-1:] or "")
            return {}
        return json.loads(out.read_text())


def _node_estimates(directory: Path) -> dict[str, float]:
    """Roofline seconds of each node of the artifact's graph.json; {} when it has none."""
    from tessel.ir.serialize import from_json

    try:
        graph = from_json((Path(directory) / "graph.json").read_text())
    except (OSError, ValueError, KeyError):
        return {}
    return {node.name: max(flops(node) / ESTIMATE_FLOPS_PER_S, bytes_moved(node) / ESTIMATE_BYTES_PER_S)
            for node in graph.nodes}


def _signature_estimate(kernel: Mapping) -> float:
    """Seconds to move a kernel's arguments once, at the roofline's bandwidth (no node to count FLOPs from)."""
    return sum(TensorType.parse(t).nbytes for t in kernel["signature"]) / ESTIMATE_BYTES_PER_S


def main(argv=None) -> int:
    """Time the kernels a JSON file lists ({key: {file, signature}}) and write key → median milliseconds."""
    parser = argparse.ArgumentParser(prog="python -m tessel.compiler.step_kernels", description=main.__doc__)
    parser.add_argument("request")
    parser.add_argument("out")
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    from tessel.backends.tvm_env import set_threads
    from tessel.runtime.profile import time_library

    set_threads(args.threads)
    times = {}
    for key, kernel in json.loads(Path(args.request).read_text()).items():
        types = [TensorType.parse(t) for t in kernel["signature"]]
        ms = time_library(Path(kernel["file"]), types, TIMING_RUNS)
        if ms is not None:
            times[key] = ms
    Path(args.out).write_text(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
