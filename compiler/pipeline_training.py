"""Pipeline-parallel training on local workers: `compile_pipeline_training` and the step runner the Trainer uses.

K = `devices` stages, one worker each, M micro-batches per step under GPipe or 1F1B
(passes/pipeline_schedule.py). The step graph is one micro-batch's (compiler/pipeline_step.py); it compiles as
for one device, and compiler/pipeline_programs.py cuts that program into the stages' programs. The host splits
each batch into micro-batches (axis 0) for rank 0 and adds the micro-batches' loss shares into the batch's loss.
Each stage holds its own parameters, optimizer slots and running statistics; `state` gathers them through rank
0 (runtime/serve.py).

BatchNormalization normalises each micro-batch with its own statistics (as GPipe does), so with
BatchNormalization a pipeline step differs from a step on the whole batch; without it, it equals one.
"""
from __future__ import annotations

import logging
import time
from typing import Mapping

import numpy as np

from tessel.ir.types import TensorType
from tessel.passes.pipeline_schedule import SCHEDULES
from tessel.runtime.errors import InputError

from .api import ModelSource, load_model, model_name, prepare_machine
from .options import CompileError, CompileOptions
from .pipeline_programs import PipelineSpec, micro_name, pipeline_programs, step_report
from .pipeline_step import build_pipeline_step

_log = logging.getLogger("tessel.compile")


def compile_pipeline_training(model, loss, optimizer, input_shapes, trainable, frozen, seed: int,
                              label_smoothing: float, micro_batches: int, schedule: str, **options):
    """compile_training with parallel="pipeline": a Trainer whose steps run on `devices` pipeline stages."""
    from .trainer import compile_step, whole_input_shapes

    options = CompileOptions.create(None, input_shapes=dict(input_shapes or {}), **options)
    stages = options.devices
    if stages < 2:
        raise CompileError("pipeline training runs on 2 or more devices (one stage each); use --devices K")
    if schedule not in SCHEDULES:
        raise CompileError(f"unknown pipeline schedule '{schedule}'; choose from {', '.join(SCHEDULES)}")
    if micro_batches < 1:
        raise CompileError(f"--micro-batches must be at least 1, not {micro_batches}")
    if options.microbatches > 1 or options.placement not in ("auto", "pipeline"):
        raise CompileError("pipeline training places its stages itself: give --micro-batches, not --microbatches "
                           "or --placement")
    prepare_machine(options)  # warns when the stages outnumber the cores
    options = CompileOptions.create(options, devices=1, placement="auto")
    machine = prepare_machine(options)
    started = time.perf_counter()
    proto, shapes = load_model(model, options)
    shapes = whole_input_shapes(proto, shapes)
    pipe = build_pipeline_step(proto, micro_input_shapes(shapes, micro_batches), shapes, loss, optimizer,
                               micro_batches, trainable=trainable, frozen=frozen, label_smoothing=label_smoothing)
    spec = PipelineSpec(stages, micro_batches, schedule, tuple(pipe.batched), pipe.grad_sums, pipe.sum_outputs,
                        pipe.step.loss_output)
    source = ModelSource(model_name(model, proto), proto, model, {}, time.perf_counter() - started)
    report = step_report(spec)
    _log.info("pipeline: %d stages, %d micro-batches, %s; predicted bubble %.1f%% of a step", stages, micro_batches,
              schedule, 100 * report["bubble_fraction_predicted"])
    return compile_step(pipe.step, source, loss, optimizer, seed, options, machine,
                        replicate=lambda program, graph: pipeline_programs(program, graph, spec),
                        plan_extra={"pipeline": report})


def micro_input_shapes(shapes: Mapping[str, tuple[int, ...]], micro_batches: int) -> dict[str, tuple[int, ...]]:
    """Each input's micro-batch shape (axis 0 divided by `micro_batches`); CompileError when it does not divide
    or the inputs disagree on the batch."""
    if len({shape[0] if shape else None for shape in shapes.values()}) > 1:
        raise CompileError(f"pipeline training: the inputs disagree on the batch (axis 0): "
                           f"{', '.join(f'{n}: {list(s)}' for n, s in shapes.items())}")
    micro = {}
    for name, shape in shapes.items():
        if not shape or shape[0] % micro_batches:
            raise CompileError(f"pipeline training with {micro_batches} micro-batches: input '{name}' has batch "
                               f"{shape[0] if shape else 'none (a scalar)'}, not a multiple of {micro_batches}")
        micro[name] = (shape[0] // micro_batches, *shape[1:])
    return micro


class PipelineRunner:
    """A pipeline step artifact run by its stages' workers (runtime/session.py): the Executor's surface the
    Trainer uses. Rank 0 takes each micro-batch's inputs; the loss is the sum of the micro-batches' shares."""

    def __init__(self, artifact):
        from tessel.runtime.batch_io import batch_input_types
        from tessel.runtime.session import InferenceSession

        pipeline = artifact.plan["pipeline"]
        self._micro_batches, self._batched = pipeline["micro_batches"], pipeline["batched"]
        self._loss = pipeline["loss"]
        self._session = InferenceSession(artifact)
        self.workers = self._session.workers
        self._types = batch_input_types(artifact.plan)
        self.input_types = {name: t for name, t in self._types.items() if "@mb" not in name}
        for name in self._batched:
            part = self._types[micro_name(name, 0)]
            self.input_types[name] = TensorType(part.dtype, (part.shape[0] * self._micro_batches, *part.shape[1:]))
        self.state_names = tuple(artifact.plan["state"]["names"])

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
        outputs = self._session.run(split)
        shares = [np.float64(outputs[micro_name(self._loss, m)]) for m in range(self._micro_batches)]
        return {self._loss: np.float32(sum(shares))}

    def state(self) -> dict[str, np.ndarray]:
        """Every stage's state."""
        return self._session.state()

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Each state value written into the stage holding it."""
        self._session.set_state(values)

    def close(self) -> None:
        """Stop the workers."""
        self._session.close()
