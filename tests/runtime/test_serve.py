"""The session worker's loop: a pipeline's first stage, waiting for its oldest request's outputs, starts a request
that arrives meanwhile (`_outputs_or_request`), and a run's pending outputs tell whether they are in."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from tessel.runtime.executor import PendingOutputs
from tessel.runtime.serve import _outputs_or_request

pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd"), reason="Linux only")


class _Arriving:
    """A receive through shared memory as PendingOutputs sees it: a wait that can tell whether it is in."""

    def __init__(self):
        self.flag = False

    def arrived(self) -> bool:
        return self.flag

    def __call__(self) -> None:
        assert self.flag


@pytest.fixture
def pipe_and_doorbell():
    read, write = os.pipe()
    doorbell = os.eventfd(0, os.EFD_NONBLOCK)
    yield read, write, doorbell
    for fd in (read, write, doorbell):
        os.close(fd)


def _later(seconds: float, action) -> threading.Thread:
    thread = threading.Timer(seconds, action)
    thread.start()
    return thread


def test_outputs_arriving_end_the_wait(pipe_and_doorbell):
    control, _, doorbell = pipe_and_doorbell
    receive = _Arriving()
    outputs = PendingOutputs(["y"], {}, {"y": (np.zeros(1), receive)})
    assert outputs.observable and not outputs.arrived()

    def arrive() -> None:
        receive.flag = True
        os.eventfd_write(doorbell, 1)

    _later(0.1, arrive)
    started = time.perf_counter()
    assert _outputs_or_request([outputs], control, doorbell, [], timeout_s=10)
    assert time.perf_counter() - started < 5 and outputs.arrived()


def test_a_request_arriving_first_ends_the_wait_without_the_outputs(pipe_and_doorbell):
    control, write, doorbell = pipe_and_doorbell
    outputs = PendingOutputs(["y"], {}, {"y": (np.zeros(1), _Arriving())})
    _later(0.1, lambda: os.write(write, b"x"))
    assert not _outputs_or_request([outputs], control, doorbell, [], timeout_s=10)
    assert not outputs.arrived()


def test_the_wait_gives_up_after_the_timeout(pipe_and_doorbell):
    control, _, doorbell = pipe_and_doorbell
    outputs = PendingOutputs(["y"], {}, {"y": (np.zeros(1), _Arriving())})
    started = time.perf_counter()
    assert _outputs_or_request([outputs], control, doorbell, [], timeout_s=0.2)
    assert 0.2 <= time.perf_counter() - started < 2


def test_outputs_received_otherwise_cannot_tell_and_local_ones_are_in():
    assert not PendingOutputs(["y"], {}, {"y": (np.zeros(1), lambda: None)}).observable  # a gloo receive's wait
    local = PendingOutputs(["y"], {"y": np.ones(2)}, {})
    assert local.observable and local.arrived()
    np.testing.assert_array_equal(local()["y"], np.ones(2))
