"""The CPU upsampling ConvTranspose (backends/cpu/conv_transpose_upsample.py): kernel == strides, no pads, constant
weights; equal to onnxruntime, alone and with its fused epilogue, and chosen only where it applies."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel import ir
from tessel.backends.kernel import ALGORITHM
from tessel.backends.lower import schedule_kernel
from tessel.backends.target import parse_target
from tessel.compiler.api import compile
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import build_program
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model

LLVM = parse_target("llvm")

# (x shape, output channels, stride, bias, epilogue ops): ppocr_v4_det's two upsamplings at small sizes (24 → 24 with
# BatchNorm and Relu after it, 24 → 1 with Sigmoid), odd widths (rows that fill no whole vector), a batch of two,
# without bias, and a 3 × 3 kernel of stride 3.
CASES = [((1, 24, 8, 16), 24, 2, True, ("BatchNormalization", "Relu")), ((1, 24, 6, 20), 1, 2, True, ("Sigmoid",)),
         ((1, 24, 5, 7), 24, 2, False, ()), ((1, 24, 3, 13), 1, 2, True, ()), ((2, 24, 4, 16), 24, 2, True, ("Relu",)),
         ((2, 24, 4, 9), 1, 2, False, ("Sigmoid",)), ((1, 5, 4, 9), 24, 3, True, ()), ((2, 8, 3, 16), 3, 3, False, ())]


def _model(shape, channels: int, stride: int, bias: bool, epilogue, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((shape[1], channels, stride, stride)).astype(np.float32)
    consts = [("w", w)] + ([("b", rng.standard_normal(channels).astype(np.float32))] if bias else [])
    nodes = [helper.make_node("ConvTranspose", ["x", "w"] + (["b"] if bias else []), ["t0"],
                              kernel_shape=[stride, stride], strides=[stride, stride])]
    for k, op in enumerate(epilogue):
        inputs = [f"t{k}"]
        if op == "BatchNormalization":
            for name, value in (("scale", 1.0), ("shift", 0.0), ("mean", 0.0), ("var", 1.0)):
                consts.append((name, (value + 0.5 * rng.standard_normal(channels) ** (2 if name == "var" else 1))
                               .astype(np.float32)))
            inputs += ["scale", "shift", "mean", "var"]
        nodes.append(helper.make_node(op, inputs, [f"t{k + 1}"]))
    nodes.append(helper.make_node("Identity", [f"t{len(epilogue)}"], ["y"]))
    return model(nodes, [("x", F, list(shape))], [("y", F, None)], consts)


@pytest.mark.parametrize("case", CASES, ids=[f"{'x'.join(map(str, c[0]))}-{c[1]}-s{c[2]}{'-b' if c[3] else ''}"
                                             f"{''.join('-' + op for op in c[4])}" for c in CASES])
def test_upsampling_equals_onnxruntime(case, kernel_cache):
    shape, channels, stride, bias, epilogue = case
    onnx_model = _model(shape, channels, stride, bias, epilogue)
    graph, _ = run_pipeline(ir.from_onnx(onnx_model), select_passes([]))
    (spec,) = [s for s in build_program(graph, LLVM).kernels.values()
               if any(m.spec.op_type == "ConvTranspose" for m in s.members())]
    (anchor,) = [m.spec for m in spec.members() if m.spec.op_type == "ConvTranspose"]
    assert dict(anchor.attrs)[ALGORITHM] == "upsample"
    assert len(spec.members()) == 1 + len(epilogue)  # the epilogue is fused into the kernel
    func, scheduled = schedule_kernel(spec, LLVM)
    assert scheduled and "upsample_acc" in func.script()
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    assert_matches_onnxruntime(compile(onnx_model, cache_dir=kernel_cache).run({"x": x}),
                               run_onnxruntime(onnx_model, {"x": x}), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attrs", [{"kernel_shape": [4, 4], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                                   {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2]},
                                   {"kernel_shape": [2, 2], "strides": [2, 2], "output_padding": [1, 1]},
                                   {"kernel_shape": [2, 2], "strides": [2, 2], "group": 2}])
def test_other_conv_transposes_keep_the_tiled_kernel(attrs):
    groups = attrs.get("group", 1)
    w = np.ones((8, 8 // groups, *attrs["kernel_shape"]), np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)
    graph, _ = run_pipeline(ir.from_onnx(model([node], [("x", F, [1, 8, 6, 6])], [("y", F, None)], [("w", w)])),
                            select_passes([]))
    for spec in build_program(graph, LLVM).kernels.values():
        for member in spec.members():
            assert dict(member.spec.attrs).get(ALGORITHM) != "upsample"


def test_bf16_compiles_keep_the_upsampling():
    # bf16 drops the conv defaults that compete with its kernels (compiler/program.py), not this one: the bf16
    # kernels take no ConvTranspose.
    graph, _ = run_pipeline(ir.from_onnx(_model(*CASES[0])), select_passes([]))
    algorithms = [dict(member.spec.attrs).get(ALGORITHM) for spec in build_program(graph, LLVM, precision="bf16")
                  .kernels.values() for member in spec.members() if member.spec.op_type == "ConvTranspose"]
    assert algorithms == ["upsample"]
