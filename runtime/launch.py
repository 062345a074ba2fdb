"""Launching the workers of a multi-device artifact on this machine, on loopback.

One process per device (`python -m runtime.worker`), each with its share of
the cores. If any worker fails, the others stop within the timeout (their
receives give up); whatever still runs after that is killed, so no process
outlives the launch. The first failing worker's line becomes the error.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .errors import ExecutionError

GRACE_S = 5.0


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(directory: str | Path, workers: int, inputs: Mapping[str, np.ndarray] | None = None, *,
              repeat: int = 0, timeout: float = 30.0, threads: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Run the artifact on `workers` local processes; returns rank 0's outputs and its measured times."""
    return run_local_many([directory], workers, [inputs], repeat=repeat, timeout=timeout, threads=threads)[0]


def run_local_many(directories: Sequence[str | Path], workers: int,
                   inputs: Sequence[Mapping[str, np.ndarray] | None], *, repeat: int = 0,
                   timeout: float = 30.0, threads: int | None = None) -> list[tuple[dict[str, np.ndarray], dict]]:
    """Run several artifacts in turn on one launch of `workers` local processes (startup paid once).

    Each worker gets `threads` TVM threads (default: its share of the cores).
    """
    with tempfile.TemporaryDirectory(prefix="tessel-run-") as scratch:
        scratch = Path(scratch)
        command_tail = ["--io-dir", str(scratch), "--repeat", str(repeat), "--timeout", str(timeout)]
        for k, feeds in enumerate(inputs):
            if feeds is not None:
                np.savez(scratch / f"in{k}.npz", **{name: np.asarray(v) for name, v in feeds.items()})
        threads = threads or max(1, (os.cpu_count() or 1) // workers)
        port = free_port()
        processes, logs = [], []
        try:
            for rank in range(workers):
                env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TESSEL_THREADS": str(threads)}
                log = open(scratch / f"rank{rank}.log", "w+")
                logs.append(log)
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "runtime.worker", *(str(Path(d).resolve()) for d in directories), *command_tail],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    cwd=Path(__file__).resolve().parent.parent))
            _wait(processes, timeout)
        finally:
            _kill(processes)
            for log in logs:
                log.close()
        failures = [(rank, p.returncode) for rank, p in enumerate(processes) if p.returncode != 0]
        if failures:
            raise ExecutionError(_failure_line(scratch, failures))
        results = []
        for k in range(len(directories)):
            with np.load(scratch / f"out{k}.npz", allow_pickle=False) as data:
                outputs = {name: data[name] for name in data.files}
            results.append((outputs, json.loads((scratch / f"times{k}.json").read_text())))
        return results


def _wait(processes: list[subprocess.Popen], timeout: float) -> None:
    """Wait for all; once one fails, give the others the timeout (plus a grace period) to notice."""
    deadline = None
    while any(p.poll() is None for p in processes):
        if deadline is None and any(p.returncode not in (None, 0) for p in processes):
            deadline = time.monotonic() + timeout + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _kill(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _failure_line(scratch: Path, failures: list[tuple[int, int]]) -> str:
    """The clearest line the failed workers printed (a worker's own message beats a killed one's silence)."""
    for rank, _ in failures:
        lines = (scratch / f"rank{rank}.log").read_text(errors="replace").splitlines()
        ours = [line for line in lines if line.startswith("tessel worker: ")]
        if ours:
            return ours[-1].removeprefix("tessel worker: ")
    rank, code = failures[0]
    return f"rank {rank}: worker exited with status {code} and no message"
