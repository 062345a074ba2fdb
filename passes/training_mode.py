"""Training import: a graph imported with `from_onnx(..., training=True)` given training or evaluation semantics.

`prepare_training` makes the model's float initializers graph inputs that persist
across steps ("state": the trainable parameters and BatchNormalization's running
statistics), rewrites BatchNormalization into its batch statistics (the BatchStats
op on one replica; sums all-reduced across replicas for synchronised BatchNorm) and primitive ops, whose
running-statistic updates become graph outputs, Dropout into a product
with a mask fed each step, and LSTM/GRU into unrolled primitive ops, so that
generic gradient rules differentiate the whole graph. `prepare_eval` gives the
same persistent inputs with inference semantics.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from tessel.ir.errors import ModelImportError
from tessel.ir.graph import Graph, Node, Value
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.verify import verify

from .base import add_op, can_replace, constant_scalar, retire
from .data_parallel import replica_mean
from .emitter import Emitter
from .unroll_rnn import unroll_rnn

# Float inputs that configure an op rather than feed its arithmetic: an initializer read there is no parameter.
_SETTINGS = {("Resize", 1), ("Resize", 2), ("Dropout", 1)}
# BatchNormalization's running mean and variance inputs.
_RUNNING_STATS = (3, 4)


@dataclass
class TrainingModel:
    """A graph with training semantics and what drives it between steps."""

    graph: Graph                      # every parameter and BN running stat is a graph input named as its initializer
    parameters: list[str]             # trainable inputs, in graph order
    state: dict[str, np.ndarray]      # initial value of every persistent input: parameters and BN running stats
    state_updates: dict[str, str] = field(default_factory=dict)  # persistent input -> graph output with its next value
    # mask input -> drop ratio (the mask fed each step is bernoulli(1-p)/(1-p), of the masked value's shape)
    dropout_masks: dict[str, float] = field(default_factory=dict)
    model_outputs: list[str] = field(default_factory=list)  # the model's own outputs (still graph outputs, first)


def prepare_training(graph: Graph, trainable: str | None = None, frozen: str | None = None,
                     sync_replicas: int = 1) -> TrainingModel:
    """Give `graph` (imported with from_onnx(..., training=True); edited in place) training semantics.

    Every float initializer matching `trainable` (re.search; default all) and not `frozen` becomes a trainable
    graph input; BatchNormalization running statistics become persistent non-trainable inputs (unless `frozen`
    matches them); the other float initializers stay constants. `sync_replicas` > 1: `graph` is one of that
    many data-parallel replicas and BatchNormalization normalises with the statistics of all their slices
    together (synchronised BatchNorm, as torch.nn.SyncBatchNorm).
    """
    selected, excluded = _pattern("trainable", trainable), _pattern("frozen", frozen)
    _split_aliases(graph)
    model_outputs = [v.name for v in graph.outputs]
    running = _running_stats(graph)
    candidates = [name for name in _initializer_order(graph) if name in _parameter_candidates(graph) - running]
    parameters = [name for name in candidates
                  if (selected is None or selected.search(name)) and not (excluded and excluded.search(name))]
    if not parameters:
        raise ModelImportError(_no_parameters(candidates, trainable, frozen))
    stats = [name for name in _initializer_order(graph) if name in running and not (excluded and excluded.search(name))]
    state = _make_inputs(graph, parameters + stats)
    model = TrainingModel(graph, parameters, state, model_outputs=model_outputs)
    updates: dict[str, Value] = {}
    for node in list(graph.nodes):
        if node.op_type == "BatchNormalization":
            _batch_norm_training(graph, node, updates, sync_replicas)
        elif node.op_type == "Dropout":
            _dropout_training(graph, node, model.dropout_masks)
        elif node.op_type in ("LSTM", "GRU"):
            unroll_rnn(graph, node)
    for name, update in updates.items():
        if update.is_graph_output or update.is_graph_input:
            update = add_op(graph, "Identity", [update], name=f"{name}/next").outputs[0]
        graph.rename_value(update, graph.unique_name(f"{name}__next"))
        graph.outputs.append(update)
        model.state_updates[name] = update.name
    _finish(graph)
    return model


def prepare_eval(graph: Graph, state_names: Iterable[str]) -> Graph:
    """Give `graph` (imported with from_onnx(..., training=True); edited in place) inference semantics with the
    persistent inputs `state_names` of the training graph: BatchNormalization uses the running statistics,
    Dropout passes its input through."""
    _split_aliases(graph)
    persistent = set(state_names)
    _make_inputs(graph, [name for name in _initializer_order(graph) if name in persistent])
    for node in list(graph.nodes):
        if node.op_type == "BatchNormalization" and node.attrs.get("training_mode", 0):
            _batch_norm_inference(graph, node)
        elif node.op_type == "Dropout":
            _pass_through(graph, node)
    _finish(graph)
    return graph


def _finish(graph: Graph) -> None:
    """Drop the constants the rewrites left unread, keep `graph.initializers` to the remaining ones, verify."""
    for value in list(graph.constants):
        if not value.uses and not value.is_graph_output:
            graph.remove_constant(value)
    graph.initializers = frozenset(v.name for v in graph.constants if v.name in graph.initializers)
    verify(graph)


# ---- parameters ------------------------------------------------------------------------------------------------
def _pattern(option: str, pattern: str | None) -> re.Pattern | None:
    """The compiled regular expression of `trainable=` or `frozen=`; a malformed one is a one-line error."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ModelImportError(f"{option}={pattern!r} is not a valid regular expression: {exc}") from None


def _no_parameters(candidates: list[str], trainable: str | None, frozen: str | None) -> str:
    """Why nothing would be trained, as one line."""
    if not candidates:
        return ("the model has no float initializers to train (import it with from_onnx(..., training=True); "
                "an inference import folds them)")
    shown = ", ".join(candidates[:8]) + (f" and {len(candidates) - 8} more" if len(candidates) > 8 else "")
    given = " and ".join(f"{k}={v!r}" for k, v in (("trainable", trainable), ("frozen", frozen)) if v is not None)
    return f"{given} leave(s) no parameter to train; the model's float initializers are {shown}"


def _split_aliases(graph: Graph) -> None:
    """Identity(initializer) becomes an initializer of its own under the Identity's output name.

    PyTorch's exporter writes one initializer for buffers of equal initial value and Identity nodes for the
    others (a fresh BN's running_var is bn.weight's ones); in training each is a tensor of its own.
    """
    aliases = set()
    for node in list(graph.nodes):
        source = node.inputs[0] if node.op_type == "Identity" and node.inputs else None
        if source is None or not source.is_constant or source.name not in graph.initializers:
            continue
        alias = node.outputs[0]
        name = alias.name
        graph.rename_value(alias, graph.unique_name(f"{name}__alias"))
        copy = graph.add_constant(name, source.const)
        graph.replace_all_uses_with(alias, copy)
        graph.remove_node(node)
        aliases.add(name)
    graph.initializers = graph.initializers | aliases


def _initializer_order(graph: Graph) -> list[str]:
    """The initializer constants' names in graph order."""
    return [v.name for v in graph.constants if v.name in graph.initializers]


def _running_stats(graph: Graph) -> set[str]:
    """Initializers that are a BatchNormalization's running mean or variance."""
    return {node.inputs[i].name for node in graph.walk_nodes() if node.op_type == "BatchNormalization"
            for i in _RUNNING_STATS if node.inputs[i] is not None and node.inputs[i].name in graph.initializers}


def _parameter_candidates(graph: Graph) -> set[str]:
    """Float initializers that feed arithmetic (none of them read only as an op's setting)."""
    settings = {node.inputs[i].name for node in graph.walk_nodes() for i, v in enumerate(node.inputs)
                if v is not None and (node.op_type, i) in _SETTINGS}
    return set(graph.initializers) - settings


def _make_inputs(graph: Graph, names: list[str]) -> dict[str, np.ndarray]:
    """Turn the named constants into graph inputs of the same name; return their values."""
    values = {}
    for name in names:
        constant = graph.lookup(name)
        values[name] = np.array(constant.const)
        graph.rename_value(constant, graph.unique_name(f"{name}__initial"))
        value = graph.add_input(name, constant.type)
        graph.replace_all_uses_with(constant, value)
        graph.remove_constant(constant)
    return values


# ---- BatchNormalization ----------------------------------------------------------------------------------------
def _batch_norm_training(graph: Graph, node: Node, updates: dict[str, Value], replicas: int = 1) -> None:
    """BatchNormalization with batch statistics; running statistics updated as PyTorch does (unbiased variance).
    `replicas` > 1: the statistics are those of every data-parallel replica's slice together (`_batch_mean`)."""
    x, scale, bias, mean_in, var_in = node.inputs[:5]
    rank, channels = x.type.rank, x.type.shape[1]
    axes = [0] + list(range(2, rank))
    count = replicas * int(np.prod([x.type.shape[a] for a in axes]))
    if count < 2:
        raise ModelImportError(f"node '{node.name}' (BatchNormalization): training needs more than one value per "
                               f"channel, the input is {x.type}; use a larger batch")
    momentum = _float32_literal(node.attrs.get("momentum", 0.9))
    epsilon = _float32_literal(node.attrs.get("epsilon", 1e-5))
    em = Emitter(graph, node, node.name)
    per_channel = [channels] + [1] * (rank - 2)
    if replicas > 1:
        axes_value = em.const(axes, np.int64)
        mean = _batch_mean(em, x, axes_value, replicas)
        centered = em.op("Sub", x, mean)
        var = _batch_mean(em, em.op("Mul", centered, centered), axes_value, replicas)
        # (x - mean) times one per-channel factor rstd * scale: backward then keeps x - mean alone (and
        # per-channel values), as PyTorch keeps x, instead of both x - mean and the normalized x.
        factor = _factor(em, var, scale, epsilon, per_channel)
        y = em.op("Add", em.op("Mul", centered, factor), em.reshape(bias, per_channel))
    else:
        # One op for both statistics (one kernel, a closed-form gradient: passes/gradients/nn.py), and
        # y = x * factor + (bias - mean * factor), PyTorch's CPU arithmetic: the forward makes no x - mean,
        # the backward keeps x, and the mean's gradient is per channel (bias's sum of dy times -factor), not a
        # sum over the whole of dy * factor.
        mean, var = add_op(graph, "BatchStats", [x], name=f"{node.name}/BatchStats", before=node, num_outputs=2,
                           domain=TESSEL_DOMAIN).outputs
        factor = _factor(em, var, scale, epsilon, per_channel)
        shift = em.op("Sub", em.reshape(bias, per_channel), em.op("Mul", mean, factor))
        y = em.op("Add", em.op("Mul", x, factor), shift)
    replacements = {0: y}
    running = {1: (mean_in, mean, 1.0 - momentum), 2: (var_in, var, (1.0 - momentum) * count / (count - 1))}
    for output, (stat, batch_stat, factor) in running.items():
        read = output < len(node.outputs) and node.outputs[output] is not None
        persistent = stat.is_graph_input and stat.name not in updates
        if read or persistent:
            update = _running_update(em, stat, batch_stat, momentum, factor)
            if read:
                replacements[output] = update
            if persistent:
                updates[stat.name] = update
    _retire_or_alias(graph, node, replacements)


def _factor(em: Emitter, var: Value, scale: Value, epsilon: float, per_channel: list[int]) -> Value:
    """scale / sqrt(var + epsilon), per channel."""
    rstd = em.op("Reciprocal", em.op("Sqrt", em.op("Add", var, em.scalar(epsilon, var))))
    return em.op("Mul", rstd, em.reshape(scale, per_channel))


def _batch_mean(em: Emitter, value: Value, axes: Value, replicas: int) -> Value:
    """The mean of `value` over the batch `axes` (kept) of all the `replicas`' slices: each replica's mean, averaged
    over the replicas by an AllReduce (the slices are equally large). The mean and then the variance of the centred
    values take one AllReduce each, the single-device arithmetic, rather than one AllReduce of the mean and the
    mean of squares, whose difference cancels where the mean dwarfs the spread."""
    return replica_mean(em.graph, em.op("ReduceMean", value, axes, keepdims=1))


def _running_update(em: Emitter, stat: Value, batch_stat: Value, momentum: float, factor: float) -> Value:
    """momentum * stat + factor * batch_stat, the batch statistic flattened to the stat's shape."""
    flat = em.reshape(batch_stat, list(stat.type.shape))
    return em.op("Add", em.op("Mul", stat, em.scalar(momentum, stat)), em.op("Mul", flat, em.scalar(factor, stat)))


def _batch_norm_inference(graph: Graph, node: Node) -> None:
    """Training-mode BatchNormalization (3 outputs) as its inference form; the running stats pass through."""
    attrs = {k: v for k, v in node.attrs.items() if k in ("epsilon", "momentum")}
    y = add_op(graph, "BatchNormalization", node.inputs[:5], attrs, name=node.name, before=node).outputs[0]
    replacements = {output: node.inputs[output + 2] for output in (1, 2)
                    if output < len(node.outputs) and node.outputs[output] is not None}
    replacements[0] = y
    _retire_or_alias(graph, node, replacements)


def _float32_literal(value: float) -> float:
    """The shortest decimal that a float32 attribute stands for (0.9, not 0.8999999761581421), as PyTorch's value."""
    return float(np.format_float_positional(np.float32(value)))


# ---- Dropout ---------------------------------------------------------------------------------------------------
def _dropout_training(graph: Graph, node: Node, masks: dict[str, float]) -> None:
    """Dropout as x * mask, the mask a new input fed each step; ratio 0 passes x through."""
    x = node.inputs[0]
    ratio_input = node.inputs[1] if len(node.inputs) > 1 else None
    ratio = 0.5 if ratio_input is None else constant_scalar(ratio_input)
    if ratio is None:
        raise ModelImportError(f"node '{node.name}' (Dropout): its ratio is computed at run time; training needs a "
                               "constant ratio")
    ratio = _float32_literal(ratio)
    if ratio == 0.0:
        _pass_through(graph, node)
        return
    mask = graph.add_input(graph.unique_name(f"{node.name}_mask"), x.type)
    masks[mask.name] = ratio
    em = Emitter(graph, node, node.name)
    replacements = {0: em.op("Mul", x, mask)}
    if len(node.outputs) > 1 and node.outputs[1] is not None:
        replacements[1] = em.op("Greater", mask, em.scalar(0.0, mask))
    _retire_or_alias(graph, node, replacements)


def _pass_through(graph: Graph, node: Node) -> None:
    """Dropout at inference: the input itself, and a mask of ones."""
    replacements = {0: node.inputs[0]}
    if len(node.outputs) > 1 and node.outputs[1] is not None:
        replacements[1] = graph.add_constant(graph.unique_name(f"{node.name}_mask"),
                                             np.ones(node.outputs[1].type.shape, bool))
    _retire_or_alias(graph, node, replacements)


def _retire_or_alias(graph: Graph, node: Node, replacements: dict[int, Value]) -> None:
    """Replace the node's outputs and remove it; a graph output whose replacement cannot take its name (an
    input, a constant, another output) gets an Identity under that name."""
    for index, new in list(replacements.items()):
        old = node.outputs[index]
        if not can_replace(old, new):
            replacements[index] = add_op(graph, "Identity", [new], name=f"{node.name}/Identity", before=node).outputs[0]
    retire(node, replacements)
