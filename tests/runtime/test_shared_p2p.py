"""Send/Recv through shared memory between local workers: two forked ranks exchanging tensors of several dtypes
(more messages than a ring has slots, receives waited out of order), a peer that dies, the plan's transfers, no
descriptor or mapping left behind, and a pipeline session giving the same bytes as over gloo."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tessel.runtime.errors import PeerError
from tessel.runtime.instructions import Recv, Send, program_to_json
from tessel.runtime.shared_p2p import SENDRECV_ENV, SharedChannels, available, create_layout, plan_channels
from tessel.runtime.shared_reduce import close_layout

pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd") or not hasattr(os, "fork"), reason="Linux only")

# (sender, receiver, tag, bytes): two transfers from rank 0 to rank 1, one back.
CHANNELS = [(0, 1, 0, 4000), (0, 1, 7, 24), (1, 0, 3, 64)]


def _messages(k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k-th message of each forward transfer: 1000 float32 (tag 0) and 3 int64 (tag 7)."""
    rng = np.random.default_rng(k)
    return rng.standard_normal(1000).astype(np.float32), rng.integers(-9, 9, 3).astype(np.int64)


def _memfds(pid: str = "self") -> list[str]:
    """This process's descriptors and mappings of the transfers' anonymous file."""
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return [entry for entry in fds + Path(f"/proc/{pid}/maps").read_text().splitlines() if "tessel-shared-p2p" in entry]


def _fork(layout: dict, rank: int, body, timeout_s: float, tmp_path) -> int:
    """Fork a rank that runs `body(channels)`; a PeerError's line goes to rank{rank}.txt. Its pid."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            channels = SharedChannels.attach(json.dumps(layout), rank, timeout_s)
            body(channels)
            channels.close()
            status = 0
        except PeerError as exc:
            (tmp_path / f"rank{rank}.txt").write_text(str(exc))
        finally:
            os._exit(status)
    return pid


def _exit_codes(pids: list[int]) -> list[int]:
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def test_messages_arrive_in_order_with_their_bytes(tmp_path):
    layout = create_layout(2, CHANNELS, count=2)
    messages = 7  # more than the 2 slots: the sender's later sends wait for free slots

    def sender(channels):
        waits = []
        for k in range(messages):
            floats, ints = _messages(k)
            waits.append(channels.start_send(floats, 1, 0, "floats"))
            waits.append(channels.start_send(ints, 1, 7, "ints"))
        for wait in waits:
            wait()
        answer = np.zeros(16, np.float32)
        channels.recv(answer, 1, 3, "answer")
        np.save(tmp_path / "answer.npy", answer)

    def receiver(channels):
        time.sleep(0.2)  # every send is issued before the first receive
        got = {}
        for k in range(messages):
            floats, ints = np.empty(1000, np.float32), np.empty(3, np.int64)
            # Posted in order, waited in the other order: each wait takes its own message.
            wait_ints = channels.start_recv(ints, 0, 7, "ints")
            channels.start_recv(floats, 0, 0, "floats")()
            wait_ints()
            got[f"f{k}"], got[f"i{k}"] = floats, ints
        np.savez(tmp_path / "got.npz", **got)
        channels.start_send(np.arange(16, dtype=np.float32), 0, 3, "answer")()

    pids = [_fork(layout, 0, sender, 30, tmp_path), _fork(layout, 1, receiver, 30, tmp_path)]
    close_layout(layout)
    assert _exit_codes(pids) == [0, 0]
    got = np.load(tmp_path / "got.npz", allow_pickle=False)
    for k in range(messages):
        floats, ints = _messages(k)
        assert got[f"f{k}"].tobytes() == floats.tobytes() and got[f"i{k}"].tobytes() == ints.tobytes()
    np.testing.assert_array_equal(np.load(tmp_path / "answer.npy"), np.arange(16, dtype=np.float32))


def test_flush_copies_in_a_deferred_send_once_the_receiver_frees_its_slot(tmp_path):
    layout = create_layout(2, CHANNELS, count=2)

    def sender(channels):
        for k in range(3):  # the third waits for a slot: nothing but flush moves it on
            channels.start_send(_messages(k)[1], 1, 7, "ints")
        channels.flush()

    def receiver(channels):
        time.sleep(0.2)
        got = [np.empty(3, np.int64) for _ in range(3)]
        for array in got:
            channels.recv(array, 0, 7, "ints")
        np.save(tmp_path / "got.npy", np.stack(got))

    pids = [_fork(layout, 0, sender, 30, tmp_path), _fork(layout, 1, receiver, 30, tmp_path)]
    close_layout(layout)
    assert _exit_codes(pids) == [0, 0]
    np.testing.assert_array_equal(np.load(tmp_path / "got.npy"), np.stack([_messages(k)[1] for k in range(3)]))


def test_a_dead_peer_fails_the_wait_with_one_line_within_the_timeout(tmp_path):
    layout = create_layout(2, CHANNELS, count=2)

    def dies(channels):
        channels.recv(np.empty(1000, np.float32), 0, 0, "floats")
        os._exit(9)  # killed before it answers

    def waits(channels):
        channels.start_send(_messages(0)[0], 1, 0, "floats")()
        started = time.perf_counter()
        try:
            channels.recv(np.empty(16, np.float32), 1, 3, "answer")
        finally:
            (tmp_path / "waited.txt").write_text(str(time.perf_counter() - started))

    pids = [_fork(layout, 0, waits, 10.0, tmp_path), _fork(layout, 1, dies, 30, tmp_path)]
    close_layout(layout)
    assert _exit_codes(pids) == [1, 9]
    # Rank 1's exit wakes rank 0's wait at once, long before the timeout.
    assert (tmp_path / "rank0.txt").read_text() == "rank 0: gave up waiting for tensor 'answer' from rank 1 (rank 1 exited)"
    assert float((tmp_path / "waited.txt").read_text()) < 5.0


def test_a_send_to_a_peer_that_never_takes_it_fails_within_the_timeout():
    layout = create_layout(2, CHANNELS, count=2)
    channels = SharedChannels(layout, 0, 0.3)
    waits = [channels.start_send(_messages(k)[0], 1, 0, "floats") for k in range(3)]
    waits[0](), waits[1]()  # two slots: copied in at once
    started = time.perf_counter()
    with pytest.raises(PeerError, match=r"^rank 0: sending tensor 'floats' to rank 1 failed \(no message through "
                                        r"shared memory within 0.3 s\)$"):
        waits[2]()
    assert time.perf_counter() - started < 2.0
    del waits  # they hold arrays over the segment: closing unmaps it only once they are gone
    channels.close()


def test_only_the_plans_transfers_of_the_right_size_go_through_rings_and_nothing_is_left():
    before = _memfds()
    layout = create_layout(2, CHANNELS)
    channels = SharedChannels(layout, 1, 1.0)
    assert channels.carries(np.empty(1000, np.float32), 0, 0, sending=False)
    assert not channels.carries(np.empty(1000, np.float32), 0, 0, sending=True)  # rank 1 sends nothing under 0
    assert not channels.carries(np.empty(999, np.float32), 0, 0, sending=False)  # another size: gloo's
    assert not channels.carries(np.empty((2, 1000), np.float32)[:, 0], 0, 7, sending=False)  # not contiguous
    assert not channels.carries(np.empty(1000, np.float32), 0, 5, sending=False)  # a tag the plan has no ring for
    assert channels.carries(np.empty(16, np.float32), 0, 3, sending=True)
    assert _memfds() != before
    channels.close()
    assert _memfds() == before and not [name for name in os.listdir("/dev/shm") if "tessel" in name]
    # Rings beyond the limit are left to gloo; none at all: no segment.
    small = create_layout(2, CHANNELS, count=1, limit=4300)
    close_layout(small)
    assert [ring[:3] for ring in small["rings"]] == [[0, 1, 0]]
    assert create_layout(2, CHANNELS, limit=100) is None


def test_plan_channels_pairs_each_send_with_its_receive():
    def program(*instructions):
        return program_to_json(instructions)

    plan = {"values": {"a": "float32[2,3]", "b": "int64[4]", "c": "float32[1]"}, "workers": [
        {"instructions": program(Send(node="n", op="Identity", tensor="a", peer=1, tag=0),
                                 Send(node="n", op="Identity", tensor="b", peer=1, tag=1),
                                 Recv(node="n", op="Identity", output="c", peer=1, tag=2))},
        {"instructions": program(Recv(node="n", op="Identity", output="a", peer=0, tag=0),
                                 Recv(node="n", op="Identity", output="c", peer=0, tag=1),
                                 Send(node="n", op="Identity", tensor="c", peer=0, tag=2))}]}
    # Tag 1 is received into a tensor of another size: left to gloo, which reports the mismatch.
    assert plan_channels(plan) == [(0, 1, 0, 24), (1, 0, 2, 4)]


def test_gloo_is_chosen_by_the_environment_and_a_wrong_choice_refused(monkeypatch):
    monkeypatch.setenv(SENDRECV_ENV, "gloo")
    assert not available()
    monkeypatch.setenv(SENDRECV_ENV, "tcp")
    with pytest.raises(ValueError, match="expected shm or gloo"):
        available()
