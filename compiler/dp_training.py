"""Data-parallel training: every worker runs one replica's step on its slice of the batch.

The step graph is built at the slice's batch (the model imported at batch / N, so every shape, the loss's mean
and BatchNormalization's n / (n - 1) are the slice's) with each gradient and the loss averaged over the replicas
by an AllReduce node placed right after the node that computes it (compiler/training.py `replica_mean`), then
the optimizer update: the replicas update identical weights with identical gradients and stay identical. It
compiles once, as for one device; `replica_programs` then gives each worker its program:

- rank 0 takes the whole batch and scatters every batched input (data, labels, dropout masks) along axis 0;
- the optimizer's scalars (learning rate, bias corrections) go from rank 0 to every peer (Send/Recv);
- rank 0 returns the loss (already the mean over the replicas); the state update stays in each worker.

Every worker starts from the same state file, so the weights agree from the first step. BatchNormalization
normalises with each replica's own batch statistics and each replica keeps its own running statistics (rank 0's
are the ones saved): with BatchNormalization the result differs from training on the whole batch on one device.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from tessel.ir.graph import Graph, Value
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.types import TensorType
from tessel.passes.base import add_op
from tessel.passes.machine import Link
from tessel.runtime.instructions import Recv, Scatter, Send

from .options import CompileError
from .program import Program, renamed_program
from .worker_programs import SCATTER_TAG, SLICE_SUFFIX

# Tags of the optimizer scalars sent from rank 0: scalar k to worker d uses SCALAR_TAG + k * workers + d.
SCALAR_TAG = 1 << 22
# Gradient bucket bytes without a link model, and the range a link model may choose in (PyTorch DDP: 25 MiB).
DEFAULT_BUCKET_BYTES = 1 << 20
MIN_BUCKET_BYTES, MAX_BUCKET_BYTES = 64 << 10, 25 << 20
# A bucket is large enough when the link's latency is at most this share of its all-reduce time.
LATENCY_SHARE = 0.1


def bucket_bytes_for(link: Link | None) -> int:
    """Gradient bucket size from the α-β link model: the smallest bucket whose latency α is at most
    LATENCY_SHARE of its time α + β·bytes, within [MIN_BUCKET_BYTES, MAX_BUCKET_BYTES]."""
    if link is None or link.beta <= 0:
        return DEFAULT_BUCKET_BYTES
    wanted = link.alpha * (1 - LATENCY_SHARE) / (LATENCY_SHARE * link.beta)
    return int(min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, wanted)))


def replica_mean(graph: Graph, value: Value) -> Value:
    """`value` averaged over the data-parallel replicas: an AllReduce node placed right after the node that
    computes it, so that its reduction starts while the rest of the backward pass still runs."""
    node = add_op(graph, "AllReduce", [value], {"reduction": "mean"}, name=graph.unique_name(f"allreduce/{value.name}"),
                  before=_after(graph, value), domain=TESSEL_DOMAIN)
    return node.outputs[0]


def averaged_gradients(graph: Graph, grads: Mapping[str, Value], bucket_bytes: int) -> dict[str, Value]:
    """Each gradient averaged over the replicas, in buckets: in the order backward computes them, consecutive
    gradients up to `bucket_bytes` together are flattened into one buffer, all-reduced as soon as the bucket's
    last gradient exists, and split back at the end of backward (just before the optimizer update reads
    them). A bucket of one gradient is all-reduced as it is."""
    position = {id(node): k for k, node in enumerate(graph.nodes)}
    ordered = sorted(grads.items(), key=lambda item: position.get(id(item[1].producer), -1))
    buckets: list[list[tuple[str, Value]]] = []
    size = 0
    for name, grad in ordered:
        if not buckets or size + grad.type.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, grad))
        size += grad.type.nbytes
    averaged: dict[str, Value] = {}
    for bucket in buckets:
        if len(bucket) == 1:
            averaged[bucket[0][0]] = replica_mean(graph, bucket[0][1])
        else:
            averaged.update(_bucket_mean(graph, bucket))
    return averaged


def _bucket_mean(graph: Graph, bucket: list[tuple[str, Value]]) -> dict[str, Value]:
    """One AllReduce for the gradients of `bucket` (flattened and concatenated after the last of them is
    computed); the averaged gradients split back out of it, appended to the graph's end."""
    following = _after(graph, bucket[-1][1])
    flat = [add_op(graph, "Reshape", [grad, _constant(graph, "bucket_shape", [-1])], name=graph.unique_name("bucket/flat"),
                   before=following).outputs[0] for _, grad in bucket]
    joined = add_op(graph, "Concat", flat, {"axis": 0}, name=graph.unique_name("bucket/concat"), before=following)
    reduced = replica_mean(graph, joined.outputs[0])
    sizes = [grad.type.numel for _, grad in bucket]
    parts = add_op(graph, "Split", [reduced, _constant(graph, "bucket_split", sizes)], {"axis": 0},
                   name=graph.unique_name("bucket/split"), num_outputs=len(bucket)).outputs
    return {name: add_op(graph, "Reshape", [part, _constant(graph, "grad_shape", list(grad.type.shape))],
                         name=graph.unique_name("bucket/unflat")).outputs[0]
            for (name, grad), part in zip(bucket, parts)}


def _after(graph: Graph, value: Value):
    """The node right after `value`'s producer (None: the graph's end, or a constant's)."""
    producer = value.producer
    if producer is None or producer.graph is not graph:
        return None
    nodes = graph.nodes
    position = nodes.index(producer)
    return nodes[position + 1] if position + 1 < len(nodes) else None


def _constant(graph: Graph, name: str, values: Sequence[int]) -> Value:
    return graph.add_constant(graph.unique_name(name), np.asarray(values, np.int64))


def replica_input_shapes(input_shapes: Mapping[str, Sequence[int]], replicas: int) -> dict[str, tuple[int, ...]]:
    """Each replica's input shapes: axis 0 (the batch) divided by `replicas`; CompileError when it does not divide."""
    shapes = {}
    if len({shape[0] if shape else None for shape in input_shapes.values()}) > 1:
        raise CompileError(f"data-parallel training: the inputs disagree on the batch (axis 0): "
                           f"{', '.join(f'{n}: {list(s)}' for n, s in input_shapes.items())}")
    for name, shape in input_shapes.items():
        if not shape or shape[0] % replicas:
            raise CompileError(f"data-parallel training on {replicas} workers: input '{name}' has batch "
                               f"{shape[0] if shape else 'none (a scalar)'}, not a multiple of {replicas}")
        shapes[name] = (shape[0] // replicas, *shape[1:])
    return shapes


def replica_programs(program: Program, shared: Sequence[str], workers: int) -> list[Program]:
    """One program per worker from a replica's step `program`: its inputs not in `shared` are scattered from
    rank 0 along axis 0, those in `shared` (the optimizer's scalars) sent from rank 0 to every peer; rank 0
    alone returns the outputs."""
    batched = [name for name in program.inputs if name not in shared]
    scalars = [name for name in program.inputs if name in shared]
    slices = {name: f"{name}{SLICE_SUFFIX}" for name in batched}
    body = renamed_program(program, slices)
    whole = {}
    for name in batched:
        part = TensorType.parse(program.values[name])
        whole[name] = TensorType(part.dtype, (part.shape[0] * workers, *part.shape[1:])).spec()
    programs = []
    for rank in range(workers):
        root = rank == 0
        scatters = [Scatter(f"scatter_{name}", "Scatter", output=slices[name], root=0, parts=workers,
                            tag=SCATTER_TAG + k * workers, source=name if root else None)
                    for k, name in enumerate(batched)]
        if root:
            transfers = [Send(f"send_{name}_to{peer}", "Send", tensor=name, peer=peer,
                              tag=SCALAR_TAG + k * workers + peer)
                         for k, name in enumerate(scalars) for peer in range(1, workers)]
        else:
            transfers = [Recv(f"recv_{name}_on{rank}", "Recv", output=name, peer=0, tag=SCALAR_TAG + k * workers + rank)
                         for k, name in enumerate(scalars)]
        programs.append(replace(body, instructions=scatters + transfers + body.instructions,
                                values={**body.values, **(whole if root else {})},
                                inputs=batched + scalars if root else [], outputs=body.outputs if root else [],
                                state=list(program.state)))
    return programs
