"""An InferenceSession's workers as the ranks of a torchrun job: rank 0 is the client and runs its own program.

Under torchrun (`torchrun --nproc-per-node N script.py`, N the artifact's devices), the session opened on rank 0
joins the job's process group (runtime/rank_group.py `attach`) rather than starting local processes; the ranks
above 0 run `rank_group.follow_sessions()` (or `python -m tessel.runtime.rank_group`). Rank 0 sends them the
artifact's files once (they may be on other machines), then per run a request holding only each rank's own
inputs, and runs its own program in this process; activations travel between the ranks over gloo as they do
between local workers. `close()` tells the followers the session ended (they wait for the next one);
interpreter exit tells them to stop.

Requests run one at a time (`submit` returns a finished future): rank 0 is itself a stage of the run. A failure
(a rank gone: its peers' transfers fail within the timeout) fails that run and every later one with one line;
torchrun then ends the job.
"""
from __future__ import annotations

import atexit
import os
import weakref
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from . import rank_group
from .errors import ExecutionError, TesselError


_attached = False  # whether sessions joined the torchrun group (not `tessel train`, whose followers run steps)
_open: "weakref.WeakSet[RankSession]" = weakref.WeakSet()  # closed before the followers are told to stop
_broken = False  # a transfer between the ranks failed: no more commands are sent


def attaches_here() -> bool:
    """Whether a multi-worker session opened in this process attaches to torchrun's ranks: torchrun started it
    with other ranks, and no training step holds them."""
    ranks = rank_group.torchrun_rank()
    return ranks is not None and ranks[1] > 1 and (_attached or not rank_group.attached())


class RankSession:
    """Rank 0's side of a session on torchrun's ranks, with WorkerGroup's surface (submit, state, set_state, close)."""

    window = 1  # requests run one at a time

    def __init__(self, directory: str | Path, workers: int, threads: int | None, timeout: float):
        from .comm import TorchComm
        from .executor import Executor

        rank, world = rank_group.torchrun_rank()
        if rank != 0:
            raise ExecutionError(f"rank {rank}: an InferenceSession under torchrun is opened on rank 0; the ranks "
                                 "above 0 serve it: `rank_group.follow_sessions()` or `python -m tessel.runtime.rank_group`")
        if world != workers:
            raise ExecutionError(f"{directory}: the artifact runs on {workers} workers but torchrun started {world} "
                                 "ranks (--nproc-per-node x --nnodes must equal the artifact's devices)")
        if _broken:
            raise ExecutionError("torchrun's ranks failed in an earlier session; the job must be started again")
        if len(_open):
            raise ExecutionError("torchrun's ranks serve one session at a time: close the open one first")
        global _attached
        if not _attached:
            rank_group.attach(timeout, rank_group.SESSION_IDLE_S)
            _attached = True
            atexit.register(_stop_followers)
        self._error: str | None = None
        self._closed = False
        self._guard(rank_group.send_files, Path(directory))
        threads = threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
        self._executor = Executor(directory, threads=threads, worker=0, comm=TorchComm(0, timeout))
        _open.add(self)

    @property
    def pids(self) -> list[int]:
        """Empty: the workers are torchrun's ranks, not this process's children."""
        return []

    def submit(self, feeds: Sequence[Mapping[str, np.ndarray]], op: str = "run") -> Future:
        """Run one request on every rank (`feeds`: each rank's inputs, rank 0 first); its finished future, whose
        `worker_seconds` is rank 0's time running it (after the request reached the other ranks)."""
        if op != "run":
            raise ExecutionError(f"'{op}' is not served on torchrun's ranks")
        done: Future = Future()
        theirs = {f"{rank}:{name}": array for rank, feed in enumerate(feeds) if rank for name, array in feed.items()}
        try:
            self._guard(rank_group.send_request, theirs)
            started = time.perf_counter()  # the request's broadcast counts as the session's overhead
            outputs = self._guard(rank_group.run_microbatches, self._executor, feeds[0] if feeds else {})
        except ExecutionError as exc:
            done.set_exception(exc)
            return done
        done.worker_seconds = time.perf_counter() - started
        done.set_result(outputs)
        return done

    def state(self) -> dict[str, np.ndarray]:
        """Rank 0's state, when it holds every value (data-parallel replicas do)."""
        missing = set(self._executor.artifact_plan.get("state", {}).get("names", ())) - set(self._executor.state_names)
        if missing:
            raise ExecutionError(f"state held by the ranks above 0 ({', '.join(sorted(missing))}) is not read on torchrun's ranks")
        return self._executor.state()

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """The same state values on every rank."""
        self._guard(rank_group.send_state, values)
        self._executor.set_state(values)

    def close(self) -> None:
        """Tell the followers the session ended (they wait for the next); always returns."""
        if self._closed:
            return
        self._closed = True
        _open.discard(self)
        if not _broken:
            try:
                rank_group.send_close()
            except Exception:  # noqa: BLE001 - a follower is gone: torchrun ends the job
                pass

    def interrupt(self) -> None:
        """What a stop signal's handler does: fail the session and send the followers nothing (a collective begun
        in the handler could wait on the one the signal interrupted); torchrun stops the other ranks."""
        global _broken
        _broken = True
        self._error = self._error or "the session was interrupted by a stop signal; torchrun stops the other ranks"

    def _guard(self, call, *args):
        """`call(*args)`, its failure kept as the session's one line (every later request fails with it)."""
        if self._closed:
            raise ExecutionError("the session is closed")
        if self._error is not None:
            raise ExecutionError(self._error)
        try:
            return call(*args)
        except (TesselError, RuntimeError) as exc:
            global _broken
            _broken = True
            lines = [line for line in str(exc).splitlines() if line.strip()]
            self._error = lines[0] if lines else type(exc).__name__
            raise ExecutionError(self._error) from None


def _stop_followers() -> None:
    """At rank 0's exit: the sessions still open end, then the followers stop (exit status 0)."""
    for session in list(_open):
        session.close()
    if _broken:
        return
    try:
        rank_group.send_stop()
    except Exception:  # noqa: BLE001 - a follower is gone already
        pass
