"""Data-parallel training: every worker runs one replica's step on its slice of the batch.

The step graph is built at the slice's batch (the model imported at batch / N, so every shape, the loss's mean
and BatchNormalization's n / (n - 1) are the slice's) with each gradient averaged over the replicas by AllReduce
nodes issued as soon as their gradients exist, in buckets, the loss riding in the last bucket
(passes/data_parallel.py), then
the optimizer update: the replicas update identical weights with identical gradients and stay identical. It
compiles once, as for one device; `replica_programs` then gives each worker its program:

- every worker takes its slice of each batched input (data, labels, dropout masks) along axis 0 and the
  optimizer's scalars (learning rate, bias corrections) straight from the client (runtime/batch_io.py
  `worker_feeds`): no batch goes through rank 0 or a peer;
- rank 0 returns the loss (already the mean over the replicas); the state update stays in each worker.

Every worker starts from the same state file, so the weights agree from the first step. By default
BatchNormalization normalises with each replica's own batch statistics and each replica keeps its own running
statistics (rank 0's are the ones saved): with BatchNormalization the result differs from training on the whole
batch on one device and equals PyTorch's DistributedDataParallel without SyncBatchNorm. With sync_batchnorm the
replicas all-reduce every BN's batch statistics and their gradients (passes/training_mode.py), train as one device
on the whole batch and keep identical running statistics (tests/compiler/test_dp_training.py).

Each gradient bucket's all-reduce algorithm is chosen by its α-β cost (passes/data_parallel.py `choose_allreduce`)
and reported in the step artifact's reports/data_parallel.md and .json.
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Mapping, Sequence

from tessel.ir.graph import Graph
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.types import TensorType
from tessel.passes.data_parallel import AllReduceChoice, allreduce_choices
from tessel.passes.machine import Link
from tessel.runtime.ps_compression import message_bytes, row_segments

from .api import divided_batch_shapes
from .options import CompileError
from .program import Program


def allreduce_plan(graph: Graph, link: Link, workers: int, requested: str) -> list[AllReduceChoice]:
    """Each AllReduce of the replica's step `graph` with its algorithm (`requested`, or "auto"); CompileError for an
    algorithm unknown or not executed."""
    try:
        return allreduce_choices(graph, link, workers, requested)
    except ValueError as exc:
        raise CompileError(str(exc)) from None


def write_allreduce_report(directory: str | Path, choices: Sequence[AllReduceChoice], link: Link,
                           compressed: dict | None = None) -> None:
    """reports/data_parallel.json and .md in the step artifact `directory`: the link, each all-reduce (bucket)
    in the order backward issues them, every algorithm's predicted time and the one that runs; with
    compressed gradients, their bytes per step (`compressed_bytes`)."""
    reports = Path(directory) / "reports"
    where = f"link alpha {1e6 * link.alpha:.1f} us, beta {1e9 * link.beta:.3f} ns/byte" + \
        ("" if link.measured else " (default: `tessel calibrate` has not run)")
    (reports / "data_parallel.json").write_text(json.dumps(
        {"link": {"alpha_s": link.alpha, "beta_s_per_byte": link.beta, "measured": link.measured},
         "allreduces": [asdict(choice) for choice in choices], "compression": compressed}, indent=1))
    lines = ["# Data-parallel all-reduce", "", f"{len(choices)} all-reduce(s) per step, {where}:", ""]
    lines += [f"- {choice.describe()}" for choice in choices]
    if compressed:
        lines += ["", f"Gradients compressed ({compressed['codec']}, error feedback per worker), exchanged by "
                  f"all-gather: {compressed['bytes_per_step']} B sent per worker per step against "
                  f"{compressed['float32_ring_bytes_per_step']:.0f} B for a float32 ring all-reduce "
                  f"({compressed['ratio']:.1f}x fewer)."]
    (reports / "data_parallel.md").write_text("\n".join(lines) + "\n")


def compression_summary(directory: str | Path) -> str | None:
    """One line on the step artifact `directory`'s compressed gradient exchange (its report), None without."""
    path = Path(directory) / "reports" / "data_parallel.json"
    compressed = json.loads(path.read_text()).get("compression") if path.is_file() else None
    if not compressed:
        return None
    return (f"gradients compressed ({compressed['codec']}): {compressed['bytes_per_step']} B sent per worker per "
            f"step, {compressed['ratio']:.1f}x fewer than a float32 ring all-reduce")


def compressed_bytes(graph: Graph, workers: int) -> dict | None:
    """The bytes per step of the compressed gradient exchange of a replica's step `graph` on `workers`
    (all-gather: each worker sends its message to every other) beside a float32 ring all-reduce of the same
    gradients (2 (W-1)/W times their bytes); None when its gradients are not compressed."""
    nodes = [node for node in graph.nodes if node.domain == TESSEL_DOMAIN and node.op_type == "AllReduce"
             and node.attrs.get("compression", "none") != "none"]
    if not nodes:
        return None
    sent = sum((workers - 1) * message_bytes(node.attrs["compression"],
                                             row_segments(node.attrs["part_sizes"], node.attrs["part_rows"]),
                                             node.attrs["topk_ratio"]) for node in nodes)
    ring = sum(2 * (workers - 1) / workers * node.inputs[0].type.nbytes for node in nodes)
    return {"codec": nodes[0].attrs["compression"], "bytes_per_step": sent, "float32_ring_bytes_per_step": ring,
            "ratio": ring / sent}


def replica_input_shapes(input_shapes: Mapping[str, Sequence[int]], replicas: int) -> dict[str, tuple[int, ...]]:
    """Each replica's input shapes: axis 0 (the batch) divided by `replicas`; CompileError when it does not divide."""
    return divided_batch_shapes(input_shapes, replicas, "data-parallel training", f"on {replicas} workers")


def replica_programs(program: Program, shared: Sequence[str], workers: int) -> list[Program]:
    """One program per worker from a replica's step `program`: every worker takes the replica's inputs straight
    from the client (its slice of each batched input along axis 0, and the inputs in `shared`, the optimizer's
    scalars, whole: runtime/batch_io.py `worker_feeds`), so no batch goes through a peer; rank 0 alone returns
    the outputs. CompileError when a shared input is not a scalar (batched inputs are the ones with axes)."""
    values = program.values
    tensors = [name for name in shared if TensorType.parse(values[name]).rank]
    if tensors:
        raise CompileError(f"data-parallel training: the shared input(s) {', '.join(tensors)} must be scalars")
    return [replace(program, outputs=program.outputs if rank == 0 else [], state=list(program.state))
            for rank in range(workers)]
