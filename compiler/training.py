"""The training step as one graph: forward, loss, backward and optimizer update (`build_step_graph`).

The model is imported for training (tessel.ir.from_onnx with training=True), given
training semantics (passes/training_mode.py: parameters and BN running statistics
become persistent inputs), a loss (passes/loss.py), its backward pass
(passes/autodiff.py) and the optimizer's update of every parameter
(passes/optimizer_update.py). The result names what the runtime must feed per step
(data, labels, the optimizer's scalars, dropout masks), what persists between steps
(`state`) and which output holds each persistent input's next value
(`state_updates`). A second import of the model with inference semantics reading the
same persistent inputs is the eval graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from tessel.ir import from_onnx, load_model, verify
from tessel.ir.graph import Graph, Value
from tessel.passes.autodiff import differentiate
from tessel.passes.loss import LossSpec, add_loss
from tessel.passes.optimizer_update import add_updates
from tessel.passes.data_parallel import DEFAULT_BUCKET_BYTES, GradientCompression, averaged_step
from tessel.passes.layout import shape_view_source
from tessel.passes.training_mode import TrainingModel, prepare_eval, prepare_training

if TYPE_CHECKING:
    from .optim import Optimizer

LOSS_OUTPUT = "loss"
# Suffix of the graph output holding a persistent input's next value (as passes/training_mode.py names BN's).
NEXT_SUFFIX = "__next"


@dataclass
class StepGraph:
    """One training step as a graph, and what the runtime feeds, keeps and updates around it."""

    graph: Graph                       # forward, loss, backward, update (one graph)
    eval_graph: Graph                  # forward only, inference semantics, same persistent inputs it needs
    data_inputs: list[str]             # model inputs fed per step (and per evaluate)
    label_input: str | None            # "labels" unless the loss is a model output
    loss_output: str                   # scalar float32 output of `graph`
    model_outputs: list[str]           # outputs of eval_graph
    state: dict[str, np.ndarray]       # initial values: params, optimizer slots, BN running stats
    state_updates: dict[str, str]      # persistent input -> output of `graph` with its next value
    parameters: list[str]
    scalar_inputs: list[str]           # fed each step from optimizer.step_scalars(step)
    dropout_masks: dict[str, float]
    # The replica's own loss, before any averaging over replicas: where the forward pass ends (recompute, step
    # phases). None: the loss output is that value.
    replica_loss: str | None = None

    @property
    def forward_loss(self) -> str:
        """The value that ends the forward pass: the replica's own loss."""
        return self.replica_loss or self.loss_output


def build_step_graph(model, input_shapes: Mapping[str, Sequence[int]] | None, loss: str | LossSpec,
                     optimizer: "Optimizer", trainable: str | None = None, frozen: str | None = None,
                     label_smoothing: float = 0.0, replicas: int = 1,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, sync_batchnorm: bool = False,
                     compression: GradientCompression | None = None) -> StepGraph:
    """The training step of an ONNX model (path, bytes or ModelProto) for `loss` and `optimizer`.

    `loss` is a loss kind ("cross_entropy", "mse", "l1", "bce_with_logits"), "output:K" or the name of the
    model output that is the loss, or a LossSpec; `trainable`/`frozen` are regexes on initializer names.
    `replicas` > 1: one data-parallel replica's step (`input_shapes` are its slice of the batch): every
    gradient and the loss are averaged over the replicas (AllReduce nodes, gradients in buckets of about
    `bucket_bytes`: passes/data_parallel.py) before the update; `sync_batchnorm`: BatchNormalization
    normalises with the statistics of all the replicas' slices (passes/training_mode.py), not its own slice's;
    `compression`: the gradients are exchanged encoded, with error feedback (passes/data_parallel.py).
    """
    spec = loss if isinstance(loss, LossSpec) else LossSpec.parse(loss, label_smoothing)
    proto = load_model(model)
    training = prepare_training(from_onnx(proto, input_shapes, training=True), trainable, frozen,
                                sync_replicas=replicas if sync_batchnorm else 1)
    eval_graph = prepare_eval(from_onnx(proto, input_shapes, training=True), list(training.state))
    return assemble_step(training, eval_graph, spec, optimizer, replicas, bucket_bytes, compression)


def assemble_step(training: TrainingModel, eval_graph: Graph, spec: LossSpec, optimizer: "Optimizer",
                  replicas: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  compression: GradientCompression | None = None) -> StepGraph:
    """Add the loss, backward pass and updates to the training graph of `training` (edited in place); with
    `replicas` > 1 the gradients and the loss are averaged over the data-parallel replicas first."""
    graph = training.graph
    persistent = set(training.state) | set(training.dropout_masks)
    data_inputs = [v.name for v in graph.inputs if v.name not in persistent]
    added = add_loss(graph, spec, [_value(graph, name) for name in training.model_outputs])
    parameters = [_value(graph, name) for name in training.parameters]
    grads = differentiate(graph, added.loss, parameters)
    loss = added.loss
    if replicas > 1:
        grads, loss = averaged_step(graph, grads, loss, bucket_bytes, compression)
    updates = add_updates(graph, optimizer.rule, {p.name: (p, grads[p.name]) for p in parameters})
    kept = [_value(graph, name) for name in training.state_updates.values()]
    loss_value = _loss_output(graph, loss)
    graph.outputs = [loss_value] + kept
    state_updates = add_next_values(graph, updates.next_values, training.state_updates)
    verify(graph)
    return StepGraph(
        graph=graph, eval_graph=eval_graph, data_inputs=data_inputs,
        label_input=added.labels.name if added.labels is not None else None, loss_output=loss_value.name,
        model_outputs=[v.name for v in eval_graph.outputs], state={**training.state, **updates.initial_slots()},
        state_updates=state_updates, parameters=list(training.parameters),
        scalar_inputs=[v.name for v in updates.scalar_inputs], dropout_masks=dict(training.dropout_masks),
        # What the chain of views from the loss starts from: collapsing views keeps it, not the views between it
        # and their readers (a model output of shape [1] made a scalar, then flattened into the last bucket).
        replica_loss=shape_view_source(added.loss, graph).name if replicas > 1 else None,
    )


def _value(graph: Graph, name: str) -> Value:
    """The value called `name` (an input or output prepare_training reported)."""
    value = graph.lookup(name)
    if value is None:
        raise AssertionError(f"training graph has no value {name!r}")
    return value


def _loss_output(graph: Graph, loss: Value) -> Value:
    """The loss as a graph output: a model output that is the loss keeps its name, a new loss is "loss"."""
    if loss.is_graph_output or loss.is_graph_input:
        return loss
    graph.rename_value(loss, graph.unique_name(LOSS_OUTPUT))
    return loss


def add_next_values(graph, next_values: Mapping, state_updates: Mapping[str, str]) -> dict[str, str]:
    """The optimizer's new values as graph outputs named `<state>__next`, added to `state_updates` (state name →
    the output that replaces it after a step)."""
    updated = dict(state_updates)
    for name, value in next_values.items():
        graph.rename_value(value, graph.unique_name(name + NEXT_SUFFIX))
        graph.outputs.append(value)
        updated[name] = value.name
    return updated
