"""Receives posted one run early (runtime/early_receives.py): each run still reads its own tensor, in order."""
from __future__ import annotations

import numpy as np

from tessel.runtime.early_receives import EarlyReceive


class _Comm:
    """Delivers run k's tensor (all k) in order; records what was asked, and when each posted receive completes."""

    def __init__(self):
        self.sent = 0
        self.calls: list[str] = []

    def recv(self, array, peer, tag, name):
        self.calls.append("recv")
        array[...] = self.sent
        self.sent += 1

    def start_recv(self, array, peer, tag, name):
        self.calls.append("post")
        value = self.sent
        self.sent += 1

        def wait():
            self.calls.append("wait")
            array[...] = value

        return wait


def test_each_run_reads_its_own_tensor_and_posts_the_next_receive_once_enabled():
    comm, buffer = _Comm(), np.full(4, -1.0, np.float32)
    receive = EarlyReceive(comm, buffer, 0, 7, "x")
    receive()
    assert comm.calls == ["recv"] and (buffer == 0).all()
    receive.enable()
    receive()  # still a plain receive: nothing was posted in the run before; then the next run's is posted
    assert comm.calls == ["recv", "recv", "post"] and (buffer == 1).all()
    buffer[...] = -1  # the program overwrites its buffer: the posted receive lands elsewhere
    receive()
    assert comm.calls[3:] == ["wait", "post"] and (buffer == 2).all()
    receive()
    assert (buffer == 3).all()
