"""A multi-worker step artifact run by its persistent workers (runtime/session.py), behind the Executor's surface
that the Trainer uses: `run`, `state`, `set_state`, `close`, `workers`, `input_types`, `state_names`. A
data-parallel step's workers each take a slice of the batch; a pipeline's stages take micro-batches
(compiler/pipeline_training.py)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from tessel.ir.types import TensorType
from tessel.runtime.errors import InputError

from .pipeline_programs import micro_name


class WorkerStep:
    """A data-parallel step artifact: the workers keep the state; each takes its slice of the batch, rank 0 returns
    the loss. Subclasses (a pipeline's stages, compiler/pipeline_training.py) change how a batch is fed."""

    def __init__(self, artifact):
        from tessel.runtime.batch_io import batch_input_types
        from tessel.runtime.session import InferenceSession

        self._session = InferenceSession(artifact)
        self.workers = self._session.workers
        self.input_types = batch_input_types(artifact.plan)
        self.state_names = tuple(artifact.plan["state"]["names"])
        # The last step's spans per rank when the workers profile (runtime/step_profile.py), else None.
        self.last_profile: dict | None = None
        # Seconds rank 0 spent on the last step, from taking the request to its answer.
        self.last_worker_s: float | None = None

    def run(self, feeds: Mapping[str, np.ndarray], copy: bool = False) -> dict[str, np.ndarray]:
        """One step on the workers; rank 0's outputs. The optimizer's one-element scalars take the scalar shape
        the plan gives them (the session checks shapes exactly)."""
        types = self.input_types
        return self._request({name: np.ascontiguousarray(a).reshape(types[name].shape)
                              if name in types and types[name].rank == 0 and np.size(a) == 1 else a
                              for name, a in feeds.items()})

    def _request(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The workers' outputs of one request; its profile kept in `last_profile`."""
        request = self._session.run_async(feeds)
        outputs = request.result()
        self.last_profile, self.last_worker_s = request.profile, request.worker_seconds
        return outputs

    def state(self) -> dict[str, np.ndarray]:
        """The state, through rank 0 (a pipeline's stages send it theirs)."""
        return self._session.state()

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """State values by name, written into every worker holding them."""
        self._session.set_state(values)

    def residuals(self) -> dict[str, np.ndarray]:
        """Every worker's error-feedback residuals of compressed gradients, "RANK/TENSOR" -> residual."""
        return self._session.residuals()

    def set_residuals(self, residuals: Mapping[str, np.ndarray]) -> None:
        """Overwrite the workers' residuals from what `residuals` returned."""
        per_worker: list[dict[str, np.ndarray]] = [{} for _ in range(self.workers)]
        for key, residual in residuals.items():
            rank, _, name = key.partition("/")
            per_worker[int(rank)][name] = residual
        self._session.set_residuals(per_worker)

    def close(self) -> None:
        """Stop the workers."""
        self._session.close()


class PipelineRunner(WorkerStep):
    """A pipeline step artifact run by its stages' workers (runtime/session.py): the Executor's surface the
    Trainer uses. Rank 0 takes each micro-batch's inputs; the loss is the sum of the micro-batches' shares."""

    def __init__(self, artifact):
        super().__init__(artifact)
        pipeline = artifact.plan["pipeline"]
        self._micro_batches, self._batched = pipeline["micro_batches"], pipeline["batched"]
        self._loss = pipeline["loss"]
        self._types = self.input_types
        self.input_types = {name: t for name, t in self._types.items() if "@mb" not in name}
        for name in self._batched:
            part = self._types[micro_name(name, 0)]
            self.input_types[name] = TensorType(part.dtype, (part.shape[0] * self._micro_batches, *part.shape[1:]))

    def run(self, feeds: Mapping[str, np.ndarray], copy: bool = False) -> dict[str, np.ndarray]:
        """One step on the stages: the batched inputs split into micro-batches; the batch's loss."""
        split = {}
        for name, array in feeds.items():
            if name in self._batched:
                array = np.asarray(array)
                if array.shape != self.input_types[name].shape:
                    raise InputError(f"input '{name}' is {list(array.shape)}, the pipeline takes "
                                     f"{list(self.input_types[name].shape)} ({self._micro_batches} micro-batches)")
                parts = np.split(array, self._micro_batches)
                split.update({micro_name(name, m): np.ascontiguousarray(part) for m, part in enumerate(parts)})
            else:
                t = self._types.get(name)
                scalar = t is not None and t.rank == 0 and np.size(array) == 1
                split[name] = np.ascontiguousarray(array).reshape(t.shape) if scalar else array
        outputs = self._request(split)
        shares = [np.float64(outputs[micro_name(self._loss, m)]) for m in range(self._micro_batches)]
        return {self._loss: np.float32(sum(shares))}
