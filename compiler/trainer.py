"""Training: one compiled step (forward, loss, backward, update) run again and again on persistent state.

With `devices` = N > 1 the step runs data-parallel (compiler/dp_training.py) on N local workers kept up by
the persistent worker group (runtime/session.py): each worker holds the state, rank 0 scatters each batch,
the state is read from rank 0 and written into every worker. With parallel="pipeline" the N workers are
pipeline stages, each holding its own part of the state (compiler/pipeline_training.py).

`compile_training` builds the step graph (compiler/training.py) and compiles it and its eval graph through the
same stages as inference (compiler/api.compile_graph). The `Trainer` runs them: `step` feeds a batch, its
labels, the optimizer's scalars for that step and the dropout masks; `evaluate` runs the eval artifact on a copy
of the current state; `save` and `load_training` write and read checkpoints (compiler/checkpoint.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import numpy as np

from tessel.backends.target import parse_target
from tessel.ir import from_onnx
from tessel.ir import load_model as read_model
from tessel.ir.onnx_import import with_batch
from tessel.ir.types import TensorType
from tessel.passes.base import Pass
from tessel.passes.data_parallel import GradientCompression, bucket_bytes_for
from tessel.passes.loss import LossSpec
from tessel.passes.memory_plan import CUDA_ALIGNMENT, DEFAULT_ALIGNMENT
from tessel.passes.training_mode import prepare_eval
from tessel.runtime.errors import ArtifactError, InputError
from tessel.runtime.executor import Executor
from tessel.runtime.shared_reduce_link import allreduce_link

from .api import ModelSource, compile_graph, load_model, model_name, prepare_machine, whole_input_shapes
from .artifact import Artifact
from .checkpoint import Checkpoint, StepNames, read_checkpoint, write_checkpoint
from .optim import Optimizer
from .pipeline_training import prepare_pipeline_training
from .worker_step import PipelineRunner, WorkerStep
from .dp_training import (allreduce_plan, compressed_bytes, replica_input_shapes, replica_programs,
                          write_allreduce_report)
from .options import CompileError, CompileOptions
from .recompute import cheap_recompute_pass, place_recompute, recompute_pass
from .state_program import PersistentState
from .step_kernels import timing_data
from .step_timeline import REPLICA_LOSS
from .training import StepGraph, build_step_graph
from .worker_programs import MachineShape

_log = logging.getLogger("tessel.compile")
# Steps timed for the host's share of a step (Trainer.host_s), after HOST_WARMUP_STEPS untimed ones: the first
# steps after the workers slept (while kernels were timed elsewhere, say) find them and the caches cold.
HOST_STEPS, HOST_WARMUP_STEPS = 5, 3


class Trainer:
    """Runs a compiled training step on persistent state; `steps_done` steps so far."""

    def __init__(self, step_artifact: Artifact, eval_artifact: Artifact, names: StepNames, optimizer: Optimizer,
                 seed: int, model_bytes: bytes, steps_done: int = 0, state: Mapping[str, np.ndarray] | None = None,
                 residuals: Mapping[str, np.ndarray] | None = None):
        """Load both artifacts' executors; `state` (by default the step artifact's starting state) and the
        data-parallel workers' error-feedback `residuals` (compressed gradients) are set in."""
        self.step_artifact, self.eval_artifact = step_artifact, eval_artifact
        self.names, self.optimizer, self.seed = names, optimizer, seed
        self.steps_done = steps_done
        self.model_bytes = model_bytes  # the ONNX model as given: export_onnx writes the trained values into it
        self._step = _step_runner(step_artifact)
        self._eval = Executor(eval_artifact.directory)
        if state is not None:
            self._step.set_state(state)
        if residuals:
            self._step.set_residuals(residuals)
        # Looked up once: the step reads them for every batch (widening, masks, scalars).
        types = self._step_types = self._step.input_types
        self._eval_types = self._eval.input_types
        self._masks = [(name, ratio, types[name]) for name, ratio in sorted(names.dropout_masks.items())]
        self._scalar_dtype = next((types[name].dtype for name in optimizer.rule.scalars if name in types), "float32")

    @property
    def state(self) -> dict[str, np.ndarray]:
        """Copies of the current state by name: parameters, optimizer slots, running statistics (rank 0's with
        data-parallel workers)."""
        return self._step.state()

    @property
    def residuals(self) -> dict[str, np.ndarray]:
        """Each data-parallel worker's error-feedback residuals of its compressed gradients, "RANK/TENSOR" ->
        residual (none without compression, or on one worker): part of a checkpoint, since the next steps'
        messages carry them."""
        return self._step.residuals() if hasattr(self._step, "residuals") else {}

    @property
    def workers(self) -> int:
        """How many data-parallel workers run each step."""
        return getattr(self._step, "workers", 1)

    @property
    def step_profile(self) -> dict | None:
        """The last step's spans per worker when the workers profile their steps (TESSEL_STEP_PROFILE=1 when they
        started; runtime/step_profile.py), else None (and always on one worker)."""
        return getattr(self._step, "last_profile", None)

    def host_s(self, steps: int = HOST_STEPS) -> float:
        """Median seconds of a step spent outside the workers' programs: its feeds made, the batch's slices on
        their way into the workers, rank 0's answer back (a step's time less rank 0's time on it). Measured on
        `steps` (at least 1) steps of a batch of timing data (step_kernels.timing_data: integers zero) after
        HOST_WARMUP_STEPS untimed ones, as a training loop runs them, each right after the last (the caches as the
        workers' kernels left them); the state, the error-feedback residuals and the step count are restored
        after, so training goes on as if they had not run. 0 on one worker, which runs in this process."""
        if steps < 1:
            raise ValueError(f"host_s needs at least 1 timed step, got {steps}")
        if not hasattr(self._step, "last_worker_s"):
            return 0.0
        types, rng, label = self._step_types, np.random.default_rng(0), self.names.label_input
        inputs = {name: timing_data(types[name], rng) for name in self.names.data_inputs}
        labels = timing_data(types[label], rng) if label is not None else None
        state, residuals, done = self.state, self.residuals, self.steps_done
        seconds, finished = [], False
        try:
            for _ in range(HOST_WARMUP_STEPS + steps):
                started = time.perf_counter()
                self.step(inputs, labels)
                seconds.append(time.perf_counter() - started - self._step.last_worker_s)
            finished = True
        finally:
            try:
                self._restore(state, residuals, done)
            except Exception:
                if finished:  # else the step's own error says what went wrong, not the restore's after it
                    raise
        return float(np.median(seconds[HOST_WARMUP_STEPS:]))

    def _restore(self, state: Mapping[str, np.ndarray], residuals: Mapping[str, np.ndarray], done: int) -> None:
        """Put back the state, the residuals (those made since start from zero, as on a fresh trainer) and the
        step count that `state`, `residuals` and `steps_done` gave."""
        self._step.set_state(state)
        made = self.residuals
        if made or residuals:
            self._step.set_residuals({**{key: np.zeros_like(r) for key, r in made.items()}, **residuals})
        self.steps_done = done

    def close(self) -> None:
        """Stop the data-parallel workers (a Trainer on one worker has none); the Trainer cannot step after."""
        if hasattr(self._step, "close"):
            self._step.close()

    def step(self, inputs: Mapping[str, np.ndarray], labels: np.ndarray | None = None) -> float:
        """Run one training step on a batch (`inputs` by the model's input names) and its labels; the loss."""
        feeds = dict(self._data(inputs, self._step_types))
        if self.names.label_input is not None:
            if labels is None:
                raise InputError("this loss needs labels: step(inputs, labels)")
            feeds[self.names.label_input] = _widened(labels, self._step_types[self.names.label_input])
        elif labels is not None:
            raise InputError("the model's own output is the loss: step(inputs) takes no labels")
        feeds.update(self.optimizer.step_scalars(self.steps_done, self._scalar_dtype))
        feeds.update(self.dropout_masks(self.steps_done))
        loss = float(self._step.run(feeds, copy=False)[self.names.loss_output])
        self.steps_done += 1
        return loss

    def dropout_masks(self, step: int) -> dict[str, np.ndarray]:
        """The dropout masks of step `step`: keep with probability 1 - p, scaled by 1 / (1 - p), drawn from
        numpy's Generator seeded by (seed, step), so a resumed run draws the same masks; each in its input's type
        (float64 in a step compiled in float64)."""
        if not self._masks:
            return {}
        rng = np.random.default_rng([self.seed, step])
        masks = {}
        for name, ratio, mask_type in self._masks:
            dtype = np.dtype(mask_type.dtype)
            masks[name] = (rng.random(mask_type.shape, dtype=np.float32) >= ratio).astype(dtype) / dtype.type(1 - ratio)
        return masks

    def evaluate(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs on `inputs` with the current state (inference semantics: running statistics for
        BatchNormalization, no dropout)."""
        state = self._step.state()
        self._eval.set_state({name: state[name] for name in self._eval.state_names})
        outputs = self._eval.run(dict(self._data(inputs, self._eval_types)))
        return {name: outputs[name] for name in self.names.model_outputs}

    def _data(self, inputs: Mapping[str, np.ndarray], types: Mapping[str, TensorType]) -> Mapping[str, np.ndarray]:
        """The model's inputs, checked by name first (the runner checks their `types`, the runner's input types),
        float ones widened to the compiled type where that is exact (`_widened`)."""
        want = self.names.data_inputs
        missing, extra = [n for n in want if n not in inputs], [n for n in inputs if n not in want]
        if missing or extra:
            problems = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + \
                       ([f"unknown {', '.join(map(repr, extra))}"] if extra else [])
            takes = ", ".join(f"{n}: {types[n].spec()}" for n in want)
            raise InputError(f"inputs do not match the model ({'; '.join(problems)}); it takes {takes}")
        return {name: _widened(value, types[name]) for name, value in inputs.items()}

    def save(self, directory: str | Path, force: bool = False) -> Path:
        """Write a checkpoint to `directory` (compiler/checkpoint.py); an existing non-empty one is refused unless
        `force`, which replaces only a checkpoint."""
        checkpoint = Checkpoint(self.step_artifact, self.eval_artifact, self.names, self.optimizer, self.seed,
                                self.steps_done, self.state, self.model_bytes, self.residuals)
        return write_checkpoint(checkpoint, directory, force)

    def export_onnx(self, path: str | Path) -> Path:
        """Write the model as given with its trained values (`export_state`)."""
        return export_state(self.model_bytes, self.state, self.names.parameters, path)


def _widened(value, want) -> np.ndarray:
    """`value` in float64 when `want` (a TensorType) is float64 and `value` a narrower float, which converts exactly
    (float32 data for a step compiled with precision "fp64"); anything else as given, for the runner to check."""
    if isinstance(value, np.ndarray) and want.dtype == "float64" and value.dtype.kind == "f" \
            and value.dtype.itemsize < 8:
        return value.astype(np.float64)
    return value


def export_state(model_bytes: bytes, state: Mapping[str, np.ndarray], parameters, path: str | Path) -> Path:
    """Write the ONNX model `model_bytes` with trained values: every initializer named like a state value
    (parameters, BatchNormalization running statistics) takes that value, in the initializer's type."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load_from_string(model_bytes)
    _unalias_initializers(model, state)
    found = set()
    for initializer in model.graph.initializer:
        if initializer.name in state:
            dtype = numpy_helper.to_array(initializer).dtype
            initializer.CopyFrom(numpy_helper.from_array(state[initializer.name].astype(dtype), initializer.name))
            found.add(initializer.name)
    lost = [name for name in parameters if name not in found]
    if lost:
        raise ArtifactError(f"parameter '{lost[0]}' is not an initializer of the model; cannot export it")
    onnx.save(model, str(path))
    return Path(path)


def _unalias_initializers(model, state: Mapping[str, np.ndarray]) -> None:
    """Give each state value that the model reads through Identity(initializer) an initializer of its own.

    PyTorch's exporter stores equal tensors once: a fresh BatchNorm's running_var (ones) becomes
    Identity(its weight). Training separates them (the running statistic is its own state value), so the export
    must too, else the statistic would be written back nowhere and read from the weight.
    """
    from onnx import numpy_helper

    initializers = {i.name: i for i in model.graph.initializer}
    for node in list(model.graph.node):
        if node.op_type == "Identity" and node.input[0] in initializers and node.output[0] in state \
                and node.output[0] not in initializers:
            model.graph.node.remove(node)
            model.graph.initializer.append(numpy_helper.from_array(
                numpy_helper.to_array(initializers[node.input[0]]).copy(), node.output[0]))


def compile_training(model, loss: str | LossSpec, optimizer: Optimizer,
                     input_shapes: Mapping[str, tuple[int, ...]] | None = None, trainable: str | None = None,
                     frozen: str | None = None, seed: int = 0, label_smoothing: float = 0.0,
                     bucket_bytes: int | None = None, allreduce: str = "auto", parallel: str = "data",
                     micro_batches: int = 1, schedule: str = "gpipe", sync_batchnorm: bool = False,
                     compression: str = "none", topk_ratio: float = 0.01, auto_ps: bool = False, **options) -> Trainer:
    """Compile an ONNX model (path, bytes or ModelProto) into a Trainer: one compiled graph per step.

    `loss`: "cross_entropy" (with `label_smoothing`), "mse", "l1", "bce_with_logits", "output:K" (the
    model's output K is the loss), or a passes.loss.LossSpec; `optimizer`: a `tessel.optim` optimizer;
    `trainable` / `frozen`: regexes on initializer names; `seed` seeds the dropout masks; the other keywords
    are compile options (compiler/options.py). `devices` = N > 1 trains data-parallel on N local workers
    (compiler/dp_training.py), the gradients all-reduced in buckets of `bucket_bytes` (default: from the
    link's α-β model), each by the `allreduce` algorithm ("auto": the cheapest the runtime executes;
    passes/data_parallel.py), reported in the step artifact's reports/data_parallel.md; `sync_batchnorm` then
    normalises BatchNormalization with the whole batch's statistics (as torch.nn.SyncBatchNorm) instead of each
    worker's slice's; `compression` "1bit" or "topk" (`topk_ratio`) exchanges the gradients encoded, with error
    feedback, instead of all-reducing float32 (bytes per step in the same report). `parallel` = "pipeline"
    trains on `devices` pipeline stages instead, each step's batch in `micro_batches` micro-batches under
    `schedule` "gpipe" or "1f1b" (compiler/pipeline_training.py); "auto"
    trains the way with the best predicted step time (compiler/parallel_auto.py), with `auto_ps` the parameter
    server among them (which no Trainer runs: parallel_auto.ParameterServerChosen is raised when it is best).
    """
    if compression != "none" and parallel != "data":
        raise CompileError(f"gradient compression goes with data-parallel training, not {parallel}")
    if compression != "none" and options.get("precision") == "fp64":
        raise CompileError("gradient compression exchanges float32; it does not go with precision fp64")
    if parallel == "auto":
        from .parallel_auto import compile_auto

        auto_ps = auto_ps and options.get("precision", "fp32") == "fp32"  # parameter servers exchange float32
        training = dict(loss=loss, optimizer=optimizer, input_shapes=input_shapes, trainable=trainable, frozen=frozen,
                        seed=seed, label_smoothing=label_smoothing, bucket_bytes=bucket_bytes)
        return compile_auto(compile_training, model, training, options, micro_batches, allreduce, sync_batchnorm,
                            auto_ps)
    if parallel == "pipeline":
        if sync_batchnorm:
            raise CompileError("sync_batchnorm goes with data-parallel training: pipeline stages normalise per "
                               "micro-batch")
        pipe = prepare_pipeline_training(model, loss, optimizer, input_shapes, trainable, frozen, label_smoothing,
                                         micro_batches, schedule, **options)
        return compile_step(pipe.step, pipe.source, loss, optimizer, seed, pipe.options, pipe.machine,
                            replicate=pipe.replicate, plan_extra=pipe.plan_extra)
    if parallel != "data":
        raise CompileError(f"unknown parallel training '{parallel}'; choose data, pipeline or auto")
    options = CompileOptions.create(None, input_shapes=dict(input_shapes or {}), **options)
    replicas = data_parallel_workers(options)
    if compression != "none" and replicas == 1:
        raise CompileError("gradient compression needs data-parallel training on 2 or more devices")
    if sync_batchnorm and replicas == 1:
        _log.warning("sync_batchnorm ignored: one device already normalises with the whole batch's statistics")
    if replicas > 1:
        options = CompileOptions.create(options, devices=1, placement="auto")
    machine = prepare_machine(options)
    started = time.perf_counter()
    proto, shapes = load_model(model, options)
    if replicas > 1:
        shapes = whole_input_shapes(proto, shapes)
        replica_shapes = replica_input_shapes(shapes, replicas)
        replica_model = with_batch(proto, next(iter(replica_shapes.values()))[0])
        # Buckets sized by the all-reduce the local group will run (shared memory, once calibrated; else gloo's link).
        buckets = bucket_bytes or bucket_bytes_for(allreduce_link(machine.link, replicas))
        step_graph = build_step_graph(replica_model, replica_shapes, loss, optimizer,
                                      trainable=trainable, frozen=frozen, label_smoothing=label_smoothing,
                                      replicas=replicas, bucket_bytes=buckets,
                                      sync_batchnorm=sync_batchnorm,
                                      compression=None if compression == "none" else
                                      GradientCompression(compression, topk_ratio))
        step_graph = replace(step_graph, eval_graph=prepare_eval(from_onnx(proto, shapes, training=True),
                                                                 list(step_graph.state)))
    else:
        step_graph = build_step_graph(proto, shapes, loss, optimizer, trainable=trainable, frozen=frozen,
                                      label_smoothing=label_smoothing)
    source = ModelSource(model_name(model, proto), proto, model, {}, time.perf_counter() - started)
    if replicas == 1:
        return compile_step(step_graph, source, loss, optimizer, seed, options, machine, replicas)
    choices = allreduce_plan(step_graph.graph, machine.link, replicas, allreduce)
    compressed = compressed_bytes(step_graph.graph, replicas)  # before the compile rewrites the graph
    trainer = compile_step(step_graph, source, loss, optimizer, seed, options, machine, replicas)
    write_allreduce_report(trainer.step_artifact.directory, choices, machine.link, compressed)
    return trainer


def compile_step(step_graph: StepGraph, source: ModelSource, loss: str | LossSpec, optimizer: Optimizer,
                 seed: int, options: CompileOptions, machine: MachineShape | None = None,
                 replicas: int = 1, replicate=None, plan_extra: Mapping | None = None) -> Trainer:
    """Compile a StepGraph's step graph and eval graph (`source`: the model they came from); their Trainer.
    `replicas` > 1: the step graph is one data-parallel replica's (compiler/dp_training.py), run by that many
    workers; else `replicate` (compile_graph's) may make the workers' programs, `plan_extra` saying how to run them."""
    machine = machine or prepare_machine(options)
    state = PersistentState(step_graph.state, step_graph.state_updates)
    if replicas > 1:
        shared = step_graph.scalar_inputs
        replicate = lambda program, graph: replica_programs(program, shared, replicas)  # noqa: E731
        plan_extra = {**(plan_extra or {}), REPLICA_LOSS: step_graph.forward_loss}
    step = compile_graph(step_graph.graph, options, machine, source, state=state,
                         passes=_step_passes(options, step_graph), replicate=replicate, plan_extra=plan_extra)
    eval_names = {v.name for v in step_graph.eval_graph.inputs} & set(step_graph.state)
    eval_state = PersistentState({n: step_graph.state[n] for n in eval_names}, {})
    evaluation = compile_graph(step_graph.eval_graph, options, machine,
                               ModelSource(source.name, source.model, source.origin, {}, 0.0), state=eval_state)
    # The model as given (not re-batched, not promoted to float64) where it is known: export_onnx writes the trained
    # values into it.
    given = source.model if source.origin is None else read_model(source.origin)
    return Trainer(step, evaluation, StepNames.of(step_graph, loss), optimizer, seed, given.SerializeToString())


def data_parallel_workers(options: CompileOptions) -> int:
    """The data-parallel workers a training compile asks for (`devices`); CompileError for any other placement."""
    if options.devices > 1 and options.placement not in ("auto", "data"):
        raise CompileError(f"training on {options.devices} devices runs data-parallel only (placement 'data'), "
                           f"not '{options.placement}'")
    if options.devices > 1 and options.microbatches > 1:
        raise CompileError("data-parallel training runs without micro-batches")
    return options.devices


def _step_runner(artifact: Artifact):
    """What runs the steps: an Executor here for one worker, the persistent worker group for several (the
    torchrun ranks when this process is one, runtime/rank_group.py)."""
    from tessel.runtime import rank_group

    if artifact.devices == 1:
        return Executor(artifact.directory)
    if "pipeline" in artifact.plan:
        return PipelineRunner(artifact)
    return rank_group.RankStep(artifact) if rank_group.attached() else WorkerStep(artifact)


def _step_passes(options: CompileOptions, step_graph: StepGraph) -> tuple[Pass, ...]:
    """The step's pipeline: activations that cheap ops make again from kept values are recomputed, and with
    `device_memory` more of them where the step would not fit (compiler/recompute.py)."""
    alignment = CUDA_ALIGNMENT if parse_target(options.target).kind == "cuda" else DEFAULT_ALIGNMENT
    passes = options.passes
    if options.device_memory is not None:
        passes = place_recompute(passes, recompute_pass(options.device_memory, persistent=step_graph.state,
                                                        loss=step_graph.forward_loss, alignment=alignment))
    return place_recompute(passes, cheap_recompute_pass(persistent=step_graph.state, loss=step_graph.forward_loss,
                                                        alignment=alignment))


def load_training(directory: str | Path) -> Trainer:
    """Resume from a checkpoint `Trainer.save` wrote: its files are checked before any kernel is loaded."""
    checkpoint = read_checkpoint(directory)
    return Trainer(checkpoint.step_artifact, checkpoint.eval_artifact, checkpoint.names, checkpoint.optimizer,
                   checkpoint.seed, checkpoint.model_bytes, checkpoint.steps_done, checkpoint.state,
                   checkpoint.residuals)
