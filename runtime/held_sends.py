"""Sends held in flight across runs: a worker waits for a send only before it overwrites the sent bytes.

A gloo send completes only once the receiver has posted its receive. Waiting
for every send at the end of a run would tie each pipeline stage to the next
one's progress: stage 0 could not start micro-batch k + 1 before stage 1 had
taken micro-batch k. Instead, a Send's wait is deferred to the first point,
in the next run, where something writes bytes of the sent buffer: the input
copy at the run's start, or an instruction that writes a value overlapping it
(views write nothing). Until then the buffer is only read, so the send may
still be reading it.

How early that point comes is the memory plan's business: an inference
program's sent values are planned live over the whole run (compiler/memory.py),
so their bytes are written only by their producer, near the end of the stage.
The rule here is safe for any plan, because it looks at the bytes themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from .instructions import Instruction, Send, View, walk

Wait = Callable[[], None]


def byte_range(buffer) -> tuple[int, int]:
    """[first, last + 1) addresses of a C-contiguous buffer: a host array, or a TVM tensor in device memory."""
    if isinstance(buffer, np.ndarray):
        start = int(buffer.__array_interface__["data"][0])
        return start, start + int(buffer.nbytes)
    start = int(buffer.data_ptr())
    return start, start + int(np.prod(buffer.shape, dtype=np.int64)) * np.dtype(str(buffer.dtype)).itemsize


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@dataclass(frozen=True)
class WaitPoints:
    """Where a run waits for the previous run's held sends, by sent value name: before copying the inputs in,
    before run instruction k (`before[k]`), or at the end of the run (a sent buffer nothing in the run writes)."""

    before_inputs: tuple[str, ...]
    before: Mapping[int, tuple[str, ...]]
    at_end: tuple[str, ...]


def held_send_names(run_instructions: Sequence[Instruction]) -> tuple[str, ...]:
    """The values the run's top-level Sends send (sends inside an If branch are waited for at the run's end)."""
    return tuple(dict.fromkeys(i.tensor for i in run_instructions if isinstance(i, Send)))


def wait_points(run_instructions: Sequence[Instruction], sent: Sequence[str], inputs: Iterable[str],
                buffer_of: Callable[[str], np.ndarray]) -> WaitPoints:
    """For each sent value, the first point of a run that writes bytes of its buffer."""
    if not sent:  # nothing sent (one worker): no point to find, and its buffers need not be host arrays
        return WaitPoints((), {}, ())
    ranges = {name: byte_range(buffer_of(name)) for name in sent}
    input_ranges = [byte_range(buffer_of(name)) for name in inputs]
    before_inputs = tuple(name for name, r in ranges.items() if any(_overlaps(r, i) for i in input_ranges))
    left = {name: r for name, r in ranges.items() if name not in before_inputs}
    before: dict[int, list[str]] = {}
    for k, instruction in enumerate(run_instructions):
        if not left:
            break
        written = [byte_range(buffer_of(name)) for inner in walk([instruction]) if not isinstance(inner, View)
                   for name in inner.writes()]
        hit = [name for name, r in left.items() if any(_overlaps(r, w) for w in written)]
        for name in hit:
            before.setdefault(k, []).append(name)
            del left[name]
    return WaitPoints(before_inputs, {k: tuple(names) for k, names in before.items()}, tuple(left))


class HeldSends:
    """The sends still in flight, by sent value name; each waited for once."""

    def __init__(self) -> None:
        self._waits: dict[str, list[Wait]] = {}

    def hold(self, name: str, wait: Wait) -> None:
        """Keep the wait of a send of `name` just started."""
        self._waits.setdefault(name, []).append(wait)

    def wait(self, names: Iterable[str]) -> None:
        """Wait for the sends of `names` still in flight (a send that failed raises its PeerError)."""
        for name in names:
            for wait in self._waits.pop(name, ()):
                wait()

    def wait_all(self) -> None:
        """Wait for every send still in flight."""
        self.wait(list(self._waits))
