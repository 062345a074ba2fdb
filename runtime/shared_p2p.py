"""Send/Recv through shared memory for the workers of a local group, instead of gloo's loopback TCP.

A gloo send of a pipeline stage's activation (1.5 MiB per ResNet-18 micro-batch) goes through a socket: the
sender's gloo thread copies it into the kernel, the receiver's copies it out, each thread waits for a core and a
wake-up, and the send completes only once the receiver posted its receive. Here the transfers of a local worker
group go through one anonymous shared segment instead:

- one ring per transfer of the plan (sender, receiver, tag), `count` slots each sized to the transferred tensor
  (the plan fixes every Send's shape, so the client sizes the segment before the workers start: `plan_channels`);
- a send copies the tensor into the next slot of its ring and publishes it (the slot's published counter: the
  message's number + 1) and rings the receiver's doorbell: it is complete at once, as long as the ring has a free
  slot; a receive waits until its message is published, copies it out, frees the slot (its consumed counter) and
  rings the sender's doorbell. One copy each way, on the worker's own thread, and no thread of gloo's.
- Messages are numbered per ring on both sides (the n-th send of a ring is the n-th receive of it, as gloo matches
  a pair's messages of one tag in order); a receive takes its number when it is posted, so waits may come in any
  order. Counters only grow: nothing is ever reset.
- A send whose slot is still taken (the receiver is `count` messages behind) is deferred: its tensor is copied in
  when the slot frees, by whichever wait of this rank's channels runs next (a receive, the send's own wait, or
  `flush` before the worker idles). Unlike gloo, whose transport threads complete a posted receive in the
  background, a receive here frees its slot only when the receiver's thread waits for it: two stages each
  waiting for the other to take a message would deadlock. So the session sizes the rings such that they never
  fill (runtime/worker_group.py: a sender is at most the request window's micro-batches ahead); deferring only
  keeps a program that sends more than that correct where its receiver takes the messages without this rank.

Waiting spins briefly with sched_yield, then sleeps on this rank's doorbell (an eventfd every peer writes after
raising a counter) and on its peers' exits (each rank writes its process id into the segment's first line; the
others watch it through a pidfd): a peer that exits fails the wait at once with PeerError, as gloo's closed
connection does, and one that does not answer within the timeout (stuck) fails it then.
The counters are plain aligned 8-byte stores read by polling, correct on x86's total store order, which
`available` checks (as runtime/shared_reduce.py); elsewhere, and for transfers the plan does not list (a state
request's, a profile's), gloo carries them.

The session's client creates the segment and the doorbells (`create_layout`) and passes their descriptors to the
workers it starts (pass_fds); a worker attaches with `SharedChannels.attach` (P2P_ENV describes them). The
segment is an anonymous memfd: nothing is left behind whatever ends the group.
"""
from __future__ import annotations

import json
import mmap
import os
import select
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tessel.ir.types import TensorType, numpy_dtype

from .errors import PeerError
from .instructions import Recv, Send, program_from_json, walk
from .shared_reduce import SPIN_S, close_layout, new_doorbells, shared_memory_chosen
from .shared_slots import anonymous_file

# The segment, its rings and the doorbells of the local worker group, for runtime/serve.py (JSON, `create_layout`).
P2P_ENV = "TESSEL_SHARED_P2P"
# "shm" (the default: shared memory for a local group where `available`) or "gloo" (always torch.distributed).
SENDRECV_ENV = "TESSEL_SENDRECV"
# Slots per ring: how many messages of one transfer a sender may be ahead of its receiver before it defers.
SLOTS = 4
# The most bytes the rings may take together; transfers beyond go through gloo.
SEGMENT_LIMIT = 1 << 30
_LINE = 64  # each counter on its own cache line; each slot starts on one

Wait = Callable[[], None]


def available() -> bool:
    """Whether local groups should send and receive through shared memory: Linux on x86 (total store order,
    eventfd) and not turned off with TESSEL_SENDRECV=gloo."""
    return shared_memory_chosen(SENDRECV_ENV)


def plan_channels(plan: dict) -> list[tuple[int, int, int, int]]:
    """(sender, receiver, tag, bytes) of every transfer of an artifact's plan (plan.json) that a ring can carry:
    a Send (its If branches' included) whose receiver has a Recv from it under the same tag and of the same size."""
    sends: dict[tuple[int, int, int], int] = {}
    receives: dict[tuple[int, int, int], int] = {}
    for rank, worker in enumerate(plan["workers"]):
        values = {**plan.get("values", {}), **worker.get("values", {})}

        def nbytes(name: str) -> int:
            t = TensorType.parse(values[name])
            return int(np.prod(t.shape, dtype=np.int64)) * np.dtype(numpy_dtype(t.dtype)).itemsize

        for instruction in walk(program_from_json(worker["instructions"])):
            if isinstance(instruction, Send):
                sends[(rank, instruction.peer, instruction.tag)] = nbytes(instruction.tensor)
            elif isinstance(instruction, Recv):
                receives[(instruction.peer, rank, instruction.tag)] = nbytes(instruction.output)
    return [(*key, size) for key, size in sorted(sends.items()) if receives.get(key) == size and size > 0]


def create_layout(world: int, channels: list[tuple[int, int, int, int]], count: int = SLOTS,
                  limit: int = SEGMENT_LIMIT) -> dict | None:
    """A new segment holding a ring of `count` slots for each of `channels` (`plan_channels`) that fits in `limit`
    bytes (in their order), and one doorbell per rank, described for the workers (P2P_ENV = its JSON; they inherit
    the descriptors); None when no ring fits. The client closes its descriptors once the workers started
    (`close_layout`)."""
    rings, offset = [], _pid_bytes(world)
    for sender, receiver, tag, size in channels:
        ring_bytes = _ring_bytes(size, count)
        if offset + ring_bytes > limit:
            continue
        rings.append([sender, receiver, tag, size, offset])
        offset += ring_bytes
    if not rings:
        return None
    fd = anonymous_file(offset, "tessel-shared-p2p")
    return {"world": world, "count": count, "bytes": offset, "rings": rings, "fd": fd, "doorbells": new_doorbells(world)}


def _pid_bytes(world: int) -> int:
    """The segment's first bytes: each rank's process id, written when it attaches (its peers watch it exit)."""
    return -(-8 * world // _LINE) * _LINE


def _slot_stride(size: int) -> int:
    return -(-size // _LINE) * _LINE


def _ring_bytes(size: int, count: int) -> int:
    return 2 * count * _LINE + count * _slot_stride(size)


@dataclass
class _Ring:
    """One transfer's ring as one rank sees it: the slots' counters and bytes, and this rank's next message number."""

    peer: int
    size: int
    published: np.ndarray  # slot k: 1 + the number of the last message written into it
    consumed: np.ndarray  # slot k: 1 + the number of the last message read out of it
    slots: list[np.ndarray]
    next: int = 0

    def slot_free(self, number: int) -> bool:
        """Whether message `number` may be written: its slot's message `count` before was read."""
        return int(self.consumed[number % len(self.slots)]) >= number - len(self.slots) + 1

    def arrived(self, number: int) -> bool:
        return int(self.published[number % len(self.slots)]) == number + 1


@dataclass
class _Deferred:
    """A send whose slot was still taken: its tensor, copied in when the slot frees."""

    ring: _Ring
    number: int
    array: np.ndarray
    done: bool = field(default=False)


class SharedChannels:
    """One rank's rings of the group's shared segment: the transfers this rank sends and receives."""

    def __init__(self, layout: dict, rank: int, timeout_s: float):
        """Map the segment that `layout` describes (descriptors "fd" and "doorbells", which this object closes)."""
        self.rank, self.timeout_s = rank, timeout_s
        self.fd, self.doorbells = int(layout["fd"]), [int(fd) for fd in layout["doorbells"]]
        count = int(layout["count"])
        self._map = mmap.mmap(self.fd, int(layout["bytes"]))
        self._pids = np.frombuffer(self._map, np.int64, int(layout["world"]), 0)
        self._pids[rank] = os.getpid()
        self._exits: dict[int, int] = {}  # peer rank -> a pidfd of its process, readable once it exited
        self._unwatched: set[int] = set()  # peers whose exit the sleep no longer wakes on
        self._out: dict[tuple[int, int], _Ring] = {}
        self._in: dict[tuple[int, int], _Ring] = {}
        for sender, receiver, tag, size, offset in layout["rings"]:
            if rank not in (sender, receiver):
                continue
            header = np.frombuffer(self._map, np.int64, 2 * count * _LINE // 8, offset)
            data = offset + 2 * count * _LINE
            slots = [np.frombuffer(self._map, np.uint8, size, data + k * _slot_stride(size)) for k in range(count)]
            ring = _Ring(receiver if sender == rank else sender, size, header[0:count * _LINE // 8:_LINE // 8],
                         header[count * _LINE // 8::_LINE // 8], slots)
            # A rank attached late (or again) starts where its side of the ring stands.
            counters = ring.published if sender == rank else ring.consumed
            ring.next = int(counters.max())
            (self._out if sender == rank else self._in)[(ring.peer, tag)] = ring
        self._deferred: list[_Deferred] = []
        self._poll = select.poll()
        self._poll.register(self.doorbells[rank], select.POLLIN)

    @classmethod
    def attach(cls, text: str, rank: int, timeout_s: float) -> "SharedChannels":
        """This rank's view of the segment that P2P_ENV's JSON `text` describes (inherited descriptors)."""
        return cls(json.loads(text), rank, timeout_s)

    def carries(self, array, peer: int, tag: int, sending: bool) -> bool:
        """Whether a transfer of `array` to (`sending`) or from `peer` under `tag` goes through a ring: one of
        this rank's, of exactly the array's size, and the array a contiguous host array."""
        ring = (self._out if sending else self._in).get((peer, tag))
        return (ring is not None and isinstance(array, np.ndarray) and array.nbytes == ring.size
                and array.flags.c_contiguous)

    def start_send(self, array: np.ndarray, peer: int, tag: int, name: str) -> Wait:
        """Send `array` (`carries` it) to `peer`: copied into its slot now, or once the slot frees (`array` must
        stay untouched until then); returns the wait for that."""
        ring = self._out[(peer, tag)]
        number, ring.next = ring.next, ring.next + 1
        if ring.slot_free(number):
            self._publish(ring, number, array)
            return _done
        deferred = _Deferred(ring, number, array)
        self._deferred.append(deferred)

        def wait() -> None:
            self._wait(lambda: deferred.done, f"sending tensor '{name}' to rank {peer} failed", peer)

        return wait

    def start_recv(self, array: np.ndarray, peer: int, tag: int, name: str) -> Wait:
        """Take the next message from `peer` under `tag` for `array` (`carries` it); returns the wait, which copies
        it into `array` once it arrived."""
        ring = self._in[(peer, tag)]
        number, ring.next = ring.next, ring.next + 1
        return _Receive(self, ring, number, array, f"gave up waiting for tensor '{name}' from rank {peer}")

    @property
    def doorbell(self) -> int:
        """This rank's doorbell (an eventfd): readable after a peer published or took a message (`arrived` may
        have changed); read it empty before sleeping on it again."""
        return self.doorbells[self.rank]

    def recv(self, array: np.ndarray, peer: int, tag: int, name: str) -> None:
        """Receive the next message from `peer` under `tag` into `array` (`carries` it)."""
        self.start_recv(array, peer, tag, name)()

    def flush(self) -> None:
        """Copy in every deferred send, waiting for its slot (before this rank idles: its receiver takes the
        messages before it without this rank)."""
        for deferred in list(self._deferred):
            self._wait(lambda: deferred.done, f"sending a tensor to rank {deferred.ring.peer} failed", deferred.ring.peer)

    def take(self, ring: _Ring, number: int, array: np.ndarray, failure: str) -> None:
        """Wait for message `number` of `ring` (PeerError `failure` when it does not come), copy it into `array`,
        free its slot and ring the sender's doorbell."""
        self._wait(lambda: ring.arrived(number), failure, ring.peer)
        slot = number % len(ring.slots)
        array.reshape(-1).view(np.uint8)[...] = ring.slots[slot]
        ring.consumed[slot] = number + 1
        os.eventfd_write(self.doorbells[ring.peer], 1)

    def _publish(self, ring: _Ring, number: int, array: np.ndarray) -> None:
        slot = number % len(ring.slots)
        ring.slots[slot][...] = array.reshape(-1).view(np.uint8)
        ring.published[slot] = number + 1
        os.eventfd_write(self.doorbells[ring.peer], 1)

    def _progress(self) -> None:
        """Copy in the deferred sends whose slots are free now (each message has its own slot number, so their
        order does not matter)."""
        for deferred in [d for d in self._deferred if d.ring.slot_free(d.number)]:
            self._publish(deferred.ring, deferred.number, deferred.array)
            deferred.done = True
            self._deferred.remove(deferred)

    def exit_fds(self) -> list[int]:
        """Descriptors that become readable when a peer's process exits (pidfds of the peers attached so far)."""
        for peer, pid in enumerate(self._pids):
            if peer != self.rank and pid and peer not in self._exits and hasattr(os, "pidfd_open"):
                try:
                    self._exits[peer] = os.pidfd_open(int(pid))
                except ProcessLookupError:  # gone already (reaped): a descriptor that reads as exited
                    self._exits[peer] = os.eventfd(1, os.EFD_CLOEXEC)
                except OSError:
                    # No pidfds here (a kernel before 5.3, a seccomp filter): the peer is not watched, and a
                    # wait for it ends at the timeout instead.
                    continue
                self._poll.register(self._exits[peer], select.POLLIN)
        return list(self._exits.values())

    def _exited(self, peer: int) -> bool:
        fd = self._exits.get(peer)
        return fd is not None and bool(select.select([fd], [], [], 0)[0])

    def _wait(self, ready: Callable[[], bool], failure: str, peer: int) -> None:
        """Until `ready()`, moving deferred sends on: spin SPIN_S, then sleep on the doorbell; PeerError (`failure`
        and why) once `peer`'s process exited (a sleep wakes on it), or after the timeout. A doorbell rung after the
        last look wakes the sleep."""
        started = time.perf_counter()
        self._progress()
        while not ready():
            waited = time.perf_counter() - started
            if waited < SPIN_S:
                os.sched_yield()
            elif waited > self.timeout_s:
                raise PeerError(f"rank {self.rank}: {failure} (no message through shared memory within "
                                f"{self.timeout_s:g} s)")
            else:
                self.exit_fds()
                if self._exited(peer):
                    raise PeerError(f"rank {self.rank}: {failure} (rank {peer} exited)")
                for other in [r for r in self._exits if r != peer and r not in self._unwatched and self._exited(r)]:
                    self._poll.unregister(self._exits[other])  # another peer's exit: no longer a reason to wake
                    self._unwatched.add(other)
                if self._poll.poll(min(1000, max(1, int(1e3 * (self.timeout_s - waited))))):
                    try:
                        os.eventfd_read(self.doorbells[self.rank])
                    except BlockingIOError:
                        pass
            self._progress()

    def close(self) -> None:
        """Unmap the segment and close the descriptors (sends not yet copied in are dropped)."""
        self._out, self._in, self._deferred, self._pids = {}, {}, [], None
        try:
            self._map.close()
        except BufferError:  # an array over the segment is still alive: the mapping goes with it
            pass
        for fd in self._exits.values():
            os.close(fd)
        self._exits = {}
        close_layout({"fd": self.fd, "doorbells": self.doorbells})


class _Receive:
    """The wait of a receive posted through a ring (`SharedChannels.start_recv`): called, it waits for its message
    and copies it out; `arrived` tells without waiting whether it is there."""

    def __init__(self, channels: SharedChannels, ring: _Ring, number: int, array: np.ndarray, failure: str):
        self._channels, self._ring, self._number, self._array, self._failure = channels, ring, number, array, failure

    def arrived(self) -> bool:
        """Whether the message is in its slot (calling the wait then returns at once)."""
        return self._ring.arrived(self._number)

    def __call__(self) -> None:
        self._channels.take(self._ring, self._number, self._array, self._failure)


def _done() -> None:
    """The wait of a send already copied into its slot."""
