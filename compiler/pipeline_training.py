"""Pipeline-parallel training on local workers: `prepare_pipeline_training`, the step graph and stage cut that
compiler/trainer.py compiles (its step runner is compiler/worker_step.py `PipelineRunner`).

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
from dataclasses import dataclass
from typing import Callable, Mapping

from tessel.passes.pipeline_schedule import SCHEDULES

from .api import ModelSource, divided_batch_shapes, load_model, model_name, prepare_machine, whole_input_shapes
from .options import CompileError, CompileOptions
from .pipeline_programs import PipelineSpec, pipeline_programs, step_report
from .pipeline_step import build_pipeline_step
from .training import StepGraph
from .worker_programs import MachineShape

_log = logging.getLogger("tessel.compile")


@dataclass(frozen=True)
class PipelineCompile:
    """What compile_training (compiler/trainer.py `compile_step`) compiles a pipeline's step from: one
    micro-batch's step graph, its model, the options and machine of one stage, and how to cut it into stages."""

    step: StepGraph
    source: ModelSource
    options: CompileOptions
    machine: MachineShape
    replicate: Callable
    plan_extra: dict


def prepare_pipeline_training(model, loss, optimizer, input_shapes, trainable, frozen, label_smoothing: float,
                              micro_batches: int, schedule: str, **options) -> PipelineCompile:
    """compile_training with parallel="pipeline", up to its step graph: steps that run on `devices` stages."""

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

    def stage_programs(program, graph):
        programs, report["phases"] = pipeline_programs(program, graph, spec)
        return programs

    return PipelineCompile(pipe.step, source, options, machine, stage_programs, {"pipeline": report})


def micro_input_shapes(shapes: Mapping[str, tuple[int, ...]], micro_batches: int) -> dict[str, tuple[int, ...]]:
    """Each input's micro-batch shape (axis 0 divided by `micro_batches`); CompileError when it does not divide
    or the inputs disagree on the batch."""
    return divided_batch_shapes(shapes, micro_batches, "pipeline training", f"with {micro_batches} micro-batches")
