"""Training losses as graph ops: `add_loss` appends a scalar loss to a model graph.

Every loss is built from primitive ONNX ops that reverse-mode autodiff has rules
for (LogSoftmax, Mul, Sub, Abs, Relu, Softplus, ReduceSum, ReduceMean), so the
backward pass needs nothing loss-specific. Labels become a graph input named
"labels"; the class indices of cross-entropy enter only through a comparison
(Equal with the class numbers, Cast to float), a path autodiff never
differentiates. Each loss gives the numbers of its torch.nn.functional
counterpart with the default reduction (mean).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tessel.ir.errors import TesselError
from tessel.ir.graph import Graph, Value
from tessel.ir.types import TensorType, dtype_to_onnx, numpy_dtype

from .base import add_op

LABELS = "labels"
# Loss kinds computed from the model's output and labels; "output" takes a model output as the loss itself.
LABELLED_KINDS = ("cross_entropy", "mse", "l1", "bce_with_logits")
KINDS = (*LABELLED_KINDS, "output")


class LossError(TesselError):
    """A loss that does not fit the model (unknown kind or output, wrong shape or label smoothing)."""


@dataclass(frozen=True)
class LossSpec:
    """Which loss to add: `kind` from KINDS, the model output it reads (index or name), label smoothing."""

    kind: str
    output: int | str = 0
    label_smoothing: float = 0.0

    @classmethod
    def parse(cls, text: str, label_smoothing: float = 0.0) -> "LossSpec":
        """The spec a user writes: a kind ("cross_entropy", ...), "output:K" (model output K is the loss),
        or the name of the model output that is the loss."""
        if text in LABELLED_KINDS:
            return cls(text, 0, label_smoothing)
        if text.startswith("output:"):
            index = text[len("output:"):]
            if not index.isdigit():
                raise LossError(f"loss {text!r}: expected output:K with K a model output number")
            return cls("output", int(index))
        return cls("output", text)


@dataclass(frozen=True)
class AddedLoss:
    """The scalar float loss value added to the graph and the labels input it reads (None for "output")."""

    loss: Value
    labels: Value | None


def add_loss(graph: Graph, spec: LossSpec, model_outputs: Sequence[Value] | None = None) -> AddedLoss:
    """Append the loss `spec` describes to `graph`; the loss is a scalar float value (not yet a graph output).

    `model_outputs` are the outputs `spec.output` counts or names (default: all graph outputs).
    """
    if spec.kind not in KINDS:
        raise LossError(f"unknown loss {spec.kind!r}; expected one of {', '.join(KINDS)}, output:K or an output name")
    if not 0.0 <= spec.label_smoothing <= 1.0:
        raise LossError(f"label_smoothing must be in [0, 1], got {spec.label_smoothing}")
    if spec.label_smoothing and spec.kind != "cross_entropy":
        raise LossError(f"label smoothing applies to cross_entropy only, not {spec.kind}")
    output = _model_output(list(graph.outputs if model_outputs is None else model_outputs), spec.output)
    if not output.type.dtype.startswith(("float", "bfloat")):
        raise LossError(f"the loss reads model output {output.name!r} of type {output.type.dtype}; it must be float")
    if spec.kind == "output":
        return AddedLoss(_as_scalar_loss(graph, output), None)
    if spec.kind == "cross_entropy":
        return _cross_entropy(graph, output, spec.label_smoothing)
    labels = graph.add_input(LABELS, output.type)
    builders = {"mse": _mse, "l1": _l1, "bce_with_logits": _bce_with_logits}
    return AddedLoss(builders[spec.kind](graph, output, labels), labels)


def _model_output(outputs: list[Value], which: int | str) -> Value:
    if isinstance(which, int):
        if not 0 <= which < len(outputs):
            raise LossError(f"the model has {len(outputs)} output(s); there is no output {which}")
        return outputs[which]
    for value in outputs:
        if value.name == which:
            return value
    names = ", ".join(v.name for v in outputs)
    raise LossError(f"unknown loss {which!r}: not a loss kind ({', '.join(LABELLED_KINDS)}), output:K, "
                    f"or a model output ({names})")


def _as_scalar_loss(graph: Graph, output: Value) -> Value:
    if output.type.numel != 1:
        raise LossError(f"model output {output.name!r} of shape {list(output.type.shape)} is not a loss: "
                        "it must hold one element")
    if output.type.rank == 0:
        return output
    shape = graph.add_constant(graph.unique_name("loss_shape"), np.zeros(0, np.int64))
    return _op(graph, "Reshape", [output, shape])


def _cross_entropy(graph: Graph, logits: Value, smoothing: float) -> AddedLoss:
    """torch.nn.functional.cross_entropy on class indices: logits [N, C, *d], labels int64 [N, *d]."""
    if logits.type.rank < 2:
        raise LossError(f"cross_entropy needs logits of shape [N, C, ...]; output {logits.name!r} has shape "
                        f"{list(logits.type.shape)}")
    shape = logits.type.shape
    classes = shape[1]
    labels = graph.add_input(LABELS, TensorType("int64", (shape[0], *shape[2:])))
    # one_hot[n, c, ...] = (labels[n, ...] == c), built elementwise so it needs no OneHot kernel.
    label_axis = graph.add_constant(graph.unique_name("loss_class_axis"), np.array([1], np.int64))
    class_ids = np.arange(classes, dtype=np.int64).reshape((1, classes) + (1,) * (len(shape) - 2))
    class_value = graph.add_constant(graph.unique_name("loss_classes"), class_ids)
    matches = _op(graph, "Equal", [_op(graph, "Unsqueeze", [labels, label_axis]), class_value])
    dtype = numpy_dtype(logits.type.dtype)
    target = _op(graph, "Cast", [matches], {"to": dtype_to_onnx(logits.type.dtype)})
    if smoothing:
        # torch's smoothed target: (1 - eps) * one_hot + eps / C.
        target = _op(graph, "Add", [_op(graph, "Mul", [target, _scalar(graph, 1.0 - smoothing, dtype)]),
                                    _scalar(graph, smoothing / classes, dtype)])
    log_probs = _op(graph, "LogSoftmax", [logits], {"axis": 1})
    total = _op(graph, "ReduceSum", [_op(graph, "Mul", [target, log_probs])], {"keepdims": 0})
    count = logits.type.numel // classes
    return AddedLoss(_op(graph, "Mul", [total, _scalar(graph, -1.0 / count, dtype)]), labels)


def _mse(graph: Graph, output: Value, labels: Value) -> Value:
    difference = _op(graph, "Sub", [output, labels])
    return _mean(graph, _op(graph, "Mul", [difference, difference]))


def _l1(graph: Graph, output: Value, labels: Value) -> Value:
    return _mean(graph, _op(graph, "Abs", [_op(graph, "Sub", [output, labels])]))


def _bce_with_logits(graph: Graph, logits: Value, labels: Value) -> Value:
    # torch's stable form: max(x, 0) - x * t + log(1 + exp(-|x|)).
    softplus = _op(graph, "Softplus", [_op(graph, "Neg", [_op(graph, "Abs", [logits])])])
    linear = _op(graph, "Sub", [_op(graph, "Relu", [logits]), _op(graph, "Mul", [logits, labels])])
    return _mean(graph, _op(graph, "Add", [linear, softplus]))


def _mean(graph: Graph, value: Value) -> Value:
    return _op(graph, "ReduceMean", [value], {"keepdims": 0})


def _scalar(graph: Graph, number: float, dtype: np.dtype) -> Value:
    return graph.add_constant(graph.unique_name("loss_const"), np.array(number, dtype))


def _op(graph: Graph, op_type: str, inputs: list[Value], attrs: dict | None = None) -> Value:
    return add_op(graph, op_type, inputs, attrs, name=f"loss_{op_type}").outputs[0]
