"""Pool taps (passes/pool_taps.py): a training step's MaxPool keeps its windows' first-maximum taps and its gradient
scatters through them; the step computes the same loss and gradients (the ops themselves are checked against
PyTorch in tests/ir/test_grad_ops.py and tests/backends/test_grad_kernels.py, a compiled step with the pass in
tests/compiler/test_training_torch.py's cnn_bn); the pass leaves a gradient without its forward pool alone."""
from __future__ import annotations

import numpy as np

from tessel.ir import verify
from tessel.ir.graph import Graph
from tessel.ir.interpret import interpret
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.types import TensorType
from tessel.passes.base import add_op
from tessel.passes.pool_taps import pool_taps
from tests.passes.torch_steps import Step

WINDOW = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])


def test_the_step_keeps_taps_and_computes_the_same_loss_and_gradients():
    step = Step("pool")
    expected = interpret(step.graph, step.feeds)
    arena = step.arena()
    result = pool_taps(step.graph)
    verify(step.graph)
    assert result.changed and result.stats == {"pools_keeping_taps": 1}
    kinds = [n.op_type for n in step.graph.nodes]
    assert "MaxPool" not in kinds and "MaxPoolGrad" not in kinds
    forward, grad = (next(n for n in step.graph.nodes if n.op_type == op)
                     for op in ("MaxPoolWithTaps", "MaxPoolTapsGrad"))
    assert grad.inputs[0] is forward.outputs[1] and forward.outputs[1].type.dtype == "int32"
    # The memory plan accounts the taps; this small step keeps the pool's input for the ReLU's backward anyway, so
    # they add at most their own bytes.
    assert step.arena() <= arena + forward.outputs[1].type.nbytes
    got = interpret(step.graph, step.feeds)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert not pool_taps(step.graph).changed


def _pool_graph(forward_window: dict, grad_window: dict, read_indices: bool = False) -> Graph:
    """x -> MaxPool -> y, and MaxPoolGrad(x, dy) with its own window, both graph outputs."""
    graph = Graph("pool")
    x = graph.add_input("x", TensorType("float32", (1, 2, 8, 8)))
    dy = graph.add_input("dy", TensorType("float32", (1, 2, 4, 4)))
    pool = add_op(graph, "MaxPool", [x], forward_window, num_outputs=2 if read_indices else 1)
    grad = add_op(graph, "MaxPoolGrad", [x, dy], grad_window, domain=TESSEL_DOMAIN)
    graph.outputs = [*pool.outputs, grad.outputs[0]]
    verify(graph)
    return graph


def test_it_fires_on_the_same_window_given_with_defaults_or_auto_pad():
    graph = _pool_graph(dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
                        dict(WINDOW, pads=[0, 0, 1, 1], dilations=[1, 1], ceil_mode=0))
    assert pool_taps(graph).changed
    verify(graph)
    assert [n.op_type for n in graph.nodes] == ["MaxPoolWithTaps", "MaxPoolTapsGrad"]
    assert graph.outputs[0].producer.op_type == "MaxPoolWithTaps"


def test_it_does_not_fire_without_the_same_forward_pool():
    other_window = _pool_graph(dict(kernel_shape=[2, 2], strides=[2, 2]), WINDOW)
    indices_read = _pool_graph(WINDOW, WINDOW, read_indices=True)
    for graph in (other_window, indices_read):
        before = [n.op_type for n in graph.nodes]
        assert not pool_taps(graph).changed
        assert [n.op_type for n in graph.nodes] == before
