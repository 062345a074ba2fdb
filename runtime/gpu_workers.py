"""The GPU and the torch.distributed backend of each worker of a multi-worker artifact.

A cuda artifact's workers hold their arenas in GPU memory: worker r of a machine
uses GPU r (its local rank: LOCAL_RANK under torchrun, the rank for `tessel run`),
and the workers exchange tensors over NCCL, which reads and writes the arenas
directly. An llvm artifact's workers run on the CPU and exchange over gloo.

NCCL matches a send with a receive by their order between the two ranks, not by
tag (gloo matches tags): `transfer_order_problem` checks that every pair of
programs agrees on that order.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Mapping

from .errors import ArtifactError
from .instructions import Gather, Recv, Scatter, Send, program_from_json, walk

# The exit status of a run refused before any worker started (a user error, as for the CLI).
EXIT_NOT_ENOUGH_GPUS = 2


class NotEnoughGpus(ArtifactError):
    """A cuda artifact has more workers on this machine than the machine has GPUs."""


def on_gpu(target: str) -> bool:
    """Whether an artifact compiled for `target` runs its kernels (and keeps its arena) on a GPU."""
    return str(target).startswith("cuda")


def comm_backend(target: str) -> str:
    """The torch.distributed backend the workers of a `target` artifact exchange tensors over."""
    return "nccl" if on_gpu(target) else "gloo"


def local_rank(rank: int) -> int:
    """This worker's index on its machine: LOCAL_RANK where torchrun set it, else `rank` (one machine)."""
    return int(os.environ.get("LOCAL_RANK", str(rank)))


def visible_gpus() -> int:
    """How many CUDA GPUs this process can use (0 without a CUDA build of torch or a driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(target: str, workers: int, available: int | None = None) -> None:
    """Refuse (NotEnoughGpus) a cuda artifact whose `workers` on this machine outnumber its GPUs; nothing for
    another target. `available` overrides the count found here."""
    if not on_gpu(target) or workers <= 1:
        return
    have = visible_gpus() if available is None else available
    if have < workers:
        raise NotEnoughGpus(f"this cuda artifact runs {workers} workers, one GPU each: it needs {workers} GPUs, "
                            f"this machine has {have}")


def bind_gpu(target: str, rank: int) -> int:
    """Make this worker's GPU (its local rank) torch's current device for a cuda artifact; returns its index
    (0 for another target, whose buffers stay on the host)."""
    if not on_gpu(target):
        return 0
    import torch

    index = local_rank(rank)
    torch.cuda.set_device(index)
    return index


def transfer_order_problem(workers: list[Mapping]) -> str | None:
    """Where two workers' programs (the artifact plan's "workers") disagree on the order of the tensors one sends
    the other (sends by the sender's program order, receives by the receiver's), or None where every pair agrees."""
    sent: dict[tuple[int, int], list[int]] = defaultdict(list)
    received: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, worker in enumerate(workers):
        for instruction in walk(program_from_json(worker["instructions"])):
            if isinstance(instruction, Send):
                sent[rank, instruction.peer].append(instruction.tag)
            elif isinstance(instruction, Recv):
                received[instruction.peer, rank].append(instruction.tag)
            elif isinstance(instruction, Scatter):
                _collective_order(instruction, rank, instruction.source is not None, sent, received)
            elif isinstance(instruction, Gather):
                _collective_order(instruction, rank, instruction.output is not None, sent, received, gathers=True)
    for pair in sorted(set(sent) | set(received)):
        if sent.get(pair, []) != received.get(pair, []):
            return (f"worker {pair[0]} sends worker {pair[1]} tags {sent.get(pair, [])} but worker {pair[1]} "
                    f"receives tags {received.get(pair, [])} in that order")
    return None


def _collective_order(instruction, rank: int, is_root: bool, sent, received, gathers: bool = False) -> None:
    """A Scatter's (Gather's) point-to-point transfers: slice r goes root -> r (r -> root) with tag + r."""
    root = instruction.root
    if is_root:
        for peer in range(instruction.parts):
            if peer != root:
                (received[peer, root] if gathers else sent[root, peer]).append(instruction.tag + peer)
    elif gathers:
        sent[rank, root].append(instruction.tag + rank)
    else:
        received[root, rank].append(instruction.tag + rank)


def prepare_worker(plans: list[Mapping], rank: int, world: int) -> tuple[str, int]:
    """Before a worker joins its group: (the backend, its device index) for the artifacts it runs (their plans).
    A cuda artifact's worker checks the machine's GPUs against the workers on it (LOCAL_WORLD_SIZE, else the
    world), takes GPU `local_rank` and checks that NCCL can pair its transfers; ArtifactError otherwise."""
    targets = sorted({str(plan["target"]) for plan in plans})
    backends = {comm_backend(target) for target in targets}
    if len(backends) > 1:
        raise ArtifactError(f"artifacts for {', '.join(targets)} cannot share workers: run GPU and CPU artifacts "
                            "in separate launches")
    backend = backends.pop()
    if backend != "nccl":
        return backend, 0
    check_gpus(targets[0], int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    for plan in plans:
        problem = transfer_order_problem(plan["workers"])
        if problem is not None:
            raise ArtifactError(f"NCCL pairs transfers by their order, and {problem}; recompile the model")
    return backend, bind_gpu(targets[0], rank)
