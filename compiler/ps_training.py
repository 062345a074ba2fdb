"""Parameter-server training, the compiled half: a worker's gradient step and each server's update program.

A worker runs the training step WITHOUT the optimizer (`build_gradient_graph`): forward, loss and backward, its
outputs the loss, the gradients and the next BatchNormalization statistics. Its parameters are persistent state
that the worker overwrites with the weights it pulls before each step. The parameters are sharded over the
servers, balanced by bytes (`shard_parameters`); each server's program (`build_server_graph`) is the optimizer
update of its shard alone, made by passes/optimizer_update.py, so its arithmetic is the in-graph update's: a
server's parameters and optimizer slots are its persistent state, the averaged gradient and the optimizer's
scalars its inputs. `compile_ps` compiles both and writes the job description (runtime/ps_job.py) the
processes of compiler/ps_launch.py read.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tessel.ir import from_onnx, load_model, verify
from tessel.ir.graph import Graph
from tessel.passes.autodiff import differentiate
from tessel.passes.base import add_op
from tessel.passes.loss import LossSpec, add_loss
from tessel.passes.optimizer_update import add_updates
from tessel.passes.training_mode import prepare_eval, prepare_training

from .api import ModelSource, compile_graph, prepare_machine
from .optim import Optimizer
from .options import CompileError, CompileOptions
from .state_program import PersistentState
from .training import _loss_output, _value

# Suffix of the worker graph's output holding a parameter's gradient.
GRAD_SUFFIX = "__grad"


@dataclass
class GradientGraph:
    """A worker's step without the update: outputs loss, BN statistics' next values, then one gradient each."""

    graph: Graph
    eval_graph: Graph
    data_inputs: list[str]
    label_input: str | None
    loss_output: str
    model_outputs: list[str]
    state: dict[str, np.ndarray]        # parameters and BN running statistics
    state_updates: dict[str, str]       # BN running statistic -> its next value (parameters come from the servers)
    parameters: list[str]
    gradients: dict[str, str]           # parameter -> output holding its gradient


def build_gradient_graph(model, input_shapes: Mapping[str, Sequence[int]] | None, loss: str | LossSpec,
                         trainable: str | None = None, frozen: str | None = None,
                         label_smoothing: float = 0.0) -> GradientGraph:
    """The gradient step of an ONNX model (path, bytes or ModelProto) for `loss` on a batch of `input_shapes`."""
    spec = loss if isinstance(loss, LossSpec) else LossSpec.parse(loss, label_smoothing)
    proto = load_model(model)
    training = prepare_training(from_onnx(proto, input_shapes, training=True), trainable, frozen)
    if training.dropout_masks:
        raise CompileError("parameter-server training does not draw dropout masks yet; the model has "
                           f"{len(training.dropout_masks)} Dropout node(s)")
    eval_graph = prepare_eval(from_onnx(proto, input_shapes, training=True), list(training.state))
    graph = training.graph
    data_inputs = [v.name for v in graph.inputs if v.name not in training.state]
    added = add_loss(graph, spec, [_value(graph, name) for name in training.model_outputs])
    parameters = [_value(graph, name) for name in training.parameters]
    grads = differentiate(graph, added.loss, parameters)
    loss_value = _loss_output(graph, added.loss)
    graph.outputs = [loss_value] + [_value(graph, name) for name in training.state_updates.values()]
    gradients = {}
    for name, grad in grads.items():
        # Each gradient gets an output of its own (a constant zero gradient or a shared value gets a copy).
        output = add_op(graph, "Identity", [grad], name=graph.unique_node_name("ps/grad")).outputs[0]
        graph.rename_value(output, graph.unique_name(name + GRAD_SUFFIX))
        graph.outputs.append(output)
        gradients[name] = output.name
    verify(graph)
    return GradientGraph(graph, eval_graph, data_inputs, added.labels.name if added.labels is not None else None,
                         loss_value.name, [v.name for v in eval_graph.outputs], dict(training.state),
                         dict(training.state_updates), list(training.parameters), gradients)


def shard_parameters(sizes: Mapping[str, int], servers: int) -> list[list[str]]:
    """The parameters (name -> bytes) split over `servers` shards balanced by bytes: largest first, each to the
    lightest shard so far (ties to the lower shard); each shard lists its names in the order given. A server
    left without a parameter is a CompileError."""
    if servers < 1:
        raise CompileError(f"--servers must be at least 1, got {servers}")
    if servers > len(sizes):
        raise CompileError(f"{servers} servers for {len(sizes)} parameters: a server would hold nothing")
    loads = [0] * servers
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        shard = min(range(servers), key=lambda s: (loads[s], s))
        owner[name] = shard
        loads[shard] += sizes[name]
    return [[name for name in sizes if owner[name] == shard] for shard in range(servers)]


def build_server_graph(parameters: Mapping[str, np.ndarray], optimizer: Optimizer) -> tuple[Graph, PersistentState,
                                                                                             list[str]]:
    """One server's update program for its `parameters` (name -> initial value): the graph (inputs: each
    parameter's gradient as `<name>__grad` and the optimizer's scalars; parameters and slots persistent), its
    state, and the scalar input names."""
    from tessel.ir.types import TensorType

    graph = Graph("ps_server")
    pairs = {}
    for name, value in parameters.items():
        param = graph.add_input(name, TensorType(str(value.dtype), tuple(value.shape)))
        pairs[name] = (param, graph.add_input(name + GRAD_SUFFIX, param.type))
    updates = add_updates(graph, optimizer.rule, pairs)
    graph.outputs = list(updates.next_values.values())
    verify(graph)
    state = PersistentState({**{n: np.asarray(v) for n, v in parameters.items()}, **updates.initial_slots()},
                            {name: value.name for name, value in updates.next_values.items()})
    return graph, state, [v.name for v in updates.scalar_inputs]


def compile_ps(model, input_shapes: Mapping[str, Sequence[int]], loss: str, optimizer: Optimizer, workers: int,
               servers: int, directory: str | Path, momentum_correction: bool = False, **options) -> dict:
    """Compile the worker's gradient step (at the per-worker batch: `input_shapes` are the global batch, split
    over `workers` along axis 0), its eval graph (whole batch) and one update program per server into
    `directory` (with `momentum_correction`, the servers' update is `optimizer` without its momentum:
    compiler/ps_momentum.py); the job description's compiled part (runtime/ps_job.py) as a JSON-ready dict."""
    from .ps_momentum import server_optimizer

    from tessel.ir.onnx_import import with_batch

    from .dp_training import replica_input_shapes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    options = CompileOptions.create(None, **options)
    machine = prepare_machine(options)
    proto = load_model(model)
    shapes = replica_input_shapes(input_shapes, workers)
    replica = with_batch(proto, next(iter(shapes.values()))[0])
    step = build_gradient_graph(replica, shapes, loss)
    source = ModelSource("ps_worker", proto, model, {}, 0.0)
    compile_graph(step.graph, options, machine, source,
                  state=PersistentState(step.state, step.state_updates)).save(directory / "worker")
    whole = prepare_eval(from_onnx(proto, input_shapes, training=True), list(step.state))
    eval_names = {v.name for v in whole.inputs} & set(step.state)
    compile_graph(whole, options, machine, source,
                  state=PersistentState({n: step.state[n] for n in eval_names}, {})).save(directory / "eval")
    sizes = {name: step.state[name].nbytes for name in step.parameters}
    shards = shard_parameters(sizes, servers)
    update = server_optimizer(optimizer) if momentum_correction else optimizer
    scalars: list[str] = []
    for s, names in enumerate(shards):
        graph, state, scalars = build_server_graph({n: step.state[n] for n in names}, update)
        compile_graph(graph, options, machine, source, state=state).save(directory / f"server{s}")
    return {"data_inputs": step.data_inputs, "label_input": step.label_input, "loss_output": step.loss_output,
            "model_outputs": list(step.model_outputs), "parameters": step.parameters, "gradients": step.gradients,
            "shards": shards, "scalars": scalars, "eval_inputs": sorted(eval_names)}


def prepare_job(model, loss: str, optimizer: Optimizer, data: Mapping[str, np.ndarray], directory: str | Path, *,
                workers: int, servers: int, batch: int, steps: int, mode: str = "sync", staleness: int = 0,
                seed: int = 0, compression: str = "none", topk_ratio: float = 0.01, layout: str = "standalone",
                momentum_correction: bool | None = None, **options):
    """Compile a parameter-server job into `directory` and write its description and data: `data` holds the
    model's inputs by name and, for a loss with labels, "labels", all along axis 0; each step takes a global
    batch of `batch` rows shuffled as `tessel train` does. `momentum_correction` (compiler/ps_momentum.py; by
    default with compression and an SGD momentum) moves SGD's momentum to the workers. The job
    (runtime/ps_job.PSJob) to run with compiler/ps_launch.run_job."""
    from tessel.runtime.ps_job import DATA_FILE, PSJob

    from .ps_momentum import corrects_momentum

    PSJob.check_layout(layout, workers, servers)
    if momentum_correction is None:
        momentum_correction = compression != "none" and corrects_momentum(optimizer)
    directory = Path(directory)
    inputs = {name: (batch, *array.shape[1:]) for name, array in data.items() if name != "labels"}
    compiled = compile_ps(model, inputs, loss, optimizer, workers, servers, directory,
                          momentum_correction=momentum_correction, **options)
    initial = load_model(model)
    shapes = {init.name: list(init.dims) for init in initial.graph.initializer if init.name in compiled["parameters"]}
    job = PSJob(workers=workers, servers=servers, mode=mode, staleness=staleness, steps=steps, batch=batch, seed=seed,
                compression=compression, topk_ratio=topk_ratio, layout=layout, optimizer=optimizer.to_json(),
                shapes=shapes, momentum_correction=momentum_correction, **compiled)
    np.savez(directory / DATA_FILE, **{name: np.asarray(array) for name, array in data.items()})
    job.write(directory)
    return job


def evaluate_job(directory: str | Path, state: Mapping[str, np.ndarray], data: Mapping[str, np.ndarray],
                 batch: int) -> dict[str, np.ndarray]:
    """The model's outputs on every row of `data` (its inputs by name) with `state` (parameters and BN
    statistics), by the job's eval program (inference semantics) in chunks of `batch`."""
    from tessel.runtime.executor import Executor
    from tessel.runtime.ps_job import PSJob

    from .train_data import Dataset

    directory = Path(directory)
    job = PSJob.read(directory)
    program = Executor(directory / "eval")
    program.set_state({name: state[name] for name in program.state_names})
    inputs = {name: np.asarray(data[name]) for name in job.data_inputs}
    outputs: dict[str, list[np.ndarray]] = {name: [] for name in job.model_outputs}
    for chunk, valid in Dataset(inputs, len(next(iter(inputs.values())))).chunks(batch):
        result = program.run(chunk)
        for name in job.model_outputs:
            outputs[name].append(result[name][:valid])
    return {name: np.concatenate(parts) for name, parts in outputs.items()}
