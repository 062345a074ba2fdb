"""batch_gemms: independent few-row Gemms that share a constant weight become one Gemm over their stacked rows."""
from __future__ import annotations

import numpy as np
from onnx import helper

from tessel import ir
from tessel.passes.batch_gemms import SMALL_ROWS, batch_gemms
from tests.conftest import POSITIVE
from tests.ir.helpers import F

from .helpers import assert_graph_matches, graph_of, model, ops, run_passes_until

RNG = np.random.default_rng(7)
K, N = 48, 24


def _steps_model(count: int, rows: int = 1, reads: dict[int, int] | None = None, shared: bool = True):
    """`count` Gemms y_i = x_i · Wᵀ + b; `reads` {i: j}: step i's input also adds step j's output (twice over, to
    K columns), as a recurrence's step reads the one before."""
    nodes, inputs, outputs = [], [], []
    weights = [("w", RNG.standard_normal((N, K)).astype(np.float32)), ("b", RNG.standard_normal(N).astype(np.float32))]
    for i in range(count):
        inputs.append((f"x{i}", F, [rows, K]))
        source = f"x{i}"
        if reads and i in reads:
            nodes.append(helper.make_node("Concat", [f"y{reads[i]}", f"y{reads[i]}"], [f"h{i}"], axis=1))
            nodes.append(helper.make_node("Add", [f"x{i}", f"h{i}"], [f"a{i}"]))
            source = f"a{i}"
        weight = "w" if shared else f"w{i}"
        if not shared:
            weights.append((weight, RNG.standard_normal((N, K)).astype(np.float32)))
        nodes.append(helper.make_node("Gemm", [source, weight, "b"], [f"y{i}"], transB=1))
        outputs.append((f"y{i}", F, [rows, N]))
    return model(nodes, inputs, outputs, weights)


def _feeds(m) -> dict[str, np.ndarray]:
    return {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in m.graph.input}


def test_independent_steps_become_one_gemm_over_their_rows():
    m = _steps_model(5)
    graph = graph_of(m)
    result = batch_gemms(graph)
    assert result.changed and result.stats == {"gemm_groups": 1, "gemms_stacked": 5}
    assert ops(graph) == ["Concat", "Gemm", "Split"]
    gemm = graph.nodes[1]
    assert gemm.outputs[0].type.shape == (5, N)
    assert [v.name for v in graph.outputs] == [f"y{i}" for i in range(5)]  # outputs keep their names
    assert_graph_matches(m, graph, _feeds(m))


def test_a_step_that_reads_another_s_output_is_not_stacked_with_it():
    # Steps 0, 1 and 3 are independent; step 2 reads step 0's output, so it cannot join them.
    m = _steps_model(4, reads={2: 0})
    graph = graph_of(m)
    assert batch_gemms(graph).stats == {"gemm_groups": 1, "gemms_stacked": 3}
    assert ops(graph).count("Gemm") == 2
    assert_graph_matches(m, graph, _feeds(m))


def test_a_recurrence_is_left_alone():
    m = _steps_model(4, reads={1: 0, 2: 1, 3: 2})
    graph = graph_of(m)
    assert not batch_gemms(graph).changed and ops(graph).count("Gemm") == 4


def _row_bias_model():
    """Two [2, K] Gemms whose bias has a row per input row: stacked, it would not broadcast."""
    nodes = [helper.make_node("Gemm", [f"x{i}", "w", "c"], [f"y{i}"], transB=1) for i in range(2)]
    return model(nodes, [(f"x{i}", F, [2, K]) for i in range(2)], [(f"y{i}", F, [2, N]) for i in range(2)],
                 [("w", RNG.standard_normal((N, K)).astype(np.float32)), ("c", RNG.standard_normal((2, N)).astype(np.float32))])


def test_different_weights_many_rows_or_a_bias_per_row_are_left_alone():
    for m in (_steps_model(3, shared=False), _steps_model(3, rows=SMALL_ROWS + 1), _steps_model(1), _row_bias_model()):
        graph = graph_of(m)
        assert not batch_gemms(graph).changed
        assert "Concat" not in ops(graph) and "Split" not in ops(graph)


def test_captcha_crnn_projects_each_direction_s_steps_in_one_gemm():
    crnn = next(m for m in POSITIVE if m.name == "captcha_crnn")
    graph = run_passes_until(ir.from_onnx(str(crnn.path), crnn.input_shapes), "batch_gemms")
    stacked = [n for n in graph.nodes if n.op_type == "Gemm" and n.outputs[0].type.shape == (20, 400)]
    assert len(stacked) == 2  # each direction's twenty input projections, [1, 4096] · [4096, 400] each
    assert_graph_matches(str(crnn.path), graph, crnn.make_inputs(), rtol=1e-3, atol=1e-4)
