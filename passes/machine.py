"""What the placement solvers reason about: tasks, the link between devices, the machine.

Shared by the planners (passes/placement.py), the collective cost model
(passes/collectives.py), the driver that builds tasks (compiler/distribute.py)
and the link calibration (runtime/calibrate.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """One unit of placement: a node, its run time, resident bytes and the tasks it reads from."""

    name: str
    op: str
    seconds: float
    weight_bytes: int
    output_bytes: int
    inputs: tuple[tuple[str, int], ...] = ()  # (producer task, bytes read from it)
    estimated: bool = False


@dataclass(frozen=True)
class Link:
    """Cost of moving bytes between two devices: alpha + beta * bytes seconds."""

    alpha: float
    beta: float
    measured: bool = False

    def seconds(self, nbytes: int) -> float:
        """Time to move `nbytes` (zero bytes cost nothing)."""
        return self.alpha + self.beta * nbytes if nbytes else 0.0


@dataclass(frozen=True)
class Machine:
    """Devices (memory bytes each) and the link between any two of them."""

    memory: tuple[int, ...]
    link: Link

    @property
    def devices(self) -> int:
        """Number of devices."""
        return len(self.memory)
