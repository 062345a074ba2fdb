"""A parameter-server worker: pull the weights, run the compiled gradient step on its part of the batch, push
each shard's gradient to its server (runtime/ps_job.py has the messages).

Worker w takes rows [w*b, (w+1)*b) of every global batch (b = batch / workers), the batches in the order
`tessel train` draws them (compiler/train_data.Dataset.batches: shuffled per epoch by (seed, epoch)). With
compression the pushed gradient goes through the codec with error feedback, and the weights arrive as changes
to the ones the worker holds; with momentum correction (compiler/ps_momentum.py) the worker pushes its SGD
momentum instead of the gradient. At a checkpoint clock the worker writes its part before it pulls
(compiler/ps_checkpoint.py); a job with `start` resumes from its parts and skips the batches done.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from tessel.runtime.ps_compression import ErrorFeedback, make_codec
from tessel.runtime.ps_job import DATA_FILE, DONE, HEADER_BYTES, PULL, PUSH, PSJob, flatten, unflatten
from tessel.runtime.ps_wire import Wire

from .optim import optimizer_from_json
from .ps_checkpoint import finish, partial_dir, read_worker, write_worker
from .ps_momentum import WorkerMomentum


def worker_batches(job: PSJob, arrays: dict[str, np.ndarray], worker: int) -> Iterator[dict[str, np.ndarray]]:
    """Worker `worker`'s part of each of the job's global batches, epoch after epoch, `job.steps` of them."""
    from .train_data import Dataset

    dataset = Dataset(arrays, len(next(iter(arrays.values()))))
    part = job.batch // job.workers
    rows = slice(worker * part, (worker + 1) * part)
    steps, epoch = 0, 0
    while True:
        for batch in dataset.batches(job.batch, job.seed, epoch):
            if steps == job.steps:
                return
            yield {name: array[rows] for name, array in batch.items()}
            steps += 1
        epoch += 1


class Worker:
    """Rank `rank` < W of a job."""

    def __init__(self, job: PSJob, directory: Path, rank: int, wire: Wire):
        from tessel.runtime.executor import Executor

        self.job, self.rank, self.wire = job, rank, wire
        self.step = Executor(directory / "worker", threads=1)
        with np.load(directory / DATA_FILE, allow_pickle=False) as data:
            self.arrays = {name: data[name] for name in data.files}
        start = self.step.state(job.parameters)
        self.weights = [flatten(start, names) for names in job.shards]
        self.sizes = [sum(job.sizes(s)) for s in range(job.servers)]
        self.decoders = [make_codec(job.pull_codec, job.segments(s), job.topk_ratio) for s in range(job.servers)]
        self.pushers = [ErrorFeedback(make_codec(job.compression, job.segments(s), job.topk_ratio), size)
                        for s, size in enumerate(self.sizes)]
        # With momentum correction the worker keeps SGD's momentum (compiler/ps_momentum.py).
        self.momentum = WorkerMomentum(optimizer_from_json(job.optimizer), self.sizes) if job.momentum_correction \
            else None
        self.bytes_pushed = self.bytes_pulled = 0
        self.losses: list[float] = []
        self.seconds_before = 0.0  # the training seconds of the run(s) before the checkpoint resumed from
        if job.start:
            self._resume()

    def _resume(self) -> None:
        """The worker's state at the checkpoint the job starts from."""
        from .train_checkpoints import step_checkpoint_dir

        directory = step_checkpoint_dir(Path(self.job.run_dir), self.job.start)
        self.weights, residuals, momenta, statistics, report = read_worker(directory, self.rank, self.job.servers)
        for pusher, residual in zip(self.pushers, residuals):
            pusher.residual = residual
        if self.momentum is not None:
            if len(momenta) != self.job.servers:
                raise ValueError(f"checkpoint {directory} holds no momentum buffers of worker {self.rank}: it was "
                                 "written by a job without momentum correction")
            self.momentum.buffers = momenta
        self.step.set_state(statistics)
        self.losses = report["losses"]
        self.bytes_pushed, self.bytes_pulled = report["bytes_pushed"], report["bytes_pulled"]
        self.seconds_before = report["seconds"]

    def train(self) -> dict:
        """Run the job's steps; the losses, the bytes this worker sent and received, and the seconds it took."""
        import torch.distributed as dist

        dist.barrier()
        started = time.perf_counter()
        batches = itertools.islice(worker_batches(self.job, self.arrays, self.rank), self.job.start, None)
        for clock, batch in enumerate(batches, self.job.start):
            self._pull(clock, started)
            feeds = {name: batch[name] for name in self.job.data_inputs}
            if self.job.label_input is not None:
                feeds[self.job.label_input] = batch["labels"]
            outputs = self.step.run(feeds)
            self.losses.append(float(outputs[self.job.loss_output]))
            self._push(clock, outputs)
        if self.job.checkpoints_at(self.job.steps):  # the final checkpoint: its pull only meets the others'
            self._pull(self.job.steps, started)
        for shard in range(self.job.servers):
            self.wire.to_server(shard, DONE)
        return self._report(time.perf_counter() - started)

    def _report(self, seconds: float) -> dict:
        """The losses so far, the training seconds and the bytes this worker sent and received."""
        return {"losses": list(self.losses), "seconds": self.seconds_before + seconds,
                "bytes_pushed": self.bytes_pushed, "bytes_pulled": self.bytes_pulled}

    def _write_checkpoint(self, clock: int, seconds: float) -> None:
        """The worker's part of the checkpoint after `clock` steps."""
        write_worker(partial_dir(self.job.run_dir, clock), self.rank, self.weights,
                     [pusher.residual for pusher in self.pushers],
                     self.momentum.buffers if self.momentum is not None else [], self.statistics(),
                     self._report(seconds))

    def _pull(self, clock: int, started: float) -> None:
        """The weights for step `clock` from every server, into the step's state; at a checkpoint clock the
        worker writes its part first, and worker 0 completes the checkpoint once every server has answered
        (`started`: when this run's training began, for the seconds the checkpoint records)."""
        checkpoint = self.job.checkpoints_at(clock)
        if checkpoint:
            self._write_checkpoint(clock, time.perf_counter() - started)
        self._fetch(clock)
        if checkpoint and self.rank == 0:
            finish(self.job.run_dir, clock)  # every server answered: every part is written

    def _fetch(self, clock: int) -> None:
        """The weights for step `clock` from every server, into the step's state."""
        for shard in range(self.job.servers):
            self.wire.to_server(shard, PULL, clock)
            _, payload = self.wire.from_server(shard)
            if self.job.pull_codec == "none":
                self.weights[shard] = self.decoders[shard].decode(payload, self.sizes[shard]).copy()
            else:
                self.decoders[shard].decode_add(payload, self.weights[shard])
            if not self.wire.is_local(shard):  # bytes on the wire: a colocated server's cross no link
                self.bytes_pulled += 2 * HEADER_BYTES + payload.size
        for shard, names in enumerate(self.job.shards):
            self.step.set_state(unflatten(self.weights[shard], names, self.job.shapes))

    def _push(self, clock: int, outputs: dict[str, np.ndarray]) -> None:
        """Each shard's gradient (with momentum correction, the worker's momentum) to its server."""
        grads = {name: outputs[self.job.gradients[name]] for name in self.job.parameters}
        for shard, names in enumerate(self.job.shards):
            vector = flatten(grads, names)
            if self.momentum is not None:
                vector = self.momentum.step(shard, vector, self.weights[shard], first=clock == 0)
            message = self.pushers[shard].encode(vector)
            if self.momentum is not None and self.job.compression == "topk":
                self.momentum.mask(shard, self.pushers[shard].codec.sent(message))
            self.wire.to_server(shard, PUSH, clock, message)
            if not self.wire.is_local(shard):
                self.bytes_pushed += HEADER_BYTES + message.size

    def parameters(self) -> dict[str, np.ndarray]:
        """The weights this worker holds, by parameter name."""
        return {name: array for shard, names in enumerate(self.job.shards)
                for name, array in unflatten(self.weights[shard], names, self.job.shapes).items()}

    def statistics(self) -> dict[str, np.ndarray]:
        """The worker's state other than the parameters: its BatchNormalization running statistics."""
        parameters = set(self.job.parameters)
        return self.step.state([name for name in self.step.state_names if name not in parameters])
