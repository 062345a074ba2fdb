"""Weights computed by ops (float16 storage Cast to float32, ConstantOfShape, Transpose) compile to the same
kernels, schedules and packed weights as the same weights given as initializers, however large they are."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile as compile_model
from tessel.passes.constant_fold import DEFAULT_LIMIT_BYTES
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model

RNG = np.random.default_rng(7)
# A 3x3 conv whose float32 weight (1.2 MB) is over the constant-folding cap.
OUT_CHANNELS, IN_CHANNELS, SIDE = 256, 128, 6
WEIGHT_SHAPE = (OUT_CHANNELS, IN_CHANNELS, 3, 3)


def _conv_model(weight_nodes: list, initializers: list):
    """x → Conv(w, b) → Relu, with `w` made by `weight_nodes` from `initializers`."""
    bias = RNG.standard_normal(OUT_CHANNELS).astype(np.float32)
    nodes = weight_nodes + [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                            helper.make_node("Relu", ["c"], ["y"])]
    return model(nodes, [("x", F, [1, IN_CHANNELS, SIDE, SIDE])], [("y", F, [1, OUT_CHANNELS, SIDE, SIDE])],
                 initializers + [("b", bias)])


def _cast_from_float16():
    half = RNG.standard_normal(WEIGHT_SHAPE).astype(np.float16)
    return (_conv_model([helper.make_node("Cast", ["w16"], ["w"], to=TensorProto.FLOAT)], [("w16", half)]),
            half.astype(np.float32))


def _constant_of_shape():
    fill = numpy_helper.from_array(np.array([0.01], dtype=np.float32))
    return (_conv_model([helper.make_node("ConstantOfShape", ["shape"], ["w"], value=fill)],
                        [("shape", np.array(WEIGHT_SHAPE, dtype=np.int64))]),
            np.full(WEIGHT_SHAPE, 0.01, dtype=np.float32))


def _transposed():
    stored = RNG.standard_normal((IN_CHANNELS, OUT_CHANNELS, 3, 3)).astype(np.float32)
    return (_conv_model([helper.make_node("Transpose", ["wt"], ["w"], perm=[1, 0, 2, 3])], [("wt", stored)]),
            np.ascontiguousarray(stored.transpose(1, 0, 2, 3)))


def _plan(artifact, directory) -> dict:
    return json.loads((artifact.save(directory) / "plan.json").read_text())


def _kernels_run(plan: dict) -> list[tuple]:
    """Per instruction: its kernel (the key hashes the op, algorithm, schedule and packing), its signature, and
    whether it runs at load."""
    kernels = plan["kernels"]
    return [(i.get("kernel"), tuple(kernels[i["kernel"]]["signature"]) if "kernel" in i else None, i.get("init", False))
            for worker in plan["workers"] for i in worker["instructions"]]


def test_weight_over_the_cap():
    assert np.prod(WEIGHT_SHAPE) * 4 > DEFAULT_LIMIT_BYTES


@pytest.mark.parametrize("make", [_cast_from_float16, _constant_of_shape, _transposed],
                         ids=["cast_float16", "constant_of_shape", "transpose"])
def test_computed_weight_runs_the_initializer_kernels(make, kernel_cache, tmp_path):
    computed, weight = make()
    plain = _conv_model([], [("w", weight)])
    plain.graph.initializer[-1].CopyFrom(computed.graph.initializer[-1])  # the same bias
    compiled = compile_model(computed, cache_dir=kernel_cache)
    reference = compile_model(plain, cache_dir=kernel_cache)
    runs = _kernels_run(_plan(compiled, tmp_path / "computed"))
    assert runs == _kernels_run(_plan(reference, tmp_path / "plain"))
    assert [init for *_, init in runs] == [False]  # one conv kernel, its weight packed at compile time
    x = RNG.standard_normal((1, IN_CHANNELS, SIDE, SIDE)).astype(np.float32)
    assert_matches_onnxruntime(compiled.run({"x": x}), run_onnxruntime(computed, {"x": x}))
