"""Shared-memory slots of a session's requests (runtime/shared_slots.py): layout, copies in and out, another
process sees the same bytes, nothing is ever named in /dev/shm and close() releases the memory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tessel.runtime.errors import SettingError
from tessel.runtime.shared_slots import DEFAULT_SLOT_LIMIT, SLOT_LIMIT_ENV, SharedSlots, describe, slot_limit

ROOT = Path(__file__).resolve().parents[2]
NAME = "tessel-session-slots"


def _tensors() -> dict[str, np.ndarray]:
    return {"image": np.zeros((1, 3, 5, 7), np.float32), "ids": np.zeros((3,), np.int64), "scale": np.float64(0)}


def _memfds(pid: str = "self") -> list[str]:
    """This process's descriptors and mappings of the slots' anonymous files."""
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used
            pass
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [entry for entry in fds + maps if NAME in entry]


def test_each_tensor_of_each_slot_is_aligned_and_apart():
    layout = describe(_tensors(), 3)
    assert [entry[3] for entry in layout["tensors"]] == [0, 448, 512]  # 420 B of floats, rounded up to 64
    assert layout["slot_bytes"] == 576 and layout["count"] == 3
    slots = SharedSlots.create(_tensors(), 3)
    try:
        for slot in range(3):
            slots.write(slot, {"image": np.full((1, 3, 5, 7), slot, np.float32), "ids": np.arange(3) + slot,
                               "scale": np.float64(slot / 2)})
        for slot in range(3):
            read = slots.read(slot)
            assert (read["image"] == slot).all() and list(read["ids"]) == [slot, slot + 1, slot + 2]
            assert read["scale"].shape == () and read["scale"] == slot / 2
        assert slots.fits(_tensors())
        assert not slots.fits({**_tensors(), "ids": np.zeros((4,), np.int64)})
        assert not slots.fits({**_tensors(), "ids": np.zeros((3,), np.int32)})
        assert not slots.fits({"image": _tensors()["image"]})
    finally:
        slots.close()


def test_objects_are_refused():
    with pytest.raises(ValueError, match="cannot go through shared memory"):
        describe({"names": np.array(["a"], object)}, 1)


CHILD = """
import sys
import numpy as np
from tessel.runtime.shared_slots import SharedSlots
slots = SharedSlots.attach(sys.argv[1])
views = slots.views(1)
views["out"][...] = views["x"] * 2
"""


def test_a_process_that_inherits_the_descriptor_reads_and_writes_the_same_memory():
    shm_before = sorted(os.listdir("/dev/shm"))
    slots = SharedSlots.create({"x": np.zeros(4, np.float32), "out": np.zeros(4, np.float32)}, 2)
    try:
        slots.write(1, {"x": np.arange(4, dtype=np.float32), "out": np.zeros(4, np.float32)})
        done = subprocess.run([sys.executable, "-c", CHILD, slots.to_json()], cwd=ROOT, pass_fds=(slots.fd,),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert list(slots.read(1)["out"]) == [0, 2, 4, 6]
        assert _memfds()
        assert sorted(os.listdir("/dev/shm")) == shm_before  # nameless: nothing to leak there
    finally:
        slots.close()
    assert _memfds() == []


def test_the_slot_limit_is_a_number_of_bytes(monkeypatch):
    monkeypatch.delenv(SLOT_LIMIT_ENV, raising=False)
    assert slot_limit() == DEFAULT_SLOT_LIMIT
    monkeypatch.setenv(SLOT_LIMIT_ENV, "4096")
    assert slot_limit() == 4096
    monkeypatch.setenv(SLOT_LIMIT_ENV, "1GiB")
    with pytest.raises(SettingError, match=f"^{SLOT_LIMIT_ENV}='1GiB': expected a number of bytes"):
        slot_limit()
