"""Shared-memory slots for a session's request tensors: inputs written once by the client, outputs once by rank 0.

A worker's request inputs and rank 0's outputs have shapes fixed by the plan, so the client sizes one slot per
request in flight (`count` slots, a ring) for each worker that takes inputs, and one for rank 0's outputs. A run
request then writes its tensors straight into the next slot and sends the worker only a doorbell on its pipe
(runtime/wire.py's JSON header naming the slot); the worker reads the tensors in place and rank 0 writes its
outputs into the same-numbered output slot. That is one copy each way, where a pipe costs two (into the kernel
and out again, 0.57 ms for a 600 KB image) and the wake-ups of a pipe that fills.

The memory is an anonymous file (memfd_create): it has no name, so nothing is ever left in /dev/shm, whatever
ends the client or a worker (close, exit, a signal, SIGKILL). The client passes its descriptor to the worker it
starts (pass_fds), as it does the pipes; the kernel frees the memory when the last descriptor and mapping are gone.

A worker's slots take at most SLOT_LIMIT_ENV bytes (all its slots together; default 1 GiB): a model whose request
tensors need more sends them over the pipes instead (runtime/worker_group.py), which costs two copies more but
no memory beyond the pipes' own. Setting it to 0 sends every request over the pipes.

Layout (runtime/serve.py reads it from SLOTS_ENV): {"fd": F, "count": N, "slot_bytes": B, "tensors": [[name,
dtype.str, shape, offset], ...]}; slot k starts at byte k * B, each tensor at its offset (64-byte aligned).
"""
from __future__ import annotations

import json
import mmap
import os
import tempfile
from typing import Any, Mapping

import numpy as np

from .errors import SettingError

# Descriptions of a worker's input slots and rank 0's output slots, for runtime/serve.py.
SLOTS_ENV = "TESSEL_SLOTS"
# The most bytes one worker's slots (inputs or outputs, every request in flight) may take; above, the pipes.
SLOT_LIMIT_ENV = "TESSEL_SESSION_SLOT_BYTES"
DEFAULT_SLOT_LIMIT = 1 << 30
_ALIGN = 64


class SharedSlots:
    """`count` slots, each holding one set of named tensors of fixed dtype and shape, in one shared mapping."""

    def __init__(self, layout: Mapping[str, Any], fd: int):
        """Map the slots of `layout` (`describe`) in the anonymous file `fd` (this object closes it)."""
        self.layout = dict(layout)
        self.fd = fd
        self.count = int(layout["count"])
        size = self.count * int(layout["slot_bytes"])
        self._map = mmap.mmap(fd, size) if size else None
        self._views = [self._slot_views(k) for k in range(self.count)] if size else [{} for _ in range(self.count)]

    @classmethod
    def create(cls, tensors: Mapping[str, np.ndarray], count: int) -> "SharedSlots":
        """New slots shaped like `tensors` (only their dtypes and shapes count), in a new anonymous file."""
        layout = describe(tensors, count)
        fd = anonymous_file(layout["count"] * layout["slot_bytes"])
        try:
            return cls(layout, fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, text: str) -> "SharedSlots":
        """The slots that a `describe` layout in JSON (with the descriptor this process inherited) names."""
        layout = json.loads(text)
        return cls(layout, int(layout["fd"]))

    def to_json(self) -> str:
        """The layout with this descriptor, for the worker that inherits it."""
        return json.dumps({**self.layout, "fd": self.fd})

    def views(self, slot: int) -> dict[str, np.ndarray]:
        """Slot `slot`'s tensors by name: arrays over the shared memory (written in place, read in place)."""
        return self._views[slot]

    def fits(self, tensors: Mapping[str, np.ndarray]) -> bool:
        """Whether `tensors` are exactly the slots' tensors (names, dtypes, shapes): then they can go through them."""
        views = self._views[0]
        if tensors.keys() != views.keys():
            return False
        return all(np.shape(a) == v.shape and np.asarray(a).dtype == v.dtype for a, v in
                   ((tensors[name], view) for name, view in views.items()))

    def write(self, slot: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Copy `tensors` (they `fit`) into slot `slot`."""
        for name, view in self._views[slot].items():
            view[...] = tensors[name]

    def read(self, slot: int) -> dict[str, np.ndarray]:
        """Copies of slot `slot`'s tensors (the slot is reused by a later request)."""
        return {name: view.copy() for name, view in self._views[slot].items()}

    def close(self) -> None:
        """Unmap the slots and close the descriptor (the memory is freed once no process holds it)."""
        self._views = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an array over the slots is still alive: the mapping goes with it
                pass
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _slot_views(self, slot: int) -> dict[str, np.ndarray]:
        base = slot * int(self.layout["slot_bytes"])
        views = {}
        for name, dtype, shape, offset in self.layout["tensors"]:
            dtype = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            views[name] = np.frombuffer(self._map, dtype, count, base + offset).reshape(shape)
        return views


def slot_limit() -> int:
    """SLOT_LIMIT_ENV's bytes (a whole number, 0 or more), DEFAULT_SLOT_LIMIT when unset."""
    text = os.environ.get(SLOT_LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_SLOT_LIMIT
    if not text.isdigit():
        raise SettingError(f"{SLOT_LIMIT_ENV}={text!r}: expected a number of bytes, 0 or more "
                           f"(unset it for the default, {DEFAULT_SLOT_LIMIT})")
    return int(text)


def describe(tensors: Mapping[str, np.ndarray], count: int) -> dict[str, Any]:
    """The layout of `count` slots holding `tensors`' dtypes and shapes, each tensor 64-byte aligned."""
    entries, offset = [], 0
    for name, array in tensors.items():
        dtype = np.asarray(array).dtype
        if dtype.kind not in "biufc":  # what runtime/wire.py accepts: plain numbers, never objects
            raise ValueError(f"tensor '{name}' of dtype {dtype} cannot go through shared memory")
        entries.append([name, dtype.str, list(np.shape(array)), offset])
        offset += -(-np.asarray(array).nbytes // _ALIGN) * _ALIGN
    return {"count": count, "slot_bytes": offset, "tensors": entries}


def anonymous_file(size: int, label: str = "tessel-session-slots") -> int:
    """A descriptor of a new nameless file of `size` bytes in memory (`label` names it in /proc only)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
    else:  # not Linux: an unlinked temporary file (in /dev/shm where there is one)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryFile(dir=shm) as named:
            fd = os.dup(named.fileno())
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd
