"""Scatter, all-reduce and gather as instructions, run by two workers (gloo) with no kernel at all."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tessel.backends.cache import KernelCache
from tessel.compiler.artifact import load
from tessel.compiler.memory import plan_program_memory
from tessel.compiler.packaging import write_artifact
from tessel.compiler.program import Program
from tessel.runtime.instructions import AllReduce, Gather, Scatter


def _worker(rank: int, reduction: str) -> Program:
    root = rank == 0
    instructions = [Scatter("scatter_x", "Scatter", output="part", root=0, parts=2, tag=1 << 20,
                            source="x" if root else None),
                    AllReduce("reduce", "AllReduce", tensor="part", reduction=reduction),
                    Gather("gather_y", "Gather", input="part", root=0, parts=2, tag=1 << 21, output="y" if root else None)]
    values = {"part": "float32[2,3]", **({"x": "float32[4,3]", "y": "float32[4,3]"} if root else {})}
    return Program(instructions, {}, values, {}, ["x"] if root else [], ["y"] if root else [])


def test_two_workers_scatter_reduce_and_gather(tmp_path: Path):
    # One launch (workers take seconds to start): the mean, gloo's sum divided by the workers.
    reduction = "mean"
    programs = [_worker(0, reduction), _worker(1, reduction)]
    write_artifact(tmp_path, programs, [plan_program_memory(p, "llvm") for p in programs], "llvm",
                   KernelCache(tmp_path / "cache"))
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y = load(tmp_path).run({"x": x})["y"]
    halves = x.reshape(2, 2, 3)
    expected = {"sum": halves.sum(0), "mean": halves.mean(0), "max": halves.max(0)}[reduction]
    np.testing.assert_allclose(y, np.concatenate([expected, expected]))
