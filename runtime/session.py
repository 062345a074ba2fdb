"""InferenceSession: load an artifact once, run it many times (onnxruntime's surface).

A single-worker artifact runs in this process on the Executor. A multi-worker
artifact starts its worker group once (runtime/worker_group.py: one local
process per worker) and keeps it until `close()`; each run is then a request
sent to the workers.

Control channel, and why: the session is a client of its workers over two
pipes per worker (requests in, answers out), carrying runtime/wire.py's
messages (a JSON header and raw tensor bytes, never pickle); a run's tensors
go through shared-memory slots instead (runtime/shared_slots.py), the pipes
carry only a doorbell naming the slot. The workers still
exchange activations with each other over gloo, as the one-shot launch does.
The alternative, the client joining the gloo group as an extra rank, would
change every program's rank numbers and tie the client to torch's process
group (one per process, unusable after any failure, a rendezvous per session);
pipes need neither, cost a few microseconds, and give two things for free: a
worker learns that the client is gone from its pipe's end of file, and the
client learns that a worker died (kill -9, crash) from its answer pipe's end of
file, at once rather than after a transfer's timeout.

Requests are pipelined: `run_async` returns at once, so with a pipeline
artifact request k+1 enters stage 0 while request k is in stage 1; `run_many`
streams an iterable of feeds with a window of requests in flight.

Shutdown: `close()`, the with-block, interpreter exit (atexit) and SIGTERM or
SIGHUP to a process that left their default action (the handler stops every
session's workers and raises SessionInterrupted, a KeyboardInterrupt; with no
session open the signal acts as by default) all stop the workers; SIGINT
(Ctrl-C) raises KeyboardInterrupt as usual and the exit stops them. Killed with SIGKILL, the
client cannot stop anyone: its workers notice that their pipes closed or that
their parent is gone, and exit.

torchrun: in a process that torchrun started with other ranks, a multi-worker
session attaches to them instead of starting local workers (runtime/rank_session.py):
rank 0 opens the session and runs its own program, the ranks above 0 serve it
(`tessel.runtime.rank_group.follow_sessions()`). `torchrun ... -m
tessel.runtime.worker DIR` still runs an artifact once per launch.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from tessel.ir.types import TensorType, numpy_dtype

from .artifact_files import read_plan, verify_files, worker_count
from .batch_io import (batch_input_types, batch_output_types, check_inputs, input_specs, read_defaults,
                       with_defaults, worker_feeds)
from .errors import ArtifactError, InputError

# onnxruntime's names of tensor element types, by Tessel's dtype names.
_ORT_TYPES = {"float32": "float", "float64": "double", "float16": "float16", "bfloat16": "bfloat16",
              "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8",
              "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool"}


@dataclass(frozen=True)
class TensorInfo:
    """An input or output of the model, as onnxruntime's NodeArg: name, shape (whole batch), type ('tensor(float)')."""

    name: str
    shape: list[int]
    type: str


class InferenceSession:
    """A loaded artifact that runs many times: in this process (one worker) or on workers started once."""

    def __init__(self, path_or_artifact, workers: int | None = None, threads: int | None = None,
                 timeout: float = 30.0):
        """`path_or_artifact`: an artifact directory (its plan and files are checked) or a loaded Artifact.
        `workers` must equal the artifact's devices when given; `threads` are TVM threads per worker (default: the
        cores shared among the workers); `timeout`: seconds a request (and a transfer between workers) may take
        before the run fails."""
        if hasattr(path_or_artifact, "plan") and hasattr(path_or_artifact, "directory"):
            loaded, self.directory, self.plan = path_or_artifact, Path(path_or_artifact.directory), path_or_artifact.plan
        else:
            loaded, self.directory = None, Path(path_or_artifact)
            self.plan = read_plan(self.directory)
            verify_files(self.directory, self.plan)
        devices = worker_count(self.plan)
        if workers is not None and workers != devices:
            raise ArtifactError(f"{self.directory}: compiled for {devices} device(s); run it with "
                                f"{devices} worker(s) or recompile with --devices {workers}")
        self.workers = devices
        self.microbatches = int(self.plan.get("microbatches", 1))
        self.timeout = timeout
        self.threads = threads
        self._group = None
        self._closed = False
        # What run(feeds) calls straight away when the run is the executor's own: one worker, one micro-batch, no
        # defaults to add (on a small model each layer of calls costs a part of the run that shows).
        self._direct = None
        # Read once here, not on every run.
        self._defaults = loaded.input_defaults() if loaded is not None else read_defaults(self.directory, self.plan)
        self._inputs = [_info(name, t) for name, t in batch_input_types(self.plan).items()]
        self._outputs = [_info(name, t) for name, t in batch_output_types(self.plan).items()]
        self._input_specs = input_specs(self.plan)
        if devices > 1:
            self._group = self._start_group(devices, threads, timeout)
            _OPEN_GROUPS.add(self._group)
            # A session dropped without close() still stops its workers when it is collected.
            weakref.finalize(self, _close_group, self._group)
        elif loaded is not None and threads is None:
            self._executor = loaded.executor()  # the Artifact's own executor: its weights are loaded once
        else:
            from .executor import Executor

            self._executor = Executor(self.directory, threads=threads)
        if devices == 1 and self.microbatches == 1 and not self._defaults:
            self._direct = self._executor.run

    def _start_group(self, devices: int, threads: int | None, timeout: float):
        """The workers: torchrun's ranks when this process is rank 0 of a torchrun job, else local processes."""
        from .rank_session import RankSession, attaches_here

        if attaches_here():
            return RankSession(self.directory, devices, threads, timeout)
        from .gpu_workers import check_gpus
        from .worker_group import WorkerGroup

        check_gpus(self.plan["target"], devices)  # before any worker starts
        global _starting
        _stop_on_signals()
        _starting += 1  # a stop signal during the start-up interrupts it: the group kills what it started
        try:
            return WorkerGroup(self.directory, devices, threads, timeout, *_slot_shapes(self.plan))
        finally:
            _starting -= 1

    # ---- onnxruntime's surface -----------------------------------------------------
    def get_inputs(self) -> list[TensorInfo]:
        """The model's inputs (name, whole-batch shape, onnxruntime type string)."""
        return list(self._inputs)

    def get_outputs(self) -> list[TensorInfo]:
        """The model's outputs (name, whole-batch shape, onnxruntime type string)."""
        return list(self._outputs)

    def run(self, output_names, input_feed: Mapping[str, np.ndarray] | None = None):
        """`run(output_names, input_feed)` → list of outputs (all of them when `output_names` is None), as
        onnxruntime; or `run(feeds)` → dict of every output by name."""
        if input_feed is None and type(output_names) is dict and self._direct is not None:
            return self._direct(output_names)
        if input_feed is None and isinstance(output_names, Mapping):
            return self._run(output_names)
        if input_feed is None:
            raise InputError("run(output_names, input_feed) needs the inputs by name (or call run(feeds))")
        known = [info.name for info in self._outputs]
        names = known if output_names is None else list(output_names)
        unknown = [name for name in names if name not in known]
        if unknown:
            raise InputError(f"unknown output(s) {', '.join(map(repr, unknown))}; the model's outputs are {', '.join(known)}")
        outputs = self._run(input_feed)
        return [outputs[name] for name in names]

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One run, waited for. In this process without a future: on a small model its condition and lock cost
        a good part of the run."""
        if self._group is not None or self._closed:
            return self.run_async(feeds).result()
        return self._run_here(with_defaults(self._defaults, feeds) if self._defaults else feeds)

    def run_async(self, feeds: Mapping[str, np.ndarray]) -> Future:
        """Start one run and return at once; the future's result is the outputs by name. With several workers
        the requests pipeline through them in order (its `worker_seconds`: time rank 0 spent on it)."""
        if self._closed:
            raise ArtifactError(f"{self.directory}: the session is closed")
        if self._group is not None:
            checked = check_inputs(self._defaults, self.plan, feeds, self._input_specs)
            return self._group.submit(worker_feeds(self.plan, checked))
        done: Future = Future()
        done.set_result(self._run_here(with_defaults(self._defaults, feeds)))
        return done

    def run_many(self, feeds: Iterable[Mapping[str, np.ndarray]], window: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Outputs of each feeds in turn, keeping up to `window` requests in flight (default: two per worker)."""
        window = window or (self._group.window if self._group is not None else 1)
        in_flight: list[Future] = []
        for item in feeds:
            in_flight.append(self.run_async(item))
            if len(in_flight) >= window:
                yield in_flight.pop(0).result()
        while in_flight:
            yield in_flight.pop(0).result()

    def state(self) -> dict[str, np.ndarray]:
        """A training artifact's persistent state after the runs started so far (rank 0's on several workers)."""
        if self._closed:
            raise ArtifactError(f"{self.directory}: the session is closed")
        return self._group.state() if self._group is not None else self._executor.state()

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite state values by name (in every worker), after the runs started so far."""
        if self._closed:
            raise ArtifactError(f"{self.directory}: the session is closed")
        if self._group is not None:
            self._group.set_state({name: np.ascontiguousarray(a) for name, a in values.items()})
        else:
            self._executor.set_state(values)

    def residuals(self) -> dict[str, np.ndarray]:
        """Every worker's error-feedback residuals of compressed all-reduces, "RANK/TENSOR" -> residual, after the
        runs started so far (none on one worker: nothing is exchanged)."""
        return self._group.residuals() if self._group is not None else {}

    def set_residuals(self, per_worker: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Overwrite each worker's residuals (`per_worker[rank]`: tensor name -> residual), after the runs started
        so far."""
        if self._group is not None:
            self._group.set_residuals(per_worker)

    def _run_here(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        microbatches = self.microbatches
        if microbatches == 1:
            return self._executor.run(feeds)
        parts = [self._executor.run({name: np.ascontiguousarray(np.array_split(np.asarray(a), microbatches)[k])
                                     for name, a in feeds.items()}) for k in range(microbatches)]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    # ---- lifetime -------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers (empty when the artifact runs in this process)."""
        return self._group.pids if self._group is not None else []

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def close(self) -> None:
        """Stop the workers and release their pipes; safe to call twice, always returns."""
        if self._closed:
            return
        self._closed = True
        self._direct = None
        if self._group is not None:
            _close_group(self._group)

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _slot_shapes(plan: dict) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """What each worker takes of a run and rank 0's outputs, as unwritten arrays of their dtypes and shapes (they
    size the workers' shared-memory slots)."""
    def empty(types: Mapping[str, TensorType]) -> dict[str, np.ndarray]:
        return {name: np.empty(t.shape, numpy_dtype(t.dtype)) for name, t in types.items()}

    return worker_feeds(plan, empty(batch_input_types(plan))), empty(batch_output_types(plan))


def _info(name: str, t: TensorType) -> TensorInfo:
    return TensorInfo(name, list(t.shape), f"tensor({_ORT_TYPES.get(t.dtype, t.dtype)})")


# The worker groups of every open session, stopped at interpreter exit and on SIGTERM/SIGHUP.
_OPEN_GROUPS: set = set()
# Groups a stop signal killed, not yet closed (reaped, pipes released): closed by their session's close() or at exit.
# Out of _OPEN_GROUPS, so that once a caller caught SessionInterrupted the next stop signal acts as by default.
_INTERRUPTED_GROUPS: set = set()
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_signals_installed = False
_starting = 0  # sessions whose workers are starting


def _close_group(group) -> None:
    _OPEN_GROUPS.discard(group)
    _INTERRUPTED_GROUPS.discard(group)
    group.close()


def close_all() -> None:
    """Stop the workers of every open session, and close those a stop signal killed (what interpreter exit does)."""
    for group in list(_OPEN_GROUPS | _INTERRUPTED_GROUPS):
        _close_group(group)


atexit.register(close_all)


class SessionInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP came while sessions were open: their workers were stopped. A KeyboardInterrupt, so that
    it passes `except Exception` the way Ctrl-C does (the CLI prints it as one line and exits 128 + signum)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: stopped the session's workers")


def _stop_on_signals() -> None:
    """Once, from the main thread: SIGTERM and SIGHUP stop the workers of every open session and raise
    SessionInterrupted. A signal whose handler someone set (or that is ignored) is left alone: that handler
    decides, and interpreter exit still stops the workers."""
    global _signals_installed
    if _signals_installed or threading.current_thread() is not threading.main_thread():
        return
    _signals_installed = True
    for signum in _SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _stop_sessions)


def _stop_sessions(signum, frame) -> None:
    if not _OPEN_GROUPS and not _starting:  # no session open: the signal acts as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    # Only kill here: the reaping and the pipes wait for `close()` (the with-block's exit, or atexit), since the
    # code this handler interrupted may hold a lock that closing takes (WorkerGroup.interrupt says which).
    for group in list(_OPEN_GROUPS):
        group.interrupt()
        _OPEN_GROUPS.discard(group)
        _INTERRUPTED_GROUPS.add(group)
    raise SessionInterrupted(signum)
