"""How a parameter-server rank's messages travel (runtime/ps_job.py has the messages): torch.distributed
point-to-point between processes, in-process queues between a worker and a server sharing its process (the
colocated layout, MXNet's dist_sync local: server s runs as a thread of worker s's process, since a gloo rank
cannot send to itself).

Messages to servers go with SERVER tags, replies to workers with WORKER tags, so that a process's server
thread and its worker never take each other's messages. A server reads its messages from an inbox:
`RemoteInbox` receives them itself (a standalone server), `LocalInbox` is a queue its own worker writes into
and a receiving thread fills from the other ranks (a colocated server).
"""
from __future__ import annotations

import queue
import threading

import numpy as np

from .ps_job import DONE, HEADER_BYTES, PUSH, PSJob, header, throttle

SERVER_HEADER_TAG, SERVER_PAYLOAD_TAG = 1, 2
WORKER_HEADER_TAG, WORKER_PAYLOAD_TAG = 3, 4

# A message as a server reads it: (worker, kind, clock, payload bytes or None).
Message = tuple[int, int, int, "np.ndarray | None"]


def _send(job: PSJob, kind: int, clock: int, payload: np.ndarray | None, dst: int, tags: tuple[int, int]) -> None:
    """A header and, if any, its payload to rank `dst` over torch.distributed, through the job's emulated link."""
    import torch
    import torch.distributed as dist

    throttle(job, HEADER_BYTES + (0 if payload is None else payload.size))
    dist.send(header(kind, clock, 0 if payload is None else payload.size), dst=dst, tag=tags[0])
    if payload is not None:
        dist.send(torch.from_numpy(np.ascontiguousarray(payload)), dst=dst, tag=tags[1])


def _receive(src: int | None, tags: tuple[int, int], with_payload) -> Message:
    """A header from `src` (None: any rank) and the payload it announces, when `with_payload(kind)`."""
    import torch
    import torch.distributed as dist

    message = torch.zeros(4, dtype=torch.int64)
    sender = dist.recv(message, src=src, tag=tags[0])
    kind, clock, nbytes = (int(v) for v in message[:3])
    payload = None
    if with_payload(kind):
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(buffer, src=sender, tag=tags[1])
        payload = buffer.numpy()
    return sender, kind, clock, payload


class RemoteInbox:
    """A standalone server's messages, received from the workers as it asks for them."""

    def get(self) -> Message:
        """The next message from any worker."""
        return _receive(None, (SERVER_HEADER_TAG, SERVER_PAYLOAD_TAG), lambda kind: kind == PUSH)


class LocalInbox:
    """A colocated server's messages: its own worker's, put directly, and the other workers', put by a
    receiving thread (`start_receiving`) until each of them has said DONE."""

    def __init__(self):
        self.messages: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()  # the server's answers to the worker of its own process

    def get(self) -> Message:
        """The next message."""
        return self.messages.get()

    def start_receiving(self, remote_workers: int) -> threading.Thread:
        """A daemon thread moving the other workers' messages into the inbox until `remote_workers` said DONE."""
        def receive() -> None:
            done = 0
            while done < remote_workers:
                message = RemoteInbox().get()
                done += message[1] == DONE
                self.messages.put(message)

        thread = threading.Thread(target=receive, name="tessel-ps receiver", daemon=True)
        thread.start()
        return thread


class Wire:
    """One process's sends and receives: to remote ranks over torch.distributed, to the server in its own process
    through that server's LocalInbox."""

    def __init__(self, job: PSJob, rank: int, local: dict[int, LocalInbox] | None = None):
        self.job, self.rank = job, rank
        self.local = local or {}  # shard -> inbox of the server of that shard in this process

    def to_server(self, shard: int, kind: int, clock: int = 0, payload: np.ndarray | None = None) -> None:
        """A message from this process's worker to the server of `shard`."""
        if shard in self.local:
            self.local[shard].messages.put((self.rank, kind, clock, None if payload is None else payload.copy()))
        else:
            _send(self.job, kind, clock, payload, self.job.server_rank(shard),
                  (SERVER_HEADER_TAG, SERVER_PAYLOAD_TAG))

    def is_local(self, shard: int) -> bool:
        """Whether the server of `shard` runs in this process (its messages cross no link)."""
        return shard in self.local

    def from_server(self, shard: int) -> tuple[int, np.ndarray]:
        """(clock, payload) of the next reply of the server of `shard` to this process's worker."""
        if shard in self.local:
            return self.local[shard].replies.get()
        _, _, clock, payload = _receive(self.job.server_rank(shard), (WORKER_HEADER_TAG, WORKER_PAYLOAD_TAG),
                                        lambda kind: True)
        return clock, payload

    def to_worker(self, shard: int, worker: int, kind: int, clock: int, payload: np.ndarray) -> None:
        """The server of `shard`'s reply to `worker`."""
        if worker == self.rank and shard in self.local:
            self.local[shard].replies.put((clock, payload.copy()))
        else:
            _send(self.job, kind, clock, payload, worker, (WORKER_HEADER_TAG, WORKER_PAYLOAD_TAG))
