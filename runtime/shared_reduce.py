"""All-reduce through shared memory for workers on one machine, run on the caller's thread.

gloo's all-reduce hands the work to its own threads; right after a worker computed, on a loaded machine, those
threads wait for a time slice (bench/allreduce_wakeup.py: 0.4 ms back to back, 4.5 ms after 4 ms of compute).
Here the worker that asks does the reduction itself:

1. each rank copies its piece of the tensor into its own slice of the segment and raises its arrival counter;
2. once every rank arrived, rank r sums chunk r of the piece over all ranks' slices, in rank order, into the
   result area and raises its done counter (a reduce-scatter);
3. once every rank is done, each copies the whole result back (an all-gather by copy).

Every chunk is summed once, by one rank, in the same order, so every rank ends with the same bytes. Tensors larger
than a slice go piece by piece. Counters hold the collective's generation (one per piece, the same on every rank,
since every rank issues the same all-reduces in the same order, as gloo requires too), so nothing is ever reset.

Waiting spins a little with sched_yield (the peer is usually microseconds away), then sleeps on this rank's
doorbell (an eventfd every rank writes after raising a counter), so a worker does not burn a core on a loaded
machine; a peer that does not arrive within the timeout (dead, stuck) fails with PeerError.

`start_all_reduce` runs the reduction on the rank's reducer thread instead, as PyTorch DDP's reducer does with a
gradient bucket: the worker's kernels go on (the native host calls them without the GIL) while the thread copies,
sums and waits for the peers, and the worker waits only where it reads the result. The thread takes the
reductions in issue order, the order every rank follows, and sleeps on the doorbell at once instead of spinning:
its core is the kernels'. A blocking `all_reduce` issued while reductions are queued goes through the thread too,
behind them.

The counters are plain aligned 8-byte stores read by polling: correct on x86's total store order (data written
before a counter is seen before it), which `available` checks; elsewhere the runtime keeps gloo.

The session's client creates the segment and the doorbells (`create_layout`) and passes their descriptors
to the workers it starts (pass_fds), as runtime/shared_slots.py does; a worker attaches with `attach`
(REDUCE_ENV describes them). The segment is an anonymous memfd: nothing is left behind whatever ends the group.
"""
from __future__ import annotations

import json
import mmap
import os
import platform
import select
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from .errors import PeerError, SettingError
from .shared_slots import anonymous_file

# The segment and doorbells of the local worker group, for runtime/serve.py (JSON, `create_layout`).
REDUCE_ENV = "TESSEL_SHARED_REDUCE"
# "shm" (the default: shared memory for a local group where `available`) or "gloo" (always torch.distributed).
ALLREDUCE_ENV = "TESSEL_ALLREDUCE"
# Bytes of each rank's slice: larger tensors go through it piece by piece.
SLICE_BYTES = 4 << 20
# How long a waiting rank polls (yielding the core each time) before it sleeps on its doorbell.
SPIN_S = 200e-6
_LINE = 64  # each counter on its own cache line
_REDUCTIONS = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}


def available() -> bool:
    """Whether local groups should all-reduce through shared memory: Linux on x86 (total store order, eventfd)
    and not turned off with TESSEL_ALLREDUCE=gloo."""
    return shared_memory_chosen(ALLREDUCE_ENV)


def shared_memory_chosen(setting: str) -> bool:
    """Whether the environment variable `setting` ("shm", the default, or "gloo") and this machine let a local
    group's transport go through shared memory: Linux on x86 (total store order, eventfd); SettingError for any
    other value."""
    choice = os.environ.get(setting, "shm")
    if choice not in ("shm", "gloo"):
        raise SettingError(f"{setting}={choice!r}: expected shm or gloo (unset it for the default, shm)")
    return choice == "shm" and hasattr(os, "eventfd") and platform.machine() in ("x86_64", "AMD64", "i686")


class SharedReduce:
    """One rank's view of the group's all-reduce segment; `all_reduce` must be called by every rank in turn."""

    def __init__(self, layout: dict, rank: int, timeout_s: float):
        """Map the segment that `layout` describes (descriptors "fd" and "doorbells", which this object closes)."""
        self.world = int(layout["world"])
        self.slice_bytes = int(layout["slice_bytes"])
        self.fd, self.doorbells = int(layout["fd"]), [int(fd) for fd in layout["doorbells"]]
        self.rank, self.timeout_s = rank, timeout_s
        self._map = mmap.mmap(self.fd, _segment_bytes(self.world, self.slice_bytes))
        header = np.frombuffer(self._map, np.int64, 2 * self.world * _LINE // 8)
        self._arrived = header[0:self.world * _LINE // 8:_LINE // 8]
        self._done = header[self.world * _LINE // 8::_LINE // 8]
        data = 2 * self.world * _LINE
        self._slices = [np.frombuffer(self._map, np.uint8, self.slice_bytes, data + k * self.slice_bytes)
                        for k in range(self.world)]
        self._result = np.frombuffer(self._map, np.uint8, self.slice_bytes, data + self.world * self.slice_bytes)
        self._generation = int(self._arrived[rank])
        self._poll = select.poll()
        self._poll.register(self.doorbells[rank], select.POLLIN)
        self._reducer: ThreadPoolExecutor | None = None
        self._queued: Future | None = None  # the last reduction handed to the reducer thread
        self._failed: PeerError | None = None  # once a peer failed to come, every later reduction fails at once

    @classmethod
    def attach(cls, text: str, rank: int, timeout_s: float) -> "SharedReduce":
        """This rank's view of the segment that REDUCE_ENV's JSON `text` describes (inherited descriptors)."""
        return cls(json.loads(text), rank, timeout_s)

    def all_reduce(self, array: np.ndarray, reduction: str, name: str) -> None:
        """Replace `array` (contiguous) on every rank by the element-wise `reduction` (sum, mean, max, min) over
        all ranks, with the same bytes on every rank."""
        if self._queued is not None and not self._queued.done():
            self.start_all_reduce(array, reduction, name)()
        else:
            self._reduce(array, reduction, name, SPIN_S)

    def start_all_reduce(self, array: np.ndarray, reduction: str, name: str) -> Callable[[], None]:
        """Start `all_reduce` of `array` on the reducer thread (after those started before); returns the wait,
        which raises what the reduction raised. `array` must stay untouched until then."""
        if self._reducer is None:
            self._reducer = ThreadPoolExecutor(1, thread_name_prefix=f"tessel-reduce-{self.rank}")
        queued = self._queued = self._reducer.submit(self._reduce, array, reduction, name, 0.0)
        return queued.result

    def _reduce(self, array: np.ndarray, reduction: str, name: str, spin_s: float) -> None:
        if self._failed is not None:
            raise self._failed
        ufunc = _REDUCTIONS[reduction]
        flat = array.reshape(-1)
        per_piece = max(1, self.slice_bytes // flat.itemsize)
        try:
            for start in range(0, flat.size, per_piece):
                self._reduce_piece(flat[start:start + per_piece], ufunc, reduction == "mean", name, spin_s)
        except PeerError as exc:
            self._failed = exc
            raise

    def _reduce_piece(self, piece: np.ndarray, ufunc, mean: bool, name: str, spin_s: float) -> None:
        self._generation += 1
        generation, dtype, count = self._generation, piece.dtype, piece.size
        self._slices[self.rank][:piece.nbytes].view(dtype)[...] = piece
        self._raise(self._arrived, generation)
        self._wait(self._arrived, generation, name, spin_s)
        low, high = self.rank * count // self.world, (self.rank + 1) * count // self.world
        if high > low:
            parts = [s[:piece.nbytes].view(dtype)[low:high] for s in self._slices]
            total = self._result[:piece.nbytes].view(dtype)[low:high]
            ufunc(parts[0], parts[1], out=total)
            for part in parts[2:]:
                ufunc(total, part, out=total)
            if mean:
                np.divide(total, self.world, out=total, casting="unsafe")
        self._raise(self._done, generation)
        self._wait(self._done, generation, name, spin_s)
        piece[...] = self._result[:piece.nbytes].view(dtype)

    def _raise(self, counters: np.ndarray, generation: int) -> None:
        """Publish this rank's step `generation` and ring every other rank's doorbell."""
        counters[self.rank] = generation
        for peer, doorbell in enumerate(self.doorbells):
            if peer != self.rank:
                os.eventfd_write(doorbell, 1)

    def _wait(self, counters: np.ndarray, generation: int, name: str, spin_s: float) -> None:
        """Until every rank's counter reached `generation`: spin `spin_s`, then sleep on the doorbell; PeerError
        after the timeout. A doorbell rung after the last look wakes the sleep, so no raise is missed."""
        started = time.perf_counter()
        while counters.min() < generation:
            waited = time.perf_counter() - started
            if waited < spin_s:
                os.sched_yield()
                continue
            if waited > self.timeout_s:
                late = [r for r in range(self.world) if counters[r] < generation]
                raise PeerError(f"rank {self.rank}: all-reduce of tensor '{name}' failed (no answer from rank(s) "
                                f"{', '.join(map(str, late))} within {self.timeout_s:g} s)")
            if self._poll.poll(min(1000, max(1, int(1e3 * (self.timeout_s - waited))))):
                try:
                    os.eventfd_read(self.doorbells[self.rank])
                except BlockingIOError:
                    pass

    def close(self) -> None:
        """Let the reduction under way finish (the ones queued behind it are dropped; errors are the waits'),
        then unmap the segment and close the descriptors."""
        if self._reducer is not None:
            self._reducer.shutdown(wait=True, cancel_futures=True)
        self._slices, self._result, self._arrived, self._done = [], None, None, None
        try:
            self._map.close()
        except BufferError:  # an array over the segment is still alive: the mapping goes with it
            pass
        close_layout({"fd": self.fd, "doorbells": self.doorbells})


def create_layout(world: int, slice_bytes: int = SLICE_BYTES) -> dict:
    """A new segment and one doorbell per rank, described for the workers (REDUCE_ENV = its JSON; they inherit
    the descriptors). The client closes its descriptors once the workers started (`close_layout`)."""
    fd = anonymous_file(_segment_bytes(world, slice_bytes), "tessel-shared-reduce")
    return {"world": world, "slice_bytes": slice_bytes, "fd": fd, "doorbells": new_doorbells(world)}


def new_doorbells(world: int) -> list[int]:
    """One doorbell per rank: a non-blocking eventfd that peers write after raising a counter."""
    return [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(world)]


def descriptors(layout: dict) -> tuple[int, ...]:
    """The descriptors of a layout ("fd" and "doorbells": this module's `create_layout`, or runtime/shared_p2p.py's),
    for pass_fds."""
    return (layout["fd"], *layout["doorbells"])


def close_layout(layout: dict) -> None:
    """Close the descriptors that a layout holds ("fd" and "doorbells": this module's, or runtime/shared_p2p.py's;
    the client's, once its workers inherited them)."""
    for fd in descriptors(layout):
        os.close(fd)


def _segment_bytes(world: int, slice_bytes: int) -> int:
    return 2 * world * _LINE + (world + 1) * slice_bytes
