"""Data-parallel gradients: a replica's step graph averages each gradient over the replicas before the update.

AllReduce nodes (tessel domain, run by the runtime's AllReduce instruction, in the background until the
first reader of its result, or at once where nothing is left to overlap) take the gradients in buckets:
consecutive gradients in the order backward computes them, up to a bucket size, flattened and concatenated once
the bucket's last gradient exists, and split back at the end of backward, just before the optimizer update reads
them; the loss's mean rides in the last bucket where that bucket joins several gradients. The bucket size comes
from the α-β link model: the smallest bucket whose latency is a small share of its all-reduce time.

Each bucket's all-reduce algorithm is chosen by its α-β cost (passes/collectives.py: ring, recursive halving
and doubling, gloo's own) among those the runtime executes: today gloo's own only (runtime/comm.py runs
torch.distributed's all_reduce), so ring and halving-doubling are costed and reported, not run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from tessel.ir.graph import Graph, Value
from tessel.ir.schema import TESSEL_DOMAIN

from .base import add_op
from .collectives import ALGORITHMS
from .machine import Link

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
    return round(min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, wanted)))


# The all-reduce algorithms the runtime executes (runtime/comm.py: torch.distributed's, gloo's own).
EXECUTED_ALLREDUCE = ("gloo",)
ALLREDUCE_CHOICES = ("auto", *ALGORITHMS["allreduce"])


@dataclass(frozen=True)
class AllReduceChoice:
    """One all-reduce of `nbytes` among `workers`: every algorithm's α-β seconds and the one it runs."""

    nbytes: int
    workers: int
    costs: dict[str, float]
    algorithm: str

    def describe(self) -> str:
        """One report line: the bytes, each algorithm's predicted time, the choice."""
        costs = ", ".join(f"{name} {1e3 * seconds:.3f} ms" for name, seconds in self.costs.items())
        return f"{self.nbytes / 2**20:.2f} MiB on {self.workers} workers: {costs} -> {self.algorithm}"


def choose_allreduce(link: Link, workers: int, nbytes: int, requested: str = "auto") -> AllReduceChoice:
    """Cost every all-reduce algorithm for `nbytes` on `workers` and pick one: `requested`, or with "auto" the
    cheapest the runtime executes. ValueError (one line) for an unknown algorithm or one the runtime does not run."""
    if requested not in ALLREDUCE_CHOICES:
        raise ValueError(f"unknown all-reduce algorithm '{requested}'; choose one of {', '.join(ALLREDUCE_CHOICES)}")
    if requested != "auto" and requested not in EXECUTED_ALLREDUCE:
        raise ValueError(f"all-reduce algorithm '{requested}' is costed but not executed by the runtime; "
                         f"it runs {', '.join(EXECUTED_ALLREDUCE)} (or 'auto')")
    costs = {name: fn(link, workers, nbytes) for name, fn in ALGORITHMS["allreduce"].items()}
    chosen = requested if requested != "auto" else min(EXECUTED_ALLREDUCE, key=costs.__getitem__)
    return AllReduceChoice(nbytes, workers, costs, chosen)


def allreduce_choices(graph: Graph, link: Link, workers: int, requested: str = "auto") -> list[AllReduceChoice]:
    """The algorithm of each AllReduce in `graph` (a replica's step), in graph order (the order backward issues
    them)."""
    return [choose_allreduce(link, workers, node.inputs[0].type.nbytes, requested)
            for node in graph.nodes if node.domain == TESSEL_DOMAIN and node.op_type == "AllReduce"]


@dataclass(frozen=True)
class GradientCompression:
    """How the gradients' all-reduce compresses them (runtime/ps_compression.py codecs, with error feedback)."""

    codec: str                 # "1bit" or "topk"
    topk_ratio: float = 0.01   # top-k: the share of elements sent


def replica_mean(graph: Graph, value: Value, parts: Sequence[Value] = (),
                 compression: GradientCompression | None = None) -> Value:
    """`value` averaged over the data-parallel replicas: an AllReduce node placed right after the node that
    computes it, so that its reduction starts while the rest of the backward pass still runs. With a
    `compression`, the node records it and the shapes of the `parts` flattened into `value`."""
    attrs = {}
    if compression is not None:
        attrs.update(compression=compression.codec, topk_ratio=compression.topk_ratio,
                     part_sizes=[part.type.numel for part in parts],
                     part_rows=[part.type.shape[0] if len(part.type.shape) >= 2 else 1 for part in parts])
    return _mean(graph, value, _after(graph, value), attrs)


def _mean(graph: Graph, value: Value, before, attrs: Mapping | None = None) -> Value:
    """`value` averaged over the replicas by an AllReduce node inserted before node `before` (None: at the end)."""
    node = add_op(graph, "AllReduce", [value], {"reduction": "mean", **(attrs or {})},
                  name=graph.unique_name(f"allreduce/{value.name}"), before=before, domain=TESSEL_DOMAIN)
    return node.outputs[0]


def averaged_step(graph: Graph, grads: Mapping[str, Value], loss: Value, bucket_bytes: int,
                  compression: GradientCompression | None = None) -> tuple[dict[str, Value], Value]:
    """Each gradient and the loss averaged over the replicas. The gradients go in buckets: in the order backward
    computes them, consecutive gradients up to `bucket_bytes` together are flattened into one buffer, all-reduced
    as soon as the bucket's last gradient exists, and split back at the end of backward (just before the optimizer
    update reads them); a bucket of one gradient is all-reduced as it is. Nothing reads the loss's mean before the
    step ends, so it rides in the last bucket when that bucket is a joined one anyway: one collective fewer, each a
    synchronisation of every replica. Otherwise (a last bucket of one gradient, or a `compression`: the workers
    then exchange encoded buckets, runtime/comm.py, and the loss must stay exact) the loss gets an AllReduce of its
    own, issued just before the last bucket's."""
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
    # A last bucket of one gradient is all-reduced where it lies: joining the loss to it would copy that gradient
    # into a bucket and back every step (an embedding's or a first layer's: megabytes) to save a 4-byte collective.
    rides = (compression is None and bool(buckets) and len(buckets[-1]) > 1
             and all(grad.type.dtype == loss.type.dtype for _, grad in buckets[-1]))
    averaged: dict[str, Value] = {}
    loss_mean = None
    for k, bucket in enumerate(buckets):
        riders = [loss] if rides and k == len(buckets) - 1 else []
        if len(bucket) == 1 and not riders:
            averaged[bucket[0][0]] = replica_mean(graph, bucket[0][1], [bucket[0][1]], compression)
            continue
        means, rider_means = _bucket_mean(graph, bucket, compression, riders)
        averaged.update(means)
        if riders:
            loss_mean = rider_means[0]
    if loss_mean is None:
        reduces = [node for node in graph.nodes if node.domain == TESSEL_DOMAIN and node.op_type == "AllReduce"]
        loss_mean = _mean(graph, loss, reduces[-1] if reduces else _after(graph, loss))
    return averaged, loss_mean


def _bucket_mean(graph: Graph, bucket: list[tuple[str, Value]], compression: GradientCompression | None,
                 riders: Sequence[Value] = ()) -> tuple[dict[str, Value], list[Value]]:
    """One AllReduce for the gradients of `bucket` and the `riders` (values computed before them), flattened and
    concatenated after the last gradient is computed; the averaged gradients and riders split back out of it,
    appended to the graph's end."""
    following = _after(graph, bucket[-1][1])
    parts_in = [grad for _, grad in bucket] + list(riders)
    flat = [add_op(graph, "Reshape", [value, _constant(graph, "bucket_shape", [-1])], name=graph.unique_name("bucket/flat"),
                   before=following).outputs[0] for value in parts_in]
    joined = add_op(graph, "Concat", flat, {"axis": 0}, name=graph.unique_name("bucket/concat"), before=following)
    reduced = replica_mean(graph, joined.outputs[0], parts_in, compression)
    sizes = [value.type.numel for value in parts_in]
    parts = add_op(graph, "Split", [reduced, _constant(graph, "bucket_split", sizes)], {"axis": 0},
                   name=graph.unique_name("bucket/split"), num_outputs=len(parts_in)).outputs
    means = [add_op(graph, "Reshape", [part, _constant(graph, "grad_shape", list(value.type.shape))],
                    name=graph.unique_name("bucket/unflat")).outputs[0]
             for value, part in zip(parts_in, parts)]
    return {name: mean for (name, _), mean in zip(bucket, means)}, means[len(bucket):]


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
