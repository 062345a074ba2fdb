"""Launching the workers of a multi-device artifact on this machine, on loopback.

One process per device (`python -m tessel.runtime.worker`), each in its own session
with its share of the cores. Every worker is watched: once one fails, the
others get a short grace period to exit on their own (a dead peer breaks their
connections at once; a stopped or stuck one makes their receives give up after
--timeout), then the whole group is killed and reaped, so no process outlives
the launch. The first failing worker's line becomes the error. A worker also
leaves by itself once the launching process is gone (killed with SIGKILL).

SIGTERM, SIGINT and SIGHUP to the launching process stop the workers too and
remove the run's scratch directory (inputs, outputs, logs) before the launch
raises `LaunchInterrupted`; the caller's signal handlers are restored after.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tessel import IMPORT_ROOT

from .artifact_files import read_plan
from .errors import PEER_PREFIX, WORKER_PREFIX, ExecutionError
from .gpu_workers import check_gpus

# After one worker failed, the others have this long to exit on their own before they are killed.
GRACE_S = 5.0
POLL_S = 0.05
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class LaunchInterrupted(KeyboardInterrupt):
    """The launching process got SIGTERM, SIGINT or SIGHUP: the workers were stopped and the scratch files removed.

    A KeyboardInterrupt, so that it passes `except Exception` the way Ctrl-C does.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: stopped the workers and removed their scratch files")


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

    Each worker gets `threads` TVM threads (default: its share of the cores). Raises ExecutionError
    (the first failing worker's line) or LaunchInterrupted; either way no worker and no scratch file is left.
    """
    for directory in directories:  # before any worker starts
        check_gpus(read_plan(Path(directory))["target"], workers)
    with _StopSignals() as stop, tempfile.TemporaryDirectory(prefix="tessel-run-") as scratch:
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
                stop.check()
                env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TESSEL_THREADS": str(threads),
                       "TESSEL_LAUNCHER_PID": str(os.getpid())}
                log = open(scratch / f"rank{rank}.log", "w+")
                logs.append(log)
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "tessel.runtime.worker", *(str(Path(d).resolve()) for d in directories), *command_tail],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    cwd=IMPORT_ROOT))
            failed, overdue = _wait(processes, timeout, stop)
        finally:
            _kill(processes)
            for log in logs:
                log.close()
        stop.check()
        if failed or overdue:
            raise ExecutionError(_failure_line(scratch, processes, failed, overdue, timeout + GRACE_S))
        results = []
        for k in range(len(directories)):
            with np.load(scratch / f"out{k}.npz", allow_pickle=False) as data:
                outputs = {name: data[name] for name in data.files}
            results.append((outputs, json.loads((scratch / f"times{k}.json").read_text())))
        return results


class _StopSignals:
    """While active (main thread only), SIGTERM, SIGINT and SIGHUP are only noted; `check` raises
    LaunchInterrupted once one came. Noting instead of raising from the handler keeps the cleanup
    (kill, reap, remove) from being cut short. On exit the previous handlers come back, and a signal
    noted during the cleanup is raised then."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                previous = signal.getsignal(signum)
                # An ignored signal stays ignored (nohup); a handler set outside Python could not be restored.
                if previous not in (signal.SIG_IGN, None):
                    self._previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        """Raise LaunchInterrupted if a stop signal came."""
        if self.signum is not None:
            raise LaunchInterrupted(self.signum)

    def __exit__(self, kind, value, traceback) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if not isinstance(value, LaunchInterrupted):
            self.check()


def _wait(processes: list[subprocess.Popen], timeout: float, stop: _StopSignals) -> tuple[list[int], list[int]]:
    """Wait for every worker; returns the failed ranks in the order they failed, and the ranks still
    running at the deadline (both empty: all succeeded).

    Every worker is polled each round. Once one failed, the others get GRACE_S to exit on their own; once
    one succeeded, the others get the timeout and GRACE_S; whatever still runs then is left to `_kill`.
    """
    failed: list[int] = []
    deadline = None
    while True:
        stop.check()
        codes = [p.poll() for p in processes]
        now = time.monotonic()
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in failed:
                failed.append(rank)
                deadline = now + GRACE_S if deadline is None else min(deadline, now + GRACE_S)
            elif code == 0 and deadline is None:
                deadline = now + timeout + GRACE_S
        running = [rank for rank, code in enumerate(codes) if code is None]
        if not running or (deadline is not None and now > deadline):
            return failed, running
        time.sleep(POLL_S)


def _kill(processes: list[subprocess.Popen]) -> None:
    """Kill the session of every worker still running (stopped ones included) and reap every worker."""
    for p in processes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in processes:
        p.wait()


def _failure_line(scratch: Path, processes: list[subprocess.Popen], failed: list[int], overdue: list[int],
                  allowed_s: float) -> str:
    """The clearest line about the failure: the first failed worker's own message (a worker that failed only
    because a peer did comes after every other), else how it ended."""
    logs = {rank: (scratch / f"rank{rank}.log").read_text(errors="replace").splitlines() for rank in failed}
    for prefix in (WORKER_PREFIX, PEER_PREFIX):
        for rank in failed:
            ours = [line for line in logs[rank] if line.startswith(prefix)]
            if ours:
                return ours[-1].removeprefix(prefix)
    if not failed:
        return (f"rank {overdue[0]}: still running {allowed_s:.0f} s after another worker finished; "
                f"stopped it (raise --timeout if it needs longer)")
    rank = failed[0]
    code = processes[rank].returncode
    if code < 0:
        return f"rank {rank}: worker killed by {signal.Signals(-code).name}, with no message"
    return f"rank {rank}: worker exited with status {code} and no message"
