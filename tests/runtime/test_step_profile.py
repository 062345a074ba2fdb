"""The step profile (runtime/step_profile.py): timed steps and waits, taken per request, collected on rank 0."""
from __future__ import annotations

import numpy as np

from tessel.runtime.instructions import AllReduce, KernelCall, Recv
from tessel.runtime.step_profile import RUN, WAIT, StepRecorder, TimedComm, collect, collective_names


class _Comm:
    """Rank `rank` of a two-rank group whose messages go through `box` (tag -> array)."""

    def __init__(self, rank: int, box: dict):
        self.rank, self.box = rank, box

    def send(self, array, peer, tag, name):
        self.box[tag] = np.array(array)

    def wait_sends(self):
        pass

    def recv(self, array, peer, tag, name):
        array[...] = self.box.pop(tag)

    def start_all_reduce(self, array, reduction, name):
        return lambda: None


def _program():
    return [KernelCall("a", "Op", kernel="k", inputs=("x",), outputs=("h",)),
            AllReduce("ar", "AllReduce", tensor="h", reduction="mean", output="hm"),
            Recv("rv", "Recv", output="r", peer=1, tag=3),
            KernelCall("b", "Op", kernel="k", inputs=("hm", "r"), outputs=("y",))]


def test_each_step_and_wait_is_one_span_filed_under_its_instructions():
    program = _program()
    recorder = StepRecorder()
    steps = recorder.timed_steps([lambda: None] * 2, [program[:2], program[2:]], program)
    comm = TimedComm(_Comm(0, {3: np.ones(2, np.float32)}), recorder)
    comm.file_waits_under(collective_names(program))
    for step in steps:
        step()
    comm.start_all_reduce(np.zeros(2, np.float32), "mean", "h")()
    comm.recv(np.zeros(2, np.float32), 1, 3, "r")
    spans = recorder.take()
    assert spans[:, :3].tolist() == [[RUN, 0, 1], [RUN, 2, 3], [WAIT, 1, 1], [WAIT, 2, 2]]
    assert (spans[:, 4] >= spans[:, 3]).all() and (spans[1:, 3] >= spans[:-1, 3]).all()
    # Taken spans are gone; the steps keep recording into the same recorder.
    steps[0]()
    assert recorder.take()[:, :3].tolist() == [[RUN, 0, 1]]


def test_rank_0_answers_every_ranks_spans():
    box: dict = {}
    theirs, mine = StepRecorder(), StepRecorder()
    program = _program()
    theirs.timed_steps([lambda: None], [program[:1]], program)[0]()
    assert collect(_Comm(1, box), theirs, 2) is None
    mine_steps = mine.timed_steps([lambda: None], [program[3:]], program)
    mine_steps[0]()
    spans = collect(_Comm(0, box), mine, 2)
    assert sorted(spans) == ["0", "1"]
    assert [row[:3] for row in spans["0"]] == [[RUN, 3, 3]] and [row[:3] for row in spans["1"]] == [[RUN, 0, 0]]
    assert not box
