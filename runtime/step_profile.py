"""An opt-in profile of the steps a worker runs: when each piece of its program started and ended.

A worker started with TESSEL_STEP_PROFILE=1 (runtime/serve.py) times every step of its executor's run loop
(one native-host segment, or one instruction the Python host runs: a transfer, the start of an all-reduce) and
every wait on a collective or a receive. A span is one int64 row (kind, first, last, start_ns, end_ns): `first`
and `last` index the worker's run instructions (those not run at load, plan.json order) the span covers; the
clock is time.perf_counter_ns (CLOCK_MONOTONIC: one clock for every process of a machine). Rank 0 collects
the other ranks' spans after each request and answers them with its outputs (`header["profile"]`: rank ->
rows), so the client sees where each worker's time went in that step (compiler/step_profile_chart.py).

Timing costs two clock reads per span (under a microsecond), and nothing when the profile is off.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import numpy as np

PROFILE_ENV = "TESSEL_STEP_PROFILE"
RUN, WAIT = 0, 1  # span kinds: a step of the run loop; a wait on a collective or a receive
KINDS = ("run", "wait")
# Tag of the span count and of the spans a rank sends rank 0 (beside the programs' own tags and serve's state tag).
PROFILE_TAG = (1 << 24) + (1 << 23)
_COLUMNS = 5


def enabled() -> bool:
    """Whether this process was asked to profile its steps."""
    return os.environ.get(PROFILE_ENV, "") not in ("", "0")


class StepRecorder:
    """Collects the spans of the steps and waits of one worker until `take`."""

    def __init__(self):
        self._rows: list[tuple[int, int, int, int, int]] = []

    def timed_steps(self, steps: Sequence[Callable[[], None]], covered: Sequence[Sequence],
                    instructions: Sequence) -> list:
        """`steps` (each running the instructions `covered` lists, out of the run `instructions`) each recording
        its span."""
        index = {id(instruction): k for k, instruction in enumerate(instructions)}
        return [self._timed(step, index[id(group[0])], index[id(group[-1])]) for step, group in zip(steps, covered)]

    def _timed(self, step: Callable[[], None], first: int, last: int) -> Callable[[], None]:
        rows, clock = self._rows, time.perf_counter_ns

        def timed_step() -> None:
            started = clock()
            step()
            rows.append((RUN, first, last, started, clock()))

        return timed_step

    def timed_wait(self, wait: Callable[[], None], instruction: int) -> Callable[[], None]:
        """`wait` recording its span, for the collective or receive of run instruction `instruction`."""
        rows, clock = self._rows, time.perf_counter_ns

        def timed() -> None:
            started = clock()
            wait()
            rows.append((WAIT, instruction, instruction, started, clock()))

        return timed

    def take(self) -> np.ndarray:
        """The spans recorded since the last take, (n, 5) int64 rows; the recorder starts empty again."""
        spans = np.array(self._rows, dtype=np.int64).reshape(-1, _COLUMNS)
        self._rows.clear()  # in place: the timed steps hold this list
        return spans


class TimedComm:
    """A worker's comm (runtime/comm.py) whose waits are recorded: a blocking receive, an all-reduce's wait and the
    waits for sends; everything else passes through. A wait is filed under the run instruction that collects or
    receives its tensor (`names`, set once the executor exists: `collective_names`)."""

    def __init__(self, comm, recorder: StepRecorder):
        self._comm, self._recorder = comm, recorder
        self._names: dict[str, int] = {}
        self.rank = comm.rank

    def file_waits_under(self, names: dict[str, int]) -> None:
        """Each tensor name's run-instruction index that collects or receives it."""
        self._names = names

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def recv(self, array: np.ndarray, peer: int, tag: int, name: str) -> None:
        """The comm's receive, timed as a wait."""
        self._recorder.timed_wait(lambda: self._comm.recv(array, peer, tag, name), self._names.get(name, -1))()

    def start_recv(self, array: np.ndarray, peer: int, tag: int, name: str):
        """The comm's started receive; its wait timed."""
        return self._recorder.timed_wait(self._comm.start_recv(array, peer, tag, name), self._names.get(name, -1))

    def all_reduce(self, array: np.ndarray, reduction: str, name: str) -> None:
        """The comm's blocking all-reduce, timed as a wait."""
        self._recorder.timed_wait(lambda: self._comm.all_reduce(array, reduction, name), self._names.get(name, -1))()

    def start_all_reduce(self, array: np.ndarray, reduction: str, name: str):
        """The comm's started all-reduce; its wait timed."""
        return self._recorder.timed_wait(self._comm.start_all_reduce(array, reduction, name), self._names.get(name, -1))

    def wait_sends(self) -> None:
        """The comm's wait for this run's sends, timed (filed under instruction -1: the end of the run)."""
        self._recorder.timed_wait(self._comm.wait_sends, -1)()


def collective_names(instructions: Sequence) -> dict[str, int]:
    """Tensor name -> index of the run instruction that all-reduces or receives it (what a wait is filed under)."""
    from .instructions import AllReduce, Recv

    names: dict[str, int] = {}
    for index, instruction in enumerate(instructions):
        if isinstance(instruction, AllReduce):
            names[instruction.tensor] = index
        elif isinstance(instruction, Recv):
            names[instruction.output] = index
    return names


def profiled(comm, make_executor: Callable):
    """(executor, recorder): `make_executor(comm)`'s executor, with its steps and waits timed when this process was
    asked to profile (`enabled`), else with `comm` as it is and no recorder."""
    if not enabled():
        return make_executor(comm), None
    recorder = StepRecorder()
    timed = TimedComm(comm, recorder)
    executor = make_executor(timed)
    timed.file_waits_under(collective_names(executor.run_instructions))
    executor.record_steps(recorder)
    return executor, recorder


def collect(comm, recorder: StepRecorder, world: int) -> dict[str, list] | None:
    """After a request: rank 0 gets every rank's spans, {str(rank): rows as lists}; the other ranks send theirs to
    rank 0 (over `comm`, the plain one) and get None."""
    rows = recorder.take()
    if comm.rank != 0:
        comm.send(np.array([len(rows)], dtype=np.int64), 0, PROFILE_TAG, "profile length")
        if len(rows):
            comm.send(rows, 0, PROFILE_TAG + 1, "profile")
        comm.wait_sends()
        return None
    spans = {"0": rows.tolist()}
    for rank in range(1, world):
        count = np.zeros(1, dtype=np.int64)
        comm.recv(count, rank, PROFILE_TAG, "profile length")
        theirs = np.zeros((int(count[0]), _COLUMNS), dtype=np.int64)
        if len(theirs):
            comm.recv(theirs, rank, PROFILE_TAG + 1, "profile")
        spans[str(rank)] = theirs.tolist()
    return spans
