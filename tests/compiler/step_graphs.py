"""A training step built by hand: linear regression, pred = x @ W + b, MSE loss, plain SGD.

The gradient and the update are written out as ONNX nodes, so the runtime state and the Trainer are
tested on their own, without autodiff or the optimizer passes; the learning rate is the graph input that
tessel.optim.SGD feeds.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from tessel import ir
from tessel.compiler.training import StepGraph
from tessel.passes.optimizer_update import LR
from tests.ir.helpers import F, model

BATCH, FEATURES = 8, 3
TRUE_W = np.array([[1.5], [-2.0], [0.5]], np.float32)
TRUE_B = np.array([0.25], np.float32)


def inference_model(w: np.ndarray | None = None, b: np.ndarray | None = None) -> onnx.ModelProto:
    """The model being trained: pred = x @ W + b, W and b initializers."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["pred"])]
    w = np.zeros((FEATURES, 1), np.float32) if w is None else w
    b = np.zeros(1, np.float32) if b is None else b
    return model(nodes, [("x", F, [BATCH, FEATURES])], [("pred", F, [BATCH, 1])], [("W", w), ("b", b)])


def step_model(with_mask: bool = False) -> onnx.ModelProto:
    """One SGD step on the MSE: loss, W_next, b_next from x, labels, W, b and the learning rate; with
    `with_mask`, x is first multiplied by a dropout mask input `x_mask`."""
    source = "x_dropped" if with_mask else "x"
    nodes = ([helper.make_node("Mul", ["x", "x_mask"], ["x_dropped"])] if with_mask else []) + [
        helper.make_node("MatMul", [source, "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["pred"]),
        helper.make_node("Sub", ["pred", "labels"], ["diff"]),
        helper.make_node("Mul", ["diff", "diff"], ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["loss"], keepdims=0),
        helper.make_node("Mul", ["diff", "two_over_n"], ["grad_pred"]),
        helper.make_node("Transpose", [source], ["x_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x_t", "grad_pred"], ["grad_W"]),
        helper.make_node("ReduceSum", ["grad_pred", "axis0"], ["grad_b"], keepdims=0),
        helper.make_node("Mul", [LR, "grad_W"], ["step_W"]),
        helper.make_node("Sub", ["W", "step_W"], ["W_next"]),
        helper.make_node("Mul", [LR, "grad_b"], ["step_b"]),
        helper.make_node("Sub", ["b", "step_b"], ["b_next"]),
    ]
    inputs = [("x", F, [BATCH, FEATURES]), ("labels", F, [BATCH, 1]), ("W", F, [FEATURES, 1]), ("b", F, [1]),
              (LR, F, [])] + ([("x_mask", F, [BATCH, FEATURES])] if with_mask else [])
    outputs = [("loss", F, []), ("W_next", F, [FEATURES, 1]), ("b_next", F, [1])]
    return model(nodes, inputs, outputs, [("two_over_n", np.array(2.0 / BATCH, np.float32)),
                                          ("axis0", np.array([0], np.int64))])


def eval_model() -> onnx.ModelProto:
    """The forward with W and b as inputs (the persistent state)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["pred"])]
    return model(nodes, [("x", F, [BATCH, FEATURES]), ("W", F, [FEATURES, 1]), ("b", F, [1])],
                 [("pred", F, [BATCH, 1])])


def linear_step_graph(with_mask: bool = False) -> StepGraph:
    """The StepGraph of linear regression from zero weights."""
    return StepGraph(
        graph=ir.from_onnx(step_model(with_mask)), eval_graph=ir.from_onnx(eval_model()),
        data_inputs=["x"], label_input="labels", loss_output="loss", model_outputs=["pred"],
        state={"W": np.zeros((FEATURES, 1), np.float32), "b": np.zeros(1, np.float32)},
        state_updates={"W": "W_next", "b": "b_next"}, parameters=["W", "b"], scalar_inputs=[LR],
        dropout_masks={"x_mask": 0.25} if with_mask else {})


def batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of x and its exact labels x @ TRUE_W + TRUE_B."""
    x = np.random.default_rng(seed).standard_normal((BATCH, FEATURES)).astype(np.float32)
    return x, x @ TRUE_W + TRUE_B


def numpy_step(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray, lr: float):
    """The same step in numpy: (loss, W_next, b_next)."""
    diff = x @ w + b - y
    grad = diff * (2.0 / BATCH)
    return float(np.mean(diff * diff)), w - lr * (x.T @ grad), b - lr * grad.sum(axis=0)
