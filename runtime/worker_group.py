"""The long-lived worker processes of an InferenceSession, and the pipes that carry its requests.

One process per worker (`python -m tessel.runtime.serve`), each in its own
session (a Ctrl-C in the terminal reaches the client, which stops them), with
two pipes: requests in, answers out. A run's tensors do not cross the pipes:
they go through shared-memory slots (runtime/shared_slots.py, one per request
in flight: each worker's inputs, rank 0's outputs), and the pipes carry a
doorbell naming the slot; other requests (state) carry their tensors on the
pipe. No thread of its own: answers are read by whoever waits
(`Request.result`), and by `submit` while the next request waits for room in a
pipe or for a free slot, so a worker never blocks writing outputs while the
client writes it a request (large tensors both ways would otherwise deadlock).
Each answer then costs one wake-up of the waiting thread, not two.

Failures: a worker's own error line, a worker that exits (its answer pipe
reaches end of file: killed, crashed) or no answer within `timeout` seconds of
the oldest request or the last progress. The first such event starts a short
grace period in which the others report too, the clearest line is kept (a
worker's own error, then a death, then an error caused by a peer), the group is
killed and every pending and later request fails with that line.

No worker outlives the client: a stop message on close, then SIGKILL to the
stragglers; a worker whose control pipe closes exits, and one busy in a
transfer notices within a second that its parent is gone (runtime/worker.py).
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tessel import IMPORT_ROOT

from . import shared_p2p
from .artifact_files import read_plan
from .errors import ExecutionError
from .gpu_workers import comm_backend
from .launch import free_port
from .serve import CONTROL_ENV
from .shared_reduce import REDUCE_ENV, available, close_layout, create_layout, descriptors
from .shared_slots import SLOTS_ENV, SharedSlots, describe, slot_limit
from .wire import ChannelClosed, read_message, write_message
from .worker import LAUNCHER_ENV

# After the first sign of a failure, the other workers have this long to report theirs.
GRACE_S = 1.0
# How long a closing session waits for its workers to exit by themselves before killing them.
STOP_S = 2.0
# Seconds, on top of the timeout, that starting the workers may take (importing torch and TVM, loading kernels).
STARTUP_S = 60.0
# Requests each worker keeps in flight: enough to fill every stage of a pipeline.
WINDOW_PER_WORKER = 2
# Bytes each pipe holds: 1 MiB, Linux's default most for a process without CAP_SYS_RESOURCE.
PIPE_BYTES = 1 << 20
# How often a thread waiting for an answer that another thread reads looks again.
POLL_S = 0.01
# Failures ranked by how well they explain themselves: a worker's own error first, an error after a peer's last.
_OWN, _DIED, _TIMEOUT, _PEER = range(4)


class Request(Future):
    """The outputs of one request, by name. Answers are read by whoever waits: `result()` reads them (this one's
    and those of earlier requests) until its own came; `worker_seconds` is how long rank 0 spent on it."""

    worker_seconds: float | None = None
    # time.perf_counter() (CLOCK_MONOTONIC) stamps: when `submit` began and when the answer was read here, and rank
    # 0's [took the request, answered it]: the request's way to rank 0 and the answer's way back.
    submitted_at: float | None = None
    answered_at: float | None = None
    worker_span: tuple[float, float] | None = None
    profile: dict | None = None  # with TESSEL_STEP_PROFILE=1: each rank's spans (runtime/step_profile.py)

    def __init__(self, group: "WorkerGroup"):
        super().__init__()
        self._group = group

    def result(self, timeout: float | None = None):
        """The outputs, once the workers answered; ExecutionError (one line) when they failed."""
        self._group.wait_for(self, timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None):
        """The request's failure (None when it succeeded), once the workers answered."""
        self._group.wait_for(self, timeout)
        return super().exception(0)


class WorkerGroup:
    """`workers` local processes serving the artifact in `directory`, until `close`."""

    def __init__(self, directory: str | Path, workers: int, threads: int | None, timeout: float,
                 inputs: Sequence[Mapping[str, np.ndarray]] = (), outputs: Mapping[str, np.ndarray] | None = None):
        """`inputs`: what each worker takes of a run (rank 0 first), `outputs`: rank 0's answer; only their dtypes
        and shapes count: they size the shared-memory slots (without them, tensors go over the pipes)."""
        self.timeout = timeout
        self.window = WINDOW_PER_WORKER * workers
        self._pending: deque[Request] = deque()
        self._sending = threading.Lock()  # one request written at a time, whole
        self._reading = threading.RLock()  # one thread reads answers at a time
        self._progress = time.monotonic()
        self._error: str | None = None
        self._closing = False
        self.processes: list[subprocess.Popen] = []
        self._logs: list = []
        self._requests: list[int] = []
        self._answers: list[int] = []
        self._input_slots: list[SharedSlots | None] = []
        self._output_slots: SharedSlots | None = None
        self._next_slot = 0
        try:
            self._make_slots(list(inputs), outputs or {}, workers)
            self._start(Path(directory).resolve(), workers, threads or max(1, (os.cpu_count() or 1) // workers))
        except BaseException:
            self._kill()
            self._close_files()
            raise

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, rank 0 first."""
        return [p.pid for p in self.processes]

    def _make_slots(self, inputs: list[Mapping[str, np.ndarray]], outputs: Mapping[str, np.ndarray],
                    workers: int) -> None:
        """One slot per request in flight for each worker's inputs (none for a worker that takes none) and for
        rank 0's outputs; none where they would take more than `slot_limit()` bytes (those tensors go over the
        pipes)."""
        limit = slot_limit()

        def slots(tensors: Mapping[str, np.ndarray]) -> SharedSlots | None:
            fits = bool(tensors) and describe(tensors, self.window)["slot_bytes"] * self.window <= limit
            return SharedSlots.create(tensors, self.window) if fits else None

        for rank in range(workers):
            self._input_slots.append(slots(inputs[rank] if rank < len(inputs) else {}))
        self._output_slots = slots(outputs)

    def _slot_env(self, rank: int) -> tuple[dict[str, str], tuple[int, ...]]:
        """SLOTS_ENV for `rank` and the descriptors it inherits."""
        mine = {"inputs": self._input_slots[rank], "outputs": self._output_slots if rank == 0 else None}
        mine = {key: slots for key, slots in mine.items() if slots is not None}
        if not mine:
            return {}, ()
        text = "{" + ", ".join(f'"{key}": {slots.to_json()}' for key, slots in mine.items()) + "}"
        return {SLOTS_ENV: text}, tuple(slots.fd for slots in mine.values())

    def _start(self, directory: Path, workers: int, threads: int) -> None:
        port = free_port()
        command = [sys.executable, "-m", "tessel.runtime.serve", str(directory), "--timeout", str(self.timeout),
                   "--window", str(self.window)]
        # The workers all-reduce through one shared segment (runtime/shared_reduce.py) and send the plan's transfers
        # through another (runtime/shared_p2p.py); the client keeps no part of them.
        reduce = create_layout(workers) if workers > 1 and available() else None
        p2p = None
        try:
            plan = read_plan(directory) if workers > 1 and shared_p2p.available() else None
            # GPU workers send device memory over NCCL: rings in host memory do not reach it.
            if plan is not None and comm_backend(str(plan["target"])) == "gloo":
                # A ring never fills: a sender is at most the window's requests (each its micro-batches) ahead.
                count = max(shared_p2p.SLOTS, self.window * int(plan.get("microbatches", 1)))
                p2p = shared_p2p.create_layout(workers, shared_p2p.plan_channels(plan), count)
            self._spawn(command, port, workers, threads, reduce, p2p)
        finally:
            if reduce is not None:
                close_layout(reduce)
            if p2p is not None:
                close_layout(p2p)
        self._await_ready()

    def _spawn(self, command: list[str], port: int, workers: int, threads: int, reduce: dict | None,
               p2p: dict | None) -> None:
        """Start the workers, each with its pipes, its slots and, given `reduce` and `p2p`, the all-reduce and
        the transfers' segments."""
        reduce_env = {REDUCE_ENV: json.dumps(reduce)} if reduce is not None else {}
        reduce_fds = descriptors(reduce) if reduce is not None else ()
        if p2p is not None:
            reduce_env[shared_p2p.P2P_ENV] = json.dumps(p2p)
            reduce_fds += descriptors(p2p)
        for rank in range(workers):
            request_read, request_write = os.pipe()
            answer_read, answer_write = os.pipe()
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TESSEL_THREADS": str(threads),
                   LAUNCHER_ENV: str(os.getpid()), CONTROL_ENV: f"{request_read},{answer_write}", **reduce_env}
            slot_env, slot_fds = self._slot_env(rank)
            env.update(slot_env)
            # An unlinked file: the worker's stderr, read back for a failure's line, and gone with the last descriptor.
            log = tempfile.TemporaryFile()
            self._logs.append(log)
            try:
                self.processes.append(subprocess.Popen(
                    command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=IMPORT_ROOT,
                    pass_fds=(request_read, answer_write, *slot_fds, *reduce_fds), start_new_session=True))
            finally:
                os.close(request_read)
                os.close(answer_write)
                self._requests.append(request_write)
                self._answers.append(answer_read)
            os.set_blocking(request_write, False)
            for fd in (request_write, answer_read):
                _widen(fd)

    def _await_ready(self) -> None:
        """Wait for every worker's ready message; a worker that fails to start stops the group."""
        deadline = time.monotonic() + self.timeout + STARTUP_S
        for rank, fd in enumerate(self._answers):
            try:
                message = read_message(fd, deadline)
            except ChannelClosed:
                message = None
            if message is None or "error" in message[0]:
                self._kill()
                line = message[0]["error"] if message else self._death_line(rank)
                raise ExecutionError(f"the session's workers did not start: {line}")

    # ---- requests -------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """A training artifact's persistent state, through rank 0 after the requests before."""
        return self.submit([{}], op="state").result()

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite state values by name in every worker, after the requests before."""
        self.submit([values] * len(self._requests), op="set_state").result()

    def residuals(self) -> dict[str, np.ndarray]:
        """Every worker's error-feedback residuals of compressed all-reduces, "RANK/TENSOR" -> residual, after the
        requests before (runtime/serve.py)."""
        return self.submit([{}], op="residuals").result()

    def set_residuals(self, per_worker: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Overwrite each worker's residuals (`per_worker[rank]`: tensor name -> residual), after the requests
        before."""
        self.submit(per_worker, op="set_residuals").result()

    def submit(self, feeds: Sequence[Mapping[str, np.ndarray]], op: str = "run") -> Request:
        """Send one request: to each worker its tensors (`feeds`, rank 0 first; runtime/batch_io.py `worker_feeds`
        for a run; a worker past the end of `feeds` gets none, and none of a "state" request); or a state request,
        runtime/serve.py's STATE_OPS or RESIDUAL_OPS. Returns its future."""
        request = Request(self)
        request.submitted_at = time.perf_counter()
        with self._sending:
            if self._closing:
                raise ExecutionError("the session is closed")
            self._check_alive()
            slot = self._take_slot(feeds) if op == "run" else None
            if not self._pending:
                self._progress = time.monotonic()
            self._pending.append(request)
            try:
                deadline = time.monotonic() + self.timeout
                # Rank 0 first: the others' slices are as large or smaller, and a pipeline's later stages wait for
                # rank 0 anyway. A "state" request goes to every worker: pipeline stages send rank 0 the values
                # they hold (runtime/serve.py).
                for rank, fd in enumerate(self._requests):
                    if slot is not None:
                        write_message(fd, {"op": op, "slot": slot}, None, deadline, self._wait_writable)
                        continue
                    write_message(fd, {"op": op}, feeds[rank] if rank < len(feeds) and feeds[rank] else None,
                                  deadline, self._wait_writable)
            except ChannelClosed:
                self._read_answers(GRACE_S)  # a worker is gone: its end of file says which, and fails the request
            except BaseException:
                self._break("interrupted while sending a request")
                raise
        return request

    def _take_slot(self, feeds: Sequence[Mapping[str, np.ndarray]]) -> int | None:
        """Write a run's `feeds` into the next free slot and return its number; None when they do not fit the
        slots (they then go over the pipes). A slot is free once the request that used it was answered: with
        fewer requests pending than slots, the one `count` requests back was."""
        def fits(rank: int, slots: SharedSlots | None) -> bool:
            feed = feeds[rank] if rank < len(feeds) else {}
            return slots.fits(feed) if slots is not None else not feed

        if not all(fits(rank, slots) for rank, slots in enumerate(self._input_slots)):
            return None
        while len(self._pending) >= self.window:
            self.wait_for(self._pending[0], None)
            if self._error is not None:
                raise ExecutionError(self._error)
        slot, self._next_slot = self._next_slot, (self._next_slot + 1) % self.window
        for rank, slots in enumerate(self._input_slots):
            if slots is not None:
                slots.write(slot, feeds[rank])
        return slot

    def _check_alive(self) -> None:
        """Raise the group's failure; a worker that exited since the last request counts as one, even when no
        request needed it yet (its answer pipe's end of file names it)."""
        dead = next((rank for rank, p in enumerate(self.processes) if p.poll() is not None), None)
        if self._error is None and dead is not None:
            self._read_answers(GRACE_S)  # its own line, if it wrote one, or its end of file
            with self._reading:
                if self._error is None:
                    self._fail((_DIED, self._death_line(dead)),
                               {rank: fd for rank, fd in enumerate(self._answers) if rank != dead})
        if self._error is not None:
            raise ExecutionError(self._error)

    def _wait_writable(self, fd: int, deadline: float | None) -> None:
        """While a request waits for room in rank `fd`'s pipe, read answers: a worker blocked writing one would
        otherwise never read the request."""
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ChannelClosed("no worker took the request in time")
            writable = select.select(self._answers, [fd], [], remaining)[1]
            if writable:
                return
            self._read_answers(0)
            if self._error is not None:
                raise ChannelClosed(self._error)

    # ---- answers -------------------------------------------------------------------
    def wait_for(self, request: Request, timeout: float | None) -> None:
        """Read answers until `request` is done (answered or failed), or `timeout` seconds passed."""
        until = None if timeout is None else time.monotonic() + timeout
        while not request.done():
            if self._error is not None or self._closing:
                request.set_exception(ExecutionError(self._error or "the session is closed"))
                return
            wait = self._progress + self.timeout - time.monotonic()
            if until is not None:
                wait = min(wait, until - time.monotonic())
                if wait <= 0:
                    return
            self._read_answers(max(0.0, wait))

    def _read_answers(self, wait: float) -> None:
        """Wait up to `wait` seconds for answers and read those that came; a failure (or no answer in time to a
        pending request) fails the group. Another thread already reading stands for this one."""
        acquired = self._reading.acquire(timeout=min(wait, POLL_S)) if wait > 0 else self._reading.acquire(blocking=False)
        if not acquired:
            return
        try:
            if self._error is not None or self._closing:
                return
            ready = select.select(self._answers, [], [], wait)[0]
            for rank, fd in enumerate(self._answers):
                if fd in ready:
                    failure = self._answer(rank, fd)
                    if failure is not None:
                        self._fail(failure, {r: f for r, f in enumerate(self._answers) if r != rank})
                        return
            if self._pending and time.monotonic() > self._progress + self.timeout:
                self._fail((_TIMEOUT, f"no answer from the workers within {self.timeout:g} s (timeout); "
                                      "stopped them"), dict(enumerate(self._answers)))
        finally:
            self._reading.release()

    def _answer(self, rank: int, fd: int) -> tuple[int, str] | None:
        """Read one message from `rank`: a finished request is resolved; a failure is returned (rank, line)."""
        try:
            message = read_message(fd)
        except ChannelClosed:
            message = None
        except BaseException:
            self._break("interrupted while reading an answer")
            raise
        if message is None:
            return _DIED, self._death_line(rank)
        header, outputs = message
        if "error" in header:
            return (_PEER if header.get("peer") else _OWN), header["error"]
        if "slot" in header:
            outputs = self._output_slots.read(header["slot"]) if self._output_slots is not None else {}
        request = self._pending.popleft()
        self._progress = time.monotonic()
        request.answered_at = time.perf_counter()
        request.worker_seconds = header.get("worker_s")
        request.worker_span = tuple(header["span"]) if "span" in header else None
        request.profile = header.get("profile")
        request.set_result(outputs)
        return None

    def _fail(self, first: tuple[int, str], others: dict[int, int]) -> None:
        """Collect the other workers' reports for a moment, keep the clearest line, kill the group, fail every request."""
        failures = [first]
        deadline = time.monotonic() + GRACE_S
        while others and time.monotonic() < deadline and first[0] != _OWN:
            ready = select.select(list(others.values()), [], [], max(0.0, deadline - time.monotonic()))[0]
            for rank, fd in list(others.items()):
                if fd in ready:
                    failure = self._answer_failure(rank, fd)
                    if failure is not None:
                        failures.append(failure)
                        del others[rank]
        self._error = min(failures, key=lambda f: f[0])[1]
        self._kill()
        pending, self._pending = self._pending, deque()
        for request in pending:
            request.set_exception(ExecutionError(self._error))

    def _break(self, what: str) -> None:
        """A request or an answer was cut in the middle (KeyboardInterrupt): the pipes no longer hold whole
        messages, so the group stops and every request fails."""
        if self._error is None and not self._closing:
            self._error = f"the session was {what}; open a new one"
            self._kill()
            pending, self._pending = self._pending, deque()
            for request in pending:
                request.set_exception(ExecutionError(self._error))

    def _answer_failure(self, rank: int, fd: int) -> tuple[int, str] | None:
        """During the grace period: a failure `rank` reports (finished requests are still delivered)."""
        try:
            return self._answer(rank, fd)
        except IndexError:  # an answer to a request already failed
            return None

    def _death_line(self, rank: int) -> str:
        """Why `rank` stopped answering: its last line on stderr, else how it ended."""
        process = self.processes[rank]
        try:
            code = process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            return f"rank {rank}: worker closed its pipe but still runs"
        lines = _last_lines(self._logs[rank])
        ours = [line for line in lines if line.startswith("tessel worker: ")]
        if ours:
            return ours[-1].removeprefix("tessel worker: ")
        if code < 0:
            return f"rank {rank}: worker (pid {process.pid}) killed by {signal.Signals(-code).name}"
        return f"rank {rank}: worker (pid {process.pid}) exited with status {code}" + (f": {lines[-1]}" if lines else "")

    # ---- shutdown -----------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (a stop message, then SIGKILL after STOP_S) and release every pipe; always returns."""
        if self._closing:
            return
        self._closing = True
        deadline = time.monotonic() + STOP_S
        for fd in self._requests:
            try:
                write_message(fd, {"op": "stop"}, None, deadline)
            except (ChannelClosed, OSError):
                pass
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self._kill()
        with self._reading:
            self._close_files()
            pending, self._pending = self._pending, deque()
        for request in pending:
            if not request.done():
                request.set_exception(ExecutionError("the session was closed before this request finished"))

    def interrupt(self) -> None:
        """What a stop signal's handler does: SIGKILL every worker's process group and fail the group, without
        waiting for anything; `close()` reaps the workers and releases the pipes afterwards.

        The handler runs between two bytecodes of the thread it interrupted, which may hold a lock that `close()`
        takes: Popen's waitpid lock in the middle of a `poll()` (every request polls the workers) made `close()`'s
        reaping wait for itself forever. So nothing here takes a lock or reaps."""
        if self._error is None and not self._closing:
            self._error = "the session was interrupted by a stop signal; open a new one"
        for process in self.processes:
            # poll() only tries Popen's lock (None while the interrupted code holds it), so it cannot block here; a
            # worker it finds reaped is skipped, its pid may already be another process's.
            if process.returncode is None and process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _kill(self) -> None:
        """SIGKILL every worker's process group that still runs, and reap every worker."""
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            process.wait()

    def _close_files(self) -> None:
        for fd in self._requests + self._answers:
            try:
                os.close(fd)
            except OSError:
                pass
        self._requests, self._answers = [], []
        for log in self._logs:
            log.close()
        for slots in [*self._input_slots, self._output_slots]:
            if slots is not None:
                slots.close()
        self._input_slots, self._output_slots = [], None


def _widen(fd: int) -> None:
    """Let the pipe hold PIPE_BYTES (Linux), so that a request's inputs usually go in one write: with the default
    64 KiB, a 600 KB image would take ten round trips between the client and rank 0, each a wake-up."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:  # above /proc/sys/fs/pipe-max-size, or not Linux: the default size works, more slowly
        pass


def _last_lines(log, limit: int = 4096) -> list[str]:
    """The non-empty lines at the end of a worker's stderr file."""
    size = log.seek(0, os.SEEK_END)
    log.seek(max(0, size - limit))
    return [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
