"""Winograd on NCHW[16]c inputs (backends/cpu/winograd_blocks.py): never the default, and where algorithm
selection chooses it the values around it stay blocked."""
from __future__ import annotations

import numpy as np
from onnx import helper

from tessel import ir
from tessel.backends.cpu.algorithms import default_algorithm
from tessel.backends.kernel import ALGORITHM
from tessel.backends.target import parse_target
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import build_program
from tessel.ir.types import TensorType
from tests.ir.helpers import F, model

LLVM = parse_target("llvm")


def _conv(name, x, out, channels_in, channels_out, rng, kernel=3):
    weight = (rng.standard_normal((channels_out, channels_in, kernel, kernel)) / np.sqrt(channels_in * kernel ** 2))
    bias = rng.standard_normal(channels_out).astype(np.float32)
    node = helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [out], kernel_shape=[kernel, kernel],
                            pads=[kernel // 2] * 4)
    return node, [(f"{name}_w", weight.astype(np.float32)), (f"{name}_b", bias)]


def block_model(batch: int, size: int, channels: int, out_channels: int):
    """x → a: 1×1 conv + ReLU → b: 3×3 conv + ReLU → c: 3×3 conv + a (residual) + ReLU, as ResNet's basic block,
    then d: a 3×3 conv to 16 channels, the model output (NCHW). b, c and d read blocked inputs."""
    rng = np.random.default_rng(3)
    convs = [_conv("a", "x", "a_conv", 16, channels, rng, kernel=1),
             _conv("b", "a", "b_conv", channels, out_channels, rng),
             _conv("c", "b", "c_conv", out_channels, channels, rng), _conv("d", "c", "d", channels, 16, rng)]
    nodes = [convs[0][0], helper.make_node("Relu", ["a_conv"], ["a"]),
             convs[1][0], helper.make_node("Relu", ["b_conv"], ["b"]),
             convs[2][0], helper.make_node("Add", ["c_conv", "a"], ["c_sum"]),
             helper.make_node("Relu", ["c_sum"], ["c"]),
             convs[3][0]]
    weights = [w for _, pair in convs for w in pair]
    return model(nodes, [("x", F, [batch, 16, size, size])], [("d", F, None)], weights)


def test_winograd_is_never_the_default_and_a_chosen_one_keeps_the_blocks():
    # Not a default (its 6 × 6 transformed weights would pass the artifact's 1.1× of its ONNX file): algorithm
    # selection chooses it.
    attrs = {"pads": [1] * 4, "strides": [1, 1], "dilations": [1, 1], "group": 1}
    x = TensorType("float32", (1, 64, 56, 56))
    assert default_algorithm("Conv", attrs, [x, None], [None, np.ones((64, 64, 3, 3), np.float32)], "llvm",
                             True) != "winograd"
    # In a program where it is chosen for b, c and d: they read blocked values, and the values between them stay
    # blocked.
    graph, _ = run_pipeline(ir.from_onnx(block_model(1, 16, 32, 32)), select_passes([]))
    names = [name for node in graph.nodes[1:]
             for name in [node.name] + [m.name for m in (node.attrs["body"].nodes if "body" in node.attrs else [])]]
    program = build_program(graph, LLVM, choices={name: (("winograd", 1),) for name in names})
    chosen = sorted(str(dict(m.spec.attrs).get(ALGORITHM)) for spec in program.kernels.values()
                    for m in spec.members() if m.spec.op_type == "Conv")
    assert chosen == ["None", "winograd", "winograd", "winograd"]
    assert set(program.blocked) == {"a", "b", "c"}
