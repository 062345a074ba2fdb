"""Blocked layout between conv kernels: which values stay in NCHW[16]c, and outputs equal onnxruntime."""
from __future__ import annotations

import json

import numpy as np
from onnx import helper

from tessel import ir
from tessel.backends.kernel import ARG_BLOCKS, RESULT_BLOCKS
from tessel.compiler.api import compile
from tessel.backends.target import parse_target
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import build_program
from tessel.passes.conv_layout import blocked_values
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model


def _conv(name, x, out, channels_in, channels_out, rng, kernel=3, stride=1, group=1):
    weight = (rng.standard_normal((channels_out, channels_in // group, kernel, kernel)) / kernel / 4).astype(np.float32)
    bias = rng.standard_normal(channels_out).astype(np.float32)
    node = helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [out], kernel_shape=[kernel, kernel],
                            pads=[kernel // 2] * 4, strides=[stride, stride], group=group)
    return node, [(f"{name}_w", weight), (f"{name}_b", bias)]


def residual_model():
    """a: conv+relu → b: conv(a) + a + relu → d: conv(b) (stride 2, a model output) → c: conv(a) + b → pool.

    b dies at c, whose residual Add could overwrite it in place — but b is blocked and c's output is not.
    """
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    for conv in (_conv("a", "x", "a_conv", 16, 32, rng), _conv("b", "a", "b_conv", 32, 32, rng),
                 _conv("d", "b", "d", 32, 32, rng, stride=2), _conv("c", "a", "c_conv", 32, 32, rng, kernel=1),
                 _conv("g", "x", "g", 16, 16, rng, group=4), _conv("n", "g", "n_conv", 16, 18, rng)):
        nodes.append(conv[0])
        weights += conv[1]
    nodes[2:2] = [helper.make_node("Relu", ["a_conv"], ["a"]), helper.make_node("Add", ["b_conv", "a"], ["b_sum"]),
                  helper.make_node("Relu", ["b_sum"], ["b"])]
    nodes += [helper.make_node("Add", ["c_conv", "b"], ["c"]), helper.make_node("GlobalAveragePool", ["c"], ["pooled"]),
              helper.make_node("Relu", ["n_conv"], ["n"])]
    return model(nodes, [("x", F, [1, 16, 12, 12])], [("d", F, None), ("pooled", F, None), ("n", F, None)], weights)


def test_values_read_only_by_packed_convs_stay_blocked():
    graph, _ = run_pipeline(ir.from_onnx(residual_model()), select_passes([]))
    # a and b: read only by conv kernels; c: read by a pool; d: a model output; g: made by a grouped
    # conv; n: 18 channels (and a model output).
    assert blocked_values(graph) == {"a": 16, "b": 16}
    assert blocked_values(graph, lambda node: {"im2col"}) == {}
    program = build_program(graph, parse_target("llvm"))
    assert program.blocked == {"a": 16, "b": 16} and program.values["a"] == "float32[1,2,12,12,16]"
    layouts = sorted((16 in dict(spec.attrs)[ARG_BLOCKS], dict(spec.attrs)[RESULT_BLOCKS])
                     for spec in program.kernels.values() if ARG_BLOCKS in dict(spec.attrs))
    # a's producer writes blocks; b's reads a (conv input and residual) and writes b; d reads b; c reads a and b.
    assert layouts == [(False, (16,)), (True, (0,)), (True, (0,)), (True, (16,))]
    assert build_program(graph, parse_target("llvm"), blocked_layout=False).blocked == {}
    assert build_program(graph, parse_target("cuda:sm_80")).blocked == {}


def test_blocked_kernels_equal_onnxruntime_and_the_nchw_layout(kernel_cache):
    original = residual_model()
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 16, 12, 12)).astype(np.float32)}
    expected = run_onnxruntime(original, feeds)
    blocked = compile(original, cache_dir=kernel_cache)
    nchw = compile(original, cache_dir=kernel_cache, conv_layout="nchw")
    plan = json.loads((blocked.directory / "plan.json").read_text())
    assert plan["workers"][0]["values"]["b"] == "float32[1,2,12,12,16]"
    assert blocked.report()["conv_layout"] == {"mode": "blocked", "blocked_values": 2}
    assert nchw.report()["conv_layout"]["blocked_values"] == 0
    for artifact in (blocked, nchw):
        for _ in range(2):
            artifact.executor().poison()
            assert_matches_onnxruntime(artifact.run(feeds), expected)


def pass_through_model():
    """YOLOv8's C2f split and SPPF pools between convs: a (32 channels) → Split 16/16 → b reads the second half,
    c reads the concat of all three; c → MaxPool (5×5, pads 2) twice → e reads the concat of c and both pools. An
    unaligned Split (8/24) of e and a MaxPool of the model input stay NCHW."""
    rng = np.random.default_rng(2)
    nodes, weights = [], []
    for conv in (_conv("a", "x", "a", 16, 32, rng, kernel=1), _conv("b", "a1", "b", 16, 16, rng),
                 _conv("c", "abc", "c", 48, 32, rng, kernel=1), _conv("e", "cpp", "e", 96, 32, rng, kernel=1),
                 _conv("f", "e1", "f", 24, 16, rng), _conv("g", "xp", "g", 16, 16, rng)):
        nodes.append(conv[0])
        weights += conv[1]
    sizes16, sizes8 = np.array([16, 16], np.int64), np.array([8, 24], np.int64)
    weights += [("sizes16", sizes16), ("sizes8", sizes8)]
    pool = dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2], strides=[1, 1])
    nodes[1:1] = [helper.make_node("Split", ["a", "sizes16"], ["a0", "a1"], axis=1)]
    nodes[3:3] = [helper.make_node("Concat", ["a0", "a1", "b"], ["abc"], axis=1)]
    nodes[5:5] = [helper.make_node("MaxPool", ["c"], ["p1"], **pool),
                  helper.make_node("MaxPool", ["p1"], ["p2"], **pool),
                  helper.make_node("Concat", ["c", "p1", "p2"], ["cpp"], axis=1)]
    nodes[9:9] = [helper.make_node("Split", ["e", "sizes8"], ["e0", "e1"], axis=1)]
    nodes[11:11] = [helper.make_node("MaxPool", ["x"], ["xp"], **pool)]
    return model(nodes, [("x", F, [1, 16, 10, 12])], [("f", F, None), ("e0", F, None), ("g", F, None)], weights)


def test_slices_of_whole_blocks_and_max_pools_keep_the_blocks():
    graph, _ = run_pipeline(ir.from_onnx(pass_through_model()), select_passes([]))
    blocked = blocked_values(graph)
    # The split's second half and both pools pass the blocks through (the first half is read inside c's kernel);
    # e is cut at 8 channels and xp pools the NCHW model input.
    slices = [n.outputs[0].name for n in graph.nodes if n.op_type == "Slice"]
    assert {"a", "c", "p1", "p2"} <= set(blocked) and any(name in blocked for name in slices)
    assert "e" not in blocked and "xp" not in blocked
    program = build_program(graph, parse_target("llvm"))
    pools = [program.kernels[call.kernel] for call in program.instructions if call.op == "MaxPool"]
    assert sorted(dict(spec.attrs).get(RESULT_BLOCKS, (0,)) for spec in pools) == [(0,), (16,), (16,)]


def test_pass_through_kernels_on_blocks_equal_onnxruntime(kernel_cache):
    original = pass_through_model()
    x = np.random.default_rng(3).standard_normal((1, 16, 10, 12)).astype(np.float32)
    expected = run_onnxruntime(original, {"x": x})
    blocked = compile(original, cache_dir=kernel_cache)
    assert blocked.report()["conv_layout"]["blocked_values"] >= 5
    for _ in range(2):
        blocked.executor().poison()
        assert_matches_onnxruntime(blocked.run({"x": x}), expected)
    # A NaN in a pooled window is the window's max in both layouts (onnxruntime's pool keeps either operand).
    x[0, 3, 4, 5] = np.nan
    nchw = compile(original, cache_dir=kernel_cache, conv_layout="nchw")
    for got, want in zip(blocked.run({"x": x}).values(), nchw.run({"x": x}).values()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
