"""Messages between an InferenceSession and its workers over pipes: a JSON header and raw tensor bytes.

A message is 8 bytes (the header's length, the payload's length; little-endian
uint32 each), a JSON header, then the payload: the listed tensors' bytes, one
after the other in C order. The header says each tensor's name, dtype and shape;
only plain numeric and bool dtypes are accepted, so nothing is ever unpickled,
and a payload whose size does not match its header is refused.

Raw bytes rather than .npz: an .npz is a zip archive, whose checksums and
directory cost more than the copy itself for a 600 KB image (the session's
overhead per call is meant to stay well under a millisecond).
"""
from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any, Callable, Mapping

import numpy as np

from .errors import ExecutionError

_LENGTHS = struct.Struct("<II")
# numpy kinds a tensor may have on the wire: bool, signed/unsigned integers, floats, complex.
_KINDS = frozenset("biufc")


class ChannelClosed(ExecutionError):
    """The other end of a pipe went away (its process exited) or did not answer in time."""


def encode(header: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None) -> list[memoryview]:
    """The message's pieces (write them in order): lengths and header, then each tensor's bytes."""
    # np.ascontiguousarray makes a scalar one-dimensional: the shape is put back.
    arrays = {name: np.ascontiguousarray(a).reshape(np.shape(a)) for name, a in (tensors or {}).items()}
    for name, array in arrays.items():
        if array.dtype.kind not in _KINDS:
            raise ExecutionError(f"tensor '{name}' has dtype {array.dtype}, which cannot be sent to a worker")
    described = {**header, "tensors": [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]}
    text = json.dumps(described).encode()
    payload = sum(a.nbytes for a in arrays.values())
    # Lengths and header in one write: in two, the reader could wake for the lengths and again for the header.
    return [memoryview(_LENGTHS.pack(len(text), payload) + text),
            *(memoryview(a).cast("B") for a in arrays.values() if a.nbytes)]


def write_message(fd: int, header: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None,
                  deadline: float | None = None, wait: Callable[[int, float | None], None] | None = None) -> None:
    """Write one message to `fd`; raise ChannelClosed when the reader is gone or, on a non-blocking `fd`
    with a `deadline` (time.monotonic), when it has not taken the message by then. `wait(fd, deadline)`, when
    given, is called instead of a plain wait whenever the pipe is full (it may do other work meanwhile)."""
    for piece in encode(header, tensors):
        _write_all(fd, piece, deadline, wait or _wait_writable)


def read_message(fd: int, deadline: float | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """Read one message from `fd`: (header, tensors by name), or None at end of file before a message starts.

    Raises ChannelClosed when the writer leaves in the middle of a message or (a non-blocking `fd`) the
    deadline passes.
    """
    lengths = _read_exactly(fd, _LENGTHS.size, deadline, at_start=True)
    if lengths is None:
        return None
    header_bytes, payload_bytes = _LENGTHS.unpack(lengths)
    header = json.loads(bytes(_read_exactly(fd, header_bytes, deadline)))
    tensors: dict[str, np.ndarray] = {}
    specs = header.pop("tensors", [])
    sizes = []
    for name, dtype_text, shape in specs:
        dtype = np.dtype(dtype_text)
        if dtype.kind not in _KINDS:
            raise ChannelClosed(f"a message holds tensor '{name}' of dtype {dtype}, which is never sent")
        sizes.append(dtype.itemsize * int(np.prod(shape, dtype=np.int64)))
    if sum(sizes) != payload_bytes:
        raise ChannelClosed(f"a message's tensors need {sum(sizes)} bytes but it carries {payload_bytes}")
    payload = _read_exactly(fd, payload_bytes, deadline) if payload_bytes else bytearray()
    offset = 0
    for (name, dtype_text, shape), size in zip(specs, sizes):
        tensors[name] = np.frombuffer(payload, np.dtype(dtype_text), int(np.prod(shape, dtype=np.int64)),
                                      offset).reshape(shape)
        offset += size
    return header, tensors


def _wait_writable(fd: int, deadline: float | None) -> None:
    _wait(fd, True, deadline)


def _wait(fd: int, writing: bool, deadline: float | None) -> None:
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready = select.select([], [fd], [], remaining) if writing else select.select([fd], [], [], remaining)
    if not any(ready):
        raise ChannelClosed("no answer from the other end of the pipe in time")


def _write_all(fd: int, data: memoryview, deadline: float | None, wait: Callable[[int, float | None], None]) -> None:
    while data:
        try:
            written = os.write(fd, data)
        except BlockingIOError:  # a non-blocking pipe that is full: wait until the reader takes some
            wait(fd, deadline)
            continue
        except (BrokenPipeError, ConnectionResetError):
            raise ChannelClosed("the reader of the pipe is gone") from None
        data = data[written:]


def _read_exactly(fd: int, size: int, deadline: float | None, at_start: bool = False) -> bytearray | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        try:
            got = os.readv(fd, [view[done:]])
        except BlockingIOError:  # a non-blocking pipe with nothing to read yet
            _wait(fd, False, deadline)
            continue
        if got == 0:
            if at_start and done == 0:
                return None
            raise ChannelClosed("the writer of the pipe left in the middle of a message")
        done += got
    return buffer
