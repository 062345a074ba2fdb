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

