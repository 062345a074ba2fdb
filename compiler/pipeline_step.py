"""The step graph of pipeline-parallel training: one micro-batch's forward and backward, the gradients summed
over the micro-batches, and the update (`build_pipeline_step`).

The model is imported at the micro-batch's size. The loss is the micro-batch's share of the whole batch's mean
(its mean divided by the number of micro-batches M), so the shares add up to the batch's loss and the gradients
of the shares add up to its gradient. Each parameter p gets a gradient-sum input and a graph output

    p.grad_sum__next = p.grad_sum * keep + grad(p)

which the optimizer update reads as p's gradient. compiler/pipeline_programs.py runs the forward and backward
once per micro-batch: micro-batch m reads micro-batch m - 1's sum (the first reads p itself with keep = 0, so
its sum is its own gradient, exactly: p * 0 + g = g for finite p), and the update runs once, on the last sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from tessel.ir import from_onnx, load_model, verify
from tessel.ir.onnx_import import with_batch
from tessel.ir.types import TensorType
from tessel.passes.autodiff import differentiate
from tessel.passes.base import add_op
from tessel.passes.loss import LossSpec, add_loss
from tessel.passes.optimizer_update import add_updates
from tessel.passes.training_mode import prepare_eval, prepare_training

from .training import LOSS_OUTPUT, NEXT_SUFFIX, StepGraph, add_next_values

if TYPE_CHECKING:
    from .optim import Optimizer

# The scalar input that scales the gradient sum so far: 0 on a stage's first micro-batch, 1 after.
KEEP_INPUT = "pipeline.keep"
GRAD_SUM_SUFFIX = ".grad_sum"


@dataclass
class PipelineStepGraph:
    """The micro-batch step graph and the names compiler/pipeline_programs.py unrolls it by."""

    step: StepGraph
    micro_batches: int
    grad_sums: dict[str, str]      # gradient-sum input -> its parameter
    sum_outputs: dict[str, str]    # gradient-sum input -> the graph output with the sum including this micro-batch
    batched: list[str]             # inputs fed per micro-batch: data, labels, dropout masks


def build_pipeline_step(model, micro_shapes: Mapping[str, Sequence[int]], whole_shapes: Mapping[str, Sequence[int]],
                        loss: str | LossSpec, optimizer: "Optimizer", micro_batches: int, trainable: str | None = None,
                        frozen: str | None = None, label_smoothing: float = 0.0) -> PipelineStepGraph:
    """The pipeline step of an ONNX model (path, bytes or ModelProto) at the micro-batch's input shapes
    `micro_shapes`; its eval graph at the whole batch's `whole_shapes`."""
    spec = loss if isinstance(loss, LossSpec) else LossSpec.parse(loss, label_smoothing)
    proto = load_model(model)
    micro_model = with_batch(proto, next(iter(micro_shapes.values()))[0])
    training = prepare_training(from_onnx(micro_model, micro_shapes, training=True), trainable, frozen)
    eval_graph = prepare_eval(from_onnx(proto, whole_shapes, training=True), list(training.state))
    graph = training.graph
    persistent = set(training.state) | set(training.dropout_masks)
    data_inputs = [v.name for v in graph.inputs if v.name not in persistent]
    added = add_loss(graph, spec, [graph.lookup(name) for name in training.model_outputs])
    share = add_op(graph, "Mul", [added.loss, graph.add_constant(graph.unique_name("pipeline.share"),
                                                                 np.asarray(1.0 / micro_batches, np.float32))],
                   name=graph.unique_name("pipeline/loss_share")).outputs[0]
    parameters = [graph.lookup(name) for name in training.parameters]
    grads = differentiate(graph, share, parameters)
    keep = graph.add_input(KEEP_INPUT, TensorType("float32", ()))
    sums, sum_outputs, summed = {}, {}, {}
    for param in parameters:
        before = graph.add_input(graph.unique_name(param.name + GRAD_SUM_SUFFIX), param.type)
        kept = add_op(graph, "Mul", [before, keep], name=graph.unique_name(f"pipeline/keep/{param.name}")).outputs[0]
        total = add_op(graph, "Add", [kept, grads[param.name]],
                       name=graph.unique_name(f"pipeline/sum/{param.name}")).outputs[0]
        graph.rename_value(total, graph.unique_name(before.name + NEXT_SUFFIX))
        sums[before.name], sum_outputs[before.name], summed[param.name] = param.name, total.name, total
    updates = add_updates(graph, optimizer.rule, {p.name: (p, summed[p.name]) for p in parameters})
    graph.rename_value(share, graph.unique_name(LOSS_OUTPUT))
    graph.outputs = [share] + [graph.lookup(name) for name in training.state_updates.values()] + list(summed.values())
    state_updates = add_next_values(graph, updates.next_values, training.state_updates)
    verify(graph)
    step = StepGraph(
        graph=graph, eval_graph=eval_graph, data_inputs=data_inputs,
        label_input=added.labels.name if added.labels is not None else None, loss_output=share.name,
        model_outputs=[v.name for v in eval_graph.outputs], state={**training.state, **updates.initial_slots()},
        state_updates=state_updates, parameters=list(training.parameters),
        scalar_inputs=[v.name for v in updates.scalar_inputs], dropout_masks=dict(training.dropout_masks))
    batched = data_inputs + ([step.label_input] if step.label_input else []) + sorted(training.dropout_masks)
    return PipelineStepGraph(step, micro_batches, sums, sum_outputs, batched)
