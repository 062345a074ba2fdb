"""Receives posted one run early, so that a pipeline stage finds its next micro-batch already arrived.

gloo moves a tensor only once the receiver has posted its receive: the sender's
send waits for it, and the transfer itself (the sender's and the receiver's
transport threads, the receiver's wake-up) then lies on the receiver's critical
path. A stage that posts its receive only when it needs the tensor therefore
waits for every transfer even when the previous stage sent it long before, and
holds the previous stage back (its held send, runtime/held_sends.py, completes
only then).

An `EarlyReceive` is a top-level Recv that, once enabled, posts the receive of
the next run into a staging array of its own as soon as this run's tensor is
in. The tensor then travels while the stage computes; the next run waits for it
(usually done) and copies it into the arena buffer where the program expects it
(one copy of the tensor, a fraction of a millisecond for a megabyte).

Only a worker that runs the same program again and again, and whose process
ends without tearing the group down, enables it (runtime/serve.py: the workers
of an inference session): after the last run one receive stays posted.
"""
from __future__ import annotations

from typing import Callable

import numpy as np


class EarlyReceive:
    """The Recv step of one tensor: a plain blocking receive until `enable`, then the wait for the receive posted
    in the run before (and the post of the next)."""

    def __init__(self, comm, buffer: np.ndarray, peer: int, tag: int, name: str):
        self._comm, self._buffer, self._peer, self._tag, self._name = comm, buffer, peer, tag, name
        self._staged: np.ndarray | None = None
        self._posted: Callable[[], None] | None = None

    def enable(self) -> None:
        """From the next run on, post each next run's receive as soon as this run's tensor is in."""
        if self._staged is None:
            self._staged = np.empty_like(self._buffer)

    def __call__(self) -> None:
        """This run's receive: the tensor is in the arena buffer when it returns."""
        if self._posted is None:
            self._comm.recv(self._buffer, self._peer, self._tag, self._name)
        else:
            wait, self._posted = self._posted, None
            wait()
            np.copyto(self._buffer, self._staged)
        if self._staged is not None:
            self._posted = self._comm.start_recv(self._staged, self._peer, self._tag, self._name)
