"""The conformance sweep: stages, classification, worker isolation, and every lowered op through compile and run."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, compose, helper, numpy_helper
from onnx.backend.test.runner import Runner

import bench.onnx_conformance as conformance
from bench.onnx_conformance import _feeds_and_expected, all_cases, bound_inputs, main, run_case
from tessel.backends.lowering import RULES, grad, optimizer
from tessel.compiler.api import compile
from tests.conftest import run_onnxruntime

CASES = {c.name: c for c in all_cases()}

# One node test per lowered op that tests/backends/test_kernel.py does not already run through the backend.
NODE_TESTS = [
    "test_abs", "test_acos_example", "test_acosh_example", "test_and2d", "test_argmin_no_keepdims_example",
    "test_asin_example", "test_asinh_example", "test_atan_example", "test_atanh_example", "test_bitshift_right_uint8",
    "test_bitwise_and_i32_2d", "test_bitwise_not_2d", "test_bitwise_or_i32_2d", "test_bitwise_xor_i32_2d",
    "test_ceil_example", "test_celu", "test_cos_example", "test_cosh_example", "test_dropout_default",
    "test_einsum_transpose", "test_elu_example", "test_eyelike_without_dtype", "test_flatten_axis0",
    "test_floor_example", "test_gathernd_example_int32", "test_greater", "test_greater_equal", "test_gridsample",
    "test_hardmax_example", "test_isinf", "test_isnan", "test_less", "test_less_equal",
    "test_l2normalization_axis_0", "test_lppool_1d_default", "test_min_example", "test_mish", "test_neg_example",
    "test_nllloss_NC", "test_or2d", "test_reciprocal_example", "test_reduce_min_default_axes_keepdims_example",
    "test_reduce_prod_default_axes_keepdims_example", "test_reversesequence_time", "test_round",
    "test_scatter_elements_without_axis", "test_scatternd", "test_selu_example", "test_shrink_hard", "test_sign",
    "test_sin_example", "test_sinh_example", "test_sce_none", "test_softplus_example", "test_softsign_example",
    "test_tan_example", "test_thresholdedrelu_example", "test_triu", "test_xor2d", "test_identity",
    "test_argmax_keepdims_example_select_last_index", "test_div_int8", "test_averagepool_3d_default",
    "test_cumsum_1d_reverse_exclusive", "test_top_k_smallest", "test_spacetodepth_example", "test_center_crop_pad_crop_and_pad",
    "test_affine_grid_2d", "test_resize_upsample_scales_cubic", "test_reduce_max_bool_inputs",
    "test_simple_rnn_bidirectional", "test_dropout_default_mask",
]
# Ops whose node tests feed a shape-like operand at run time or use an op version Tessel refuses: one small
# model built here runs them all (GRAPH_OPS).
GRAPH_OPS = ("Cast", "CastLike", "GlobalLpPool", "Mod", "Not", "OneHot", "ReduceL1", "ReduceLogSum",
             "ReduceSumSquare", "Reshape", "Squeeze", "Unsqueeze")


def _opset(case) -> int:
    return next(o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx"))


def _merged(names: list[str]):
    """One model running the node tests side by side (names prefixed per test), its feeds, and per test its
    outputs' names, expected values and tolerances: one compile builds all their kernels in parallel."""
    nodes, inputs, outputs, initializers, feeds, checks = [], [], [], [], {}, []
    for index, name in enumerate(names):
        case = CASES[name]
        model = compose.add_prefix(case.model, f"t{index}_")
        graph_inputs, arrays, expected = _feeds_and_expected(case)
        _, values, run_feeds = bound_inputs(case.model, dict(zip(graph_inputs, arrays)))
        nodes += model.graph.node
        initializers += list(model.graph.initializer) + [numpy_helper.from_array(v, f"t{index}_{k}") for k, v in values.items()]
        inputs += [vi for vi in model.graph.input if vi.name in {f"t{index}_{k}" for k in run_feeds}]
        outputs += model.graph.output
        feeds.update({f"t{index}_{k}": v for k, v in run_feeds.items()})
        checks.append((name, [f"t{index}_{o.name}" for o in case.model.graph.output], expected, case.rtol, case.atol))
    graph = helper.make_graph(nodes, "node_tests", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", _opset(CASES[names[0]]))]), feeds, checks


@pytest.mark.parametrize("opset", sorted({_opset(CASES[name]) for name in NODE_TESTS}))
def test_node_tests_compile_run_and_equal_their_expected_outputs(opset, kernel_cache):
    model, feeds, checks = _merged([name for name in NODE_TESTS if _opset(CASES[name]) == opset])
    artifact = compile(model, input_shapes={k: v.shape for k, v in feeds.items()}, profile=False, cache_dir=kernel_cache)
    got = artifact.run(feeds)
    for name, output_names, expected, rtol, atol in checks:
        Runner.assert_similar_outputs(expected, [got[o] for o in output_names], rtol, atol, model_dir=name)


def test_ops_without_a_runnable_node_test_run_in_one_small_model(kernel_cache):
    ints = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    nodes = [
        helper.make_node("Cast", ["x"], ["cast"], to=TensorProto.INT32),
        helper.make_node("CastLike", ["cast", "x"], ["cast_like"]),
        helper.make_node("GlobalLpPool", ["x"], ["lp_pool"], p=3),
        helper.make_node("Mod", ["x", "x_shifted"], ["mod"], fmod=1),
        helper.make_node("Greater", ["x", "x_shifted"], ["greater"]),
        helper.make_node("Not", ["greater"], ["not"]),
        helper.make_node("OneHot", ["indices", "depth", "on_off"], ["one_hot"], axis=-1),
        helper.make_node("ReduceL1", ["x", "axis1"], ["l1"], keepdims=0),
        helper.make_node("Abs", ["x"], ["abs"]),
        helper.make_node("ReduceLogSum", ["abs", "axis1"], ["log_sum"]),
        helper.make_node("ReduceSumSquare", ["x", "axis1"], ["sum_square"]),
        helper.make_node("Reshape", ["x", "shape"], ["reshaped"]),
        helper.make_node("Unsqueeze", ["reshaped", "axis1"], ["unsqueezed"]),
        helper.make_node("Squeeze", ["unsqueezed", "axis1"], ["squeezed"]),
    ]
    outputs = ["cast_like", "lp_pool", "mod", "not", "one_hot", "l1", "log_sum", "sum_square", "squeezed"]
    graph = helper.make_graph(
        nodes, "graph_ops",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
         helper.make_tensor_value_info("x_shifted", TensorProto.FLOAT, [2, 3, 4]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, [2, 3])],
        [],  # typed from ONNX's shape inference below
        [ints("depth", [5]), helper.make_tensor("on_off", TensorProto.FLOAT, [2], [0.0, 1.0]), ints("axis1", [1]),
         ints("shape", [4, 6])],
    )
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    inferred = {vi.name: vi for vi in model.graph.value_info}
    model.graph.output.extend(inferred[name] for name in outputs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32) * 3
    feeds = {"x": x, "x_shifted": x + 1.5, "indices": rng.integers(-5, 5, (2, 3))}
    expected = run_onnxruntime(model, feeds)
    artifact = compile(model, input_shapes={k: v.shape for k, v in feeds.items()}, profile=False, cache_dir=kernel_cache)
    got = artifact.run(feeds)
    assert {n.op_type for n in nodes} >= set(GRAPH_OPS)
    for name, want in zip(outputs, expected):
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_every_lowered_onnx_op_is_run_by_a_node_test_or_the_small_model():
    kernel_tests = Path(__file__).resolve().parents[1] / "backends" / "test_kernel.py"
    listed = kernel_tests.read_text()
    listed = listed[listed.index("NODE_TESTS = ["):listed.index("]", listed.index("NODE_TESTS = ["))]
    names = NODE_TESTS + re.findall(r'"(test_\w+)"', listed)
    covered = {node.op_type for name in names for node in CASES[name].model.graph.node} | set(GRAPH_OPS)
    tessel_domain = set(grad.RULES) | set(optimizer.RULES)
    assert set(RULES) - tessel_domain - covered == set()


def test_supported_ops_pass_through_import_export_and_onnxruntime():
    for name in ("test_relu", "test_conv_with_strides_padding", "test_lstm_defaults", "test_gru_defaults",
                 "test_softmax_axis_0", "test_maxpool_2d_pads", "test_gather_0"):
        assert run_case(CASES[name], "export") == ("pass", ""), name


def test_float16_sums_accumulate_in_float32_like_the_reference(kernel_cache):
    # One float16 ulp off at rtol 1e-3 when MatMul, Softmax's denominator or Conv accumulate in float16.
    for name in ("test_attention_4d_causal_fp16", "test_causal_conv_with_state_silu_fp16"):
        assert run_case(CASES[name]) == ("pass", ""), name


def test_ceil_mode_pools_export_past_onnx_checker_full_check():
    # ONNX's opset-21 inference keeps the window that starts in the end padding; the declared size drops it.
    for name in ("test_averagepool_2d_ceil_last_window_starts_on_pad", "test_maxpool_2d_ceil_output_size_reduce_by_one"):
        assert run_case(CASES[name], "export") == ("pass", ""), name


def test_bfloat16_graph_inputs_are_refused_at_import():
    outcome, detail = run_case(CASES["test_compress_bfloat16"])
    assert outcome == "unsupported" and "bfloat16 graph inputs" in detail


def test_sequence_and_data_dependent_cases_are_classified():
    assert run_case(CASES["test_sequence_insert_at_back"])[0] == "unsupported"
    outcome, detail = run_case(CASES["test_nonmaxsuppression_center_point_box_format"])
    assert outcome == "import" and "static shape" in detail
    assert run_case(CASES["test_bernoulli"])[0] == "unsupported"


def test_sweep_prints_per_op_and_per_stage_totals(capsys, tmp_path):
    assert main(["--filter", "test_add", "--stage", "import", "--jobs", "1", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "node tests over" in out and "passed 8" in out and "through stage 'import'" in out
    assert '"outcome": "pass"' in (tmp_path / "r.json").read_text()


def _crashing_or_hanging(case, stage="run"):
    if case.name == "test_abs":
        os._exit(3)
    if case.name == "test_acos":
        time.sleep(60)
    return "pass", ""


def test_a_worker_that_dies_or_overruns_is_counted_and_replaced(monkeypatch, capsys):
    monkeypatch.setattr(conformance, "run_case", _crashing_or_hanging)
    assert main(["--filter", "test_a", "--stage", "import", "--jobs", "2", "--timeout", "3", "--show-failures"]) == 0
    out = capsys.readouterr().out
    assert "test_abs: crash: worker died (exit 3)" in out and "test_acos: timeout: over 3 s" in out
    assert re.search(r"passed \d+, failed 2\b", out)
