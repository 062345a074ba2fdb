"""Tensor exchange between workers over torch.distributed (gloo on CPU, NCCL on GPUs).

Buffers go zero-copy: a numpy array in the arena, or a view of a device arena
(runtime/device_memory.py), becomes a torch tensor through DLPack, so gloo or
NCCL reads and writes the arena directly. Sends are
asynchronous (the sender goes on computing): `send`s are waited for at the end
of each run, `start_send`s where the caller says (runtime/held_sends.py); a receive blocks until its tensor arrives or the process group's
timeout passes, and then fails naming the rank, the tensor and the peer.
Joining the group is bounded by the same timeout (`join_group`). All-reduces
of a local worker group go through shared memory instead (runtime/shared_reduce.py), where
the session gave the workers a segment: a blocking one on the calling thread, a
started one on the rank's reducer thread. So do their Sends and Recvs of the
transfers the plan lists (runtime/shared_p2p.py); gloo carries the others (a
state request's, a profile's), and every transfer of a torchrun or
multi-machine group.
"""
from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta
from typing import Callable

import numpy as np

from .errors import PeerError


def join_group(rank: int, world: int, timeout_s: float, exit_status: int = 1, backend: str = "gloo") -> None:
    """Join the process group (rendezvous at MASTER_ADDR:MASTER_PORT) within `timeout_s`, or print one
    line and leave the process with `exit_status`. `backend`: "gloo", or "nccl" for workers on GPUs
    (runtime/gpu_workers.py `comm_backend`; each worker's GPU set as torch's current device first).

    torch bounds most of the rendezvous by the group's timeout, but not everything: a client of the
    TCPStore that reaches a listener which never answers (a stopped rank 0, another program on
    MASTER_PORT) waits forever in the store's handshake. A watchdog thread bounds the whole join (torch
    waits without the GIL); it leaves with os._exit, because the stuck call cannot be interrupted.
    """
    import torch.distributed as dist

    joined = threading.Event()
    lock = threading.Lock()
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"

    def give_up() -> None:
        with lock:
            if joined.is_set():
                return
            print(f"tessel worker: rank {rank}: no rendezvous with the other {world - 1} worker(s) at {where} "
                  f"within {timeout_s:g} s (--timeout); check that rank 0 runs there and nothing else holds "
                  f"MASTER_PORT", file=sys.stderr, flush=True)
            os._exit(exit_status)

    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                store=_attempt_store(rank, world, timeout_s))
    finally:
        with lock:
            joined.set()
        watchdog.cancel()


def _attempt_store(rank: int, world: int, timeout_s: float):
    """Under torchrun, the rendezvous store with keys of this attempt only: a group that torchrun restarted
    (--max-restarts) finds the same store, and the failed attempt's addresses in it would make the new group
    connect to dead peers. None elsewhere (init_process_group makes its own store)."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)))[0]
    return dist.PrefixStore(f"tessel/attempt_{attempt}", store)


class TorchComm:
    """Send/recv and all-reduce of buffers with torch.distributed, one per worker process: numpy arrays (gloo),
    or DLPack views of device memory (NCCL for GPU memory)."""

    def __init__(self, rank: int, timeout_s: float, shared=None, channels=None):
        """`shared`: the local group's SharedReduce, which then does every all-reduce; `channels`: its
        SharedChannels, which then carry the transfers they have a ring for (gloo the rest)."""
        import torch.distributed as dist
        from torch.utils import dlpack

        self._dist, self._dlpack = dist, dlpack
        self.rank = rank
        self.timeout_s = timeout_s
        self._shared = shared
        self._channels = channels
        self._pending: list[Callable[[], None]] = []
        self._senders: dict[str, object] = {}  # compressed all-reduce: each tensor's ErrorFeedback
        self._restored: dict[str, np.ndarray] = {}  # residuals set before their all-reduce first ran

    def _tensor(self, buffer):
        """The flat torch tensor over `buffer`'s memory (no copy)."""
        if isinstance(buffer, np.ndarray):
            return self._dlpack.from_dlpack(buffer.reshape(-1))
        return self._dlpack.from_dlpack(buffer).view(-1)

    def buffers_receives(self, array: np.ndarray, peer: int, tag: int) -> bool:
        """Whether a receive of `array` from `peer` under `tag` goes through shared memory, where a message waits
        in its slot whenever it is sent: posting the receive early (runtime/early_receives.py) gains nothing."""
        return self._channels is not None and self._channels.carries(array, peer, tag, sending=False)

    def send(self, array: np.ndarray, peer: int, tag: int, name: str) -> None:
        """Start sending `array` to `peer`; it must stay untouched until `wait_sends`."""
        self._pending.append(self.start_send(array, peer, tag, name))

    def start_send(self, array: np.ndarray, peer: int, tag: int, name: str) -> Callable[[], None]:
        """Start sending `array` to `peer` and return the wait (which fails naming the tensor and the peer);
        `array` must stay untouched until then. Unlike `send`, `wait_sends` does not wait for it."""
        if self._channels is not None and self._channels.carries(array, peer, tag, sending=True):
            return self._channels.start_send(array, peer, tag, name)
        try:
            work = self._dist.isend(self._tensor(array), dst=peer, tag=tag)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: cannot send tensor '{name}' to rank {peer} ({_reason(exc)})") from None

        def wait() -> None:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerError(f"rank {self.rank}: sending tensor '{name}' to rank {peer} failed ({_reason(exc)})") from None

        return wait

    def recv(self, array: np.ndarray, peer: int, tag: int, name: str) -> None:
        """Receive into `array` from `peer`, waiting at most the timeout."""
        if self._channels is not None and self._channels.carries(array, peer, tag, sending=False):
            self._channels.recv(array, peer, tag, name)
            return
        try:
            self._dist.recv(self._tensor(array), src=peer, tag=tag)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: gave up waiting for tensor '{name}' from rank {peer} "
                                 f"after at most {self.timeout_s:.0f} s ({_reason(exc)})") from None

    def start_recv(self, array: np.ndarray, peer: int, tag: int, name: str):
        """Start receiving into `array`; returns the wait (which fails like `recv`)."""
        if self._channels is not None and self._channels.carries(array, peer, tag, sending=False):
            return self._channels.start_recv(array, peer, tag, name)
        try:
            work = self._dist.irecv(self._tensor(array), src=peer, tag=tag)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: cannot receive tensor '{name}' from rank {peer} ({_reason(exc)})") from None

        def wait() -> None:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerError(f"rank {self.rank}: gave up waiting for tensor '{name}' from rank {peer} "
                                     f"after at most {self.timeout_s:.0f} s ({_reason(exc)})") from None

        return wait

    def all_reduce(self, array: np.ndarray, reduction: str, name: str) -> None:
        """Replace `array` on every worker by the element-wise `reduction` (sum, mean, max, min) over all of them."""
        if self._shared is not None:
            self._shared.all_reduce(array, reduction, name)
            return
        op = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}[reduction]
        tensor = self._tensor(array)
        try:
            self._dist.all_reduce(tensor, op=getattr(self._dist.ReduceOp, op))
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: all-reduce of tensor '{name}' failed ({_reason(exc)})") from None
        if reduction == "mean":
            # gloo has no average: the sum, divided here.
            _divide(array, tensor, self._dist.get_world_size())

    def start_all_reduce(self, array: np.ndarray, reduction: str, name: str) -> Callable[[], None]:
        """Start `all_reduce` of `array` in the background (it must stay untouched until then); returns the wait,
        which finishes it (a mean divides there). Through shared memory it runs on the rank's reducer thread, in
        issue order (the order every rank follows)."""
        if self._shared is not None:
            return self._shared.start_all_reduce(array, reduction, name)
        op = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}[reduction]
        tensor = self._tensor(array)
        try:
            work = self._dist.all_reduce(tensor, op=getattr(self._dist.ReduceOp, op), async_op=True)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: all-reduce of tensor '{name}' failed ({_reason(exc)})") from None
        world = self._dist.get_world_size()

        def wait() -> None:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerError(f"rank {self.rank}: all-reduce of tensor '{name}' failed ({_reason(exc)})") from None
            if reduction == "mean":
                _divide(array, tensor, world)

        return wait

    def start_compressed_mean(self, array: np.ndarray, instruction, name: str) -> Callable[[], None]:
        """Start averaging `array` over the workers as the AllReduce `instruction` compresses it: every worker
        encodes its tensor plus what its earlier messages lost (error feedback, kept per tensor), the encoded
        messages are all-gathered (each the same size), and each worker decodes and averages them all. Returns
        the wait, which writes the mean into `array`."""
        import torch

        from .ps_compression import ErrorFeedback, make_codec, row_segments

        sender = self._senders.get(name)
        if sender is None:
            codec = make_codec(instruction.compression, row_segments(instruction.part_sizes, instruction.part_rows),
                               instruction.topk_ratio)
            sender = self._senders[name] = ErrorFeedback(codec, array.size)
            if name in self._restored:
                sender.residual = self._restored.pop(name)
        message = torch.from_numpy(np.ascontiguousarray(sender.encode(array.reshape(-1).astype(np.float32))))
        world = self._dist.get_world_size()
        gathered = [torch.empty_like(message) for _ in range(world)]
        try:
            work = self._dist.all_gather(gathered, message, async_op=True)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: compressed all-reduce of tensor '{name}' failed "
                            f"({_reason(exc)})") from None

        def wait() -> None:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerError(f"rank {self.rank}: compressed all-reduce of tensor '{name}' failed "
                                f"({_reason(exc)})") from None
            total = sum(sender.codec.decode(part.numpy(), array.size) for part in gathered)
            array.reshape(-1)[:] = total / np.float32(world)

        return wait

    def residuals(self) -> dict[str, np.ndarray]:
        """This worker's error-feedback residuals of the compressed all-reduces by tensor name (what its messages
        have lost so far and its next ones will carry): a training checkpoint keeps them, or a resumed run would
        drop them and train differently from an uninterrupted one."""
        return {**self._restored, **{name: sender.residual.copy() for name, sender in self._senders.items()}}

    def set_residuals(self, residuals: dict[str, np.ndarray]) -> None:
        """Overwrite this worker's residuals by tensor name (`residuals`' form); a tensor whose all-reduce has not
        run yet takes its residual when it first does."""
        for name, residual in residuals.items():
            residual = np.asarray(residual, np.float32).reshape(-1).copy()
            if name in self._senders:
                self._senders[name].residual = residual
            else:
                self._restored[name] = residual

    def doorbell(self) -> int | None:
        """The descriptor that becomes readable when a transfer through shared memory may have arrived (runtime/
        shared_p2p.py `SharedChannels.doorbell`); None without shared memory."""
        return self._channels.doorbell if self._channels is not None else None

    def exit_fds(self) -> list[int]:
        """Descriptors that become readable when a peer exits (runtime/shared_p2p.py); none without shared memory."""
        return self._channels.exit_fds() if self._channels is not None else []

    def flush_sends(self) -> None:
        """Before this worker idles: copy in the sends through shared memory still waiting for a free slot (their
        receivers free the slots without this worker; gloo's sends go on by themselves)."""
        if self._channels is not None:
            self._channels.flush()

    def wait_sends(self) -> None:
        """Wait until every send of this run has been delivered."""
        pending, self._pending = self._pending, []
        for wait in pending:
            wait()


def _divide(buffer, tensor, world: int) -> None:
    """Divide the summed `buffer` by the workers in place: numpy on the host; on a device, torch on the tensor over
    it (on the current stream, after the collective), truncating integers as numpy's unsafe cast does."""
    if isinstance(buffer, np.ndarray):
        np.divide(buffer, world, out=buffer, casting="unsafe")
    elif tensor.is_floating_point():
        tensor.div_(world)
    else:
        tensor.div_(world, rounding_mode="trunc")


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:160] if lines else type(exc).__name__
