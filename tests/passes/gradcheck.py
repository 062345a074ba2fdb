"""Checking gradient rules against central finite differences in float64, on one-op graphs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessel import ir
from tessel.ir.graph import Graph, Value
from tessel.ir.interpret import interpret
from tessel.ir.types import TensorType, numpy_dtype
from tessel.passes.autodiff import differentiate
from tessel.passes.base import add_op


@dataclass(frozen=True)
class Const:
    """An op input held as a graph constant (shapes, axes, indices): never differentiated."""

    array: np.ndarray


def one_op_graph(op_type: str, inputs: dict, attrs: dict | None = None, *, num_outputs: int = 1,
                 domain: str = "", seed: int = 0) -> tuple[Graph, Value, list[Value]]:
    """A graph running one op on `inputs` (name -> float array as a float32 graph input, Const, or None),
    with loss = sum over its float outputs of sum(output * fixed random weights). Returns (graph, loss, inputs)."""
    rng = np.random.default_rng(seed + 1000)
    graph = Graph()
    values = []
    for name, spec in inputs.items():
        if spec is None:
            values.append(None)
        elif isinstance(spec, Const):
            values.append(graph.add_constant(name, np.asarray(spec.array)))
        else:
            values.append(graph.add_input(name, TensorType("float32", np.shape(spec))))
    node = add_op(graph, op_type, values, attrs, num_outputs=num_outputs, domain=domain)
    loss = None
    for out in node.outputs:
        if out is None or out.type.dtype not in ("float32", "float64"):
            continue
        weights = graph.add_constant("w", rng.standard_normal(out.type.shape).astype(np.float32).astype(numpy_dtype(out.type.dtype)))
        term = add_op(graph, "ReduceSum", [add_op(graph, "Mul", [out, weights]).outputs[0]], {"keepdims": 0}).outputs[0]
        loss = term if loss is None else add_op(graph, "Add", [loss, term]).outputs[0]
    graph.outputs = [loss]
    return graph, loss, list(graph.inputs)


def finite_differences(graph: Graph, feeds: dict[str, np.ndarray], name: str, eps: float = 1e-6) -> np.ndarray:
    """d loss / d feeds[name] by central differences (the graph's one output is the loss)."""
    base = feeds[name]
    grad = np.zeros_like(base)
    for index in np.ndindex(base.shape):
        values = []
        for sign in (1.0, -1.0):
            moved = base.copy()
            moved[index] += sign * eps
            values.append(float(interpret(graph, {**feeds, name: moved})[graph.outputs[0].name]))
        grad[index] = (values[0] - values[1]) / (2 * eps)
    return grad


def check_gradients(op_type: str, inputs: dict, attrs: dict | None = None, *, num_outputs: int = 1,
                    domain: str = "", rtol: float = 1e-5, atol: float = 1e-6, eps: float = 1e-6) -> dict[str, np.ndarray]:
    """Differentiate a one-op graph with respect to every float input and compare with finite differences;
    return the analytic gradients."""
    graph, loss, wrt = one_op_graph(op_type, inputs, attrs, num_outputs=num_outputs, domain=domain)
    feeds = {v.name: np.asarray(inputs[v.name], dtype=np.float64) for v in wrt}
    expected = {v.name: finite_differences(graph, feeds, v.name, eps) for v in wrt}
    grads = differentiate(graph, loss, wrt)
    graph.outputs = [loss, *grads.values()]
    ir.verify(graph)
    got = interpret(graph, feeds)
    result = {}
    for name, grad in grads.items():
        result[name] = got[grad.name]
        np.testing.assert_allclose(got[grad.name], expected[name], rtol=rtol, atol=atol, err_msg=f"{op_type} d/d{name}")
    return result
