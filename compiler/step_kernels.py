"""Seconds of each kernel a multi-worker step artifact calls, for predicting its step time
(compiler/step_timeline.py), measured on this machine where possible and kept in the profile database
(runtime/profile_db.py).

A kernel's time is first its time inside the step: every worker's program run, transfers and collectives left out,
with each kernel call timed where the program makes it, on the step's own buffers (runtime/executor.py
`kernel_site_seconds`), the workers' programs all at once as in a step. A kernel timed on its own, call after call,
finds its data in the caches; in the step the kernels before it have evicted them, and the step's forward and
backward take longer than those times add up to. Where the step could not be timed: the kernel's time on its own,
else a FLOP/byte roofline estimate of the node that calls it (the artifact's graph.json), marked estimated.
Timings run in fresh processes (`python -m tessel.compiler.step_kernels`: TVM fixes its thread pool when first
imported, and each worker runs its kernels on its share of the cores).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from tessel import IMPORT_ROOT
from tessel.ir.costs import bytes_moved, flops
from tessel.ir.types import TensorType, numpy_dtype
from tessel.runtime.instructions import KernelCall, program_from_json
from tessel.runtime.profile_db import ESTIMATE_BYTES_PER_S, ESTIMATE_FLOPS_PER_S, ProfileDB

_log = logging.getLogger("tessel.compile")

TIMING_RUNS = 7
# Timed runs of a whole step program (after one untimed): a step takes up to seconds, and its kernels' times vary
# less between runs than a lone kernel's; the median of 5 keeps one disturbed run (of 3, it took two).
STEP_RUNS = 5
# How long a worker timing its program waits for the others to load (or reach a run) before it starts alone.
BARRIER_TIMEOUT_S = 600
# How often a worker waiting for the others looks whether they are there, and how long it first keeps looking before
# each timed run (the workers' runs take about as long: the wait is short, and its end is to be seen at once).
POLL_S, RUN_SPIN_S = 0.01, 0.05
# How long the timing of a step's programs may take in all, loading included, before its processes are stopped.
STEP_TIMEOUT_S = 2 * BARRIER_TIMEOUT_S


@dataclass(frozen=True)
class KernelTime:
    """One kernel's seconds per call and whether they were measured on this machine (else estimated)."""

    seconds: float
    measured: bool


def kernel_times(directory: Path, plan: Mapping, calls: Iterable[tuple[str, str]], threads: int,
                 measure: bool = True, remeasure: bool = False) -> dict[str, KernelTime]:
    """Each kernel of `calls` ((kernel key, calling node) pairs of the artifact in `directory` with `plan`) by key:
    the profile database's time with `threads` threads inside the step, else on its own (each timed now when
    missing and `measure`, or every one when `remeasure`: `--reprofile`), else estimated."""
    calls = dict((kernel, node) for kernel, node in calls)
    db = ProfileDB()
    workers = len(plan["workers"])
    if remeasure or (measure and any(db.get(k, threads, workers) is None for k in _always_called(plan) & calls.keys())):
        timed = time_step(directory, plan, threads)
        if timed:
            db.put({ProfileDB.key(kernel, threads, workers): ms for kernel, ms in timed.items()})
        elif remeasure:
            _log.warning("kernel times: the step could not be timed again; its kernels keep their earlier times")

    def known(kernel: str) -> float | None:
        inside = db.get(kernel, threads, workers)
        return db.get(kernel, threads) if inside is None else inside

    missing = [k for k in calls if known(k) is None or (remeasure and db.get(k, threads, workers) is None)]
    if missing and (measure or remeasure):
        timed = _time_in_fresh_process(directory, plan, missing, threads)
        if timed:
            db.put({ProfileDB.key(kernel, threads): ms for kernel, ms in timed.items()})
    measured = {k: known(k) for k in calls}
    estimates = _node_estimates(directory) if None in measured.values() else {}
    times = {}
    for kernel, node in calls.items():
        ms = measured[kernel]
        if ms is not None:
            times[kernel] = KernelTime(ms / 1e3, True)
        else:
            times[kernel] = KernelTime(estimates.get(node, _signature_estimate(plan["kernels"][kernel])), False)
    return times


def _always_called(plan: Mapping) -> set[str]:
    """The kernels every run of the step's programs calls, which timing the step gives times of: their top-level
    kernel calls' (a call in pieces calls its pieces' kernels)."""
    return {key for worker in plan["workers"] for call in program_from_json(worker["instructions"])
            if isinstance(call, KernelCall) and not call.runs_at_load
            for key in ([piece.kernel for piece in call.pieces] if call.pieces else [call.kernel])}


def _time_in_fresh_process(directory: Path, plan: Mapping, kernels: list[str], threads: int) -> dict[str, float]:
    """Median milliseconds of `kernels` each timed on its own, by this module's `main` with `threads` TVM threads;
    {} (with a note) when that process fails."""
    with tempfile.TemporaryDirectory(prefix="tessel-kernels-") as scratch:
        request, out = Path(scratch) / "kernels.json", Path(scratch) / "times.json"
        request.write_text(json.dumps({"kernels": {k: {"file": str(Path(directory) / plan["kernels"][k]["file"]),
                                                       "signature": plan["kernels"][k]["signature"]}
                                                   for k in kernels}}))
        done = _run_main(request, out, threads)
        if done.returncode != 0:
            _note(done)
            return {}
        return json.loads(out.read_text())


def time_step(directory: Path, plan: Mapping, threads: int, runs: int = STEP_RUNS) -> dict[str, float]:
    """Milliseconds per call of every kernel the step's programs call, timed inside them: each worker's program in
    a fresh process of its own with `threads` TVM threads, all at once (as the workers share the machine's caches
    and memory in a step), from when all have loaded (`worker_kernel_sites`); a kernel's time is the mean over its
    call sites in every worker. {} (with a note) when a process fails: the others are stopped then, not left
    waiting at the barrier for it."""
    with tempfile.TemporaryDirectory(prefix="tessel-step-") as scratch:
        barrier, workers = Path(scratch), len(plan["workers"])
        started: list[tuple[subprocess.Popen, Path]] = []
        try:
            for worker in range(workers):
                request, out = barrier / f"request{worker}.json", barrier / f"sites{worker}.json"
                request.write_text(json.dumps({"step": str(directory), "worker": worker, "runs": runs,
                                               "barrier": str(barrier), "workers": workers}))
                started.append((_start_main(request, out, threads), out))
            failed = _first_failure(started)
            if failed is not None:
                _note(failed)
                return {}
            sites: dict[str, list[float]] = {}
            for _, out in started:
                for kernel, ms in json.loads(out.read_text()):
                    sites.setdefault(kernel, []).append(ms)
        finally:
            for process, _ in started:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    return {kernel: float(np.mean(ms)) for kernel, ms in sites.items()}


def _first_failure(started: list[tuple[subprocess.Popen, Path]]) -> subprocess.CompletedProcess | None:
    """Wait until every process has ended; the first that failed (its status and stderr) as soon as one does, or
    a timeout (status None) when they have not all ended STEP_TIMEOUT_S after the start."""
    pending = list(started)
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while pending:
        if time.monotonic() > deadline:
            return subprocess.CompletedProcess(pending[0][0].args, None, "", f"not done after {STEP_TIMEOUT_S} s")
        for process, out in list(pending):
            if process.poll() is None:
                continue
            pending.remove((process, out))
            if process.returncode != 0:
                return subprocess.CompletedProcess(process.args, process.returncode, "", _stderr_of(out).read_text())
        time.sleep(0.02)
    return None


def _stderr_of(out: Path) -> Path:
    """Where `_start_main` sends the stderr of the process that writes `out`."""
    return out.with_suffix(".stderr")


def _start_main(request: Path, out: Path, threads: int) -> subprocess.Popen:
    # stderr goes to a file: a pipe nobody reads while the others are waited for could fill and stall the process.
    with open(_stderr_of(out), "w") as errors:
        return subprocess.Popen([sys.executable, "-m", "tessel.compiler.step_kernels", str(request), str(out),
                                 "--threads", str(threads)], stdout=subprocess.DEVNULL, stderr=errors, text=True,
                                cwd=IMPORT_ROOT)


def _run_main(request: Path, out: Path, threads: int) -> subprocess.CompletedProcess:
    process = _start_main(request, out, threads)
    process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, "", _stderr_of(out).read_text())


def _note(done: subprocess.CompletedProcess) -> None:
    lines = done.stderr.strip().splitlines()
    _log.info("note: kernels not timed (status %s), their times are estimates: %s", done.returncode,
              lines[-1] if lines else "")


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


def worker_kernel_sites(directory: Path, worker: int, runs: int = STEP_RUNS,
                        barrier: tuple[Path, int] | None = None, by_node: bool = False) -> list[tuple[str, float]]:
    """(kernel key, or with `by_node` the calling node, milliseconds) of each kernel call of worker `worker`'s
    program of the artifact in `directory`, in program order, timed inside the program (runtime/executor.py
    `kernel_site_seconds`, the median of `runs` runs): its inputs and the values other workers would send it
    filled with data of their types (random floats, zero integers: valid indices and labels). With `barrier` (a
    directory, and how many workers time at once) the runs start when every worker has loaded."""
    from tessel.runtime.executor import Executor

    executor = Executor(directory, worker=worker, kernels_only=True)
    rng = np.random.default_rng(worker)
    values = {name: timing_data(TensorType.parse(executor.plan["values"][name]), rng)
              for name in list(executor.input_types) + executor.received_values()}
    if barrier is not None:
        _wait_for_all(*barrier, worker, "ready", POLL_S)
    return [(key, 1e3 * seconds) for key, seconds
            in executor.kernel_site_seconds(values, runs, by_node, _run_barrier(barrier, worker, runs))]


def _run_barrier(barrier: tuple[Path, int] | None, worker: int, runs: int) -> Callable[[], None] | None:
    """What a worker timing its program calls before each of its `runs` + 1 runs: wait until every worker is about
    to start that run (None without a `barrier`). A step's programs start together, so their memory-bound kernels
    meet in the shared caches and memory; timed runs left to drift apart would not."""
    if barrier is None:
        return None
    started = iter(range(runs + 1))
    return lambda: _wait_for_all(*barrier, worker, f"run{next(started)}.", POLL_S, RUN_SPIN_S)


def _wait_for_all(directory: Path, workers: int, worker: int, name: str, poll_s: float, spin_s: float = 0.0) -> None:
    """Say this worker reached `name` in `directory`, then wait (at most BARRIER_TIMEOUT_S) until all `workers` did:
    for `spin_s` looking again and again, yielding the core in between (a start within microseconds, which a
    worker sharing its core with another still lets run), then every `poll_s`."""
    (Path(directory) / f"{name}{worker}").touch()
    started = time.monotonic()
    while time.monotonic() < started + BARRIER_TIMEOUT_S and sum(1 for _ in Path(directory).glob(f"{name}*")) < workers:
        if time.monotonic() < started + spin_s:
            os.sched_yield()
        else:
            time.sleep(poll_s)


def timing_data(t: TensorType, rng: np.random.Generator) -> np.ndarray:
    """Data of type `t` to time kernels or steps on: standard normal floats (no denormals, no NaN), else zeros (a
    valid index, a valid label)."""
    dtype = np.dtype(numpy_dtype(t.dtype))
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(t.shape).astype(dtype)
    return np.zeros(t.shape, dtype)


def main(argv=None) -> int:
    """Time the kernels a JSON file lists ({"kernels": {key: {file, signature}}}) and write key → median
    milliseconds; or a step's worker ({"step": directory, "worker", "runs", "barrier", "workers"}) and write its
    (kernel key, milliseconds) per call site."""
    parser = argparse.ArgumentParser(prog="python -m tessel.compiler.step_kernels", description=main.__doc__)
    parser.add_argument("request")
    parser.add_argument("out")
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    from tessel.backends.tvm_env import set_threads
    from tessel.runtime.profile import time_library

    set_threads(args.threads)
    request = json.loads(Path(args.request).read_text())
    if "step" in request:
        sites = worker_kernel_sites(Path(request["step"]), request["worker"], request["runs"],
                                    (Path(request["barrier"]), request["workers"]))
        Path(args.out).write_text(json.dumps(sites))
        return 0
    times = {}
    for key, kernel in request["kernels"].items():
        types = [TensorType.parse(t) for t in kernel["signature"]]
        ms = time_library(Path(kernel["file"]), types, TIMING_RUNS)
        if ms is not None:
            times[key] = ms
    Path(args.out).write_text(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
