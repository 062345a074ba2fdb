"""`precision="bf16"` / `"auto"` (compiler/precision.py): which precision a compile uses, and what it reports."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import helper

from tessel.backends.cpu.bf16 import cpu_has_bf16
from tessel.compiler.api import compile as compile_model
from tessel.compiler.precision import BF16_MIN_FLOP_SHARE, choose_precision, flop_share
from tessel.ir import from_onnx
from tests.ir.helpers import F, model

RNG = np.random.default_rng(3)


def _conv_then_matmul(columns: int):
    """A 3x3 conv (16 -> 32 channels, 8 x 8) then a MatMul whose size sets the conv's share of the FLOPs."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1] * 4), helper.make_node("Reshape", ["c", "shape"], ["r"]),
             helper.make_node("MatMul", ["r", "m"], ["y"])]
    return model(nodes, [("x", F, [1, 16, 8, 8])], [("y", F, None)],
                 [("w", RNG.standard_normal((32, 16, 3, 3)).astype(np.float32)),
                  ("shape", np.array([32, 64], np.int64)),
                  ("m", RNG.standard_normal((64, columns)).astype(np.float32))])


def _choose(requested: str, columns: int, target: str = "llvm", has_bf16: bool = True):
    graph = from_onnx(_conv_then_matmul(columns))
    conv = next(node.name for node in graph.nodes if node.op_type == "Conv")
    return choose_precision(requested, graph, target, lambda: {conv: "Conv"}, lambda: has_bf16), graph, conv


def test_the_conv_share_of_the_flops_decides_auto():
    small, graph, conv = _choose("auto", 16)  # conv 589,824 FLOPs, matmul 65,536
    assert flop_share(graph, {conv: "Conv"}) > BF16_MIN_FLOP_SHARE
    assert (small.used, small.bf16_nodes) == ("bf16", {conv: "Conv"}) and "avx512_bf16" in small.reason
    large, _, _ = _choose("auto", 4096)  # the matmul dominates: bf16 would speed up little
    assert large.used == "fp32" and not large.bf16_nodes and "of the FLOPs" in large.reason
    asked, _, _ = _choose("bf16", 4096)  # asked for, bf16 runs whatever the share
    assert asked.used == "bf16" and asked.reason == "as requested"


def test_auto_falls_back_to_fp32_without_the_cpu_feature_or_on_a_gpu_and_fp32_stays_fp32():
    assert _choose("auto", 16, has_bf16=False)[0].to_json()["reason"] == "this CPU lacks avx512_bf16"
    assert _choose("auto", 16, target="cuda")[0].used == "fp32"
    plain = _choose("fp32", 16)[0]
    assert (plain.used, plain.bf16_nodes, plain.bf16_flop_share) == ("fp32", {}, 0.0)


@pytest.mark.skipif(not cpu_has_bf16(), reason="the CPU lacks avx512_bf16")
def test_the_report_and_plan_say_which_ops_run_in_bf16(kernel_cache):
    artifact = compile_model(_conv_then_matmul(16), precision="auto", cache_dir=kernel_cache)
    report = artifact.report()["precision"]
    assert report["requested"] == "auto" and report["used"] == "bf16"
    assert list(report["bf16_nodes"].values()) == ["Conv"] and report["bf16_flop_share_source"] == "estimated"
    assert json.loads((artifact.directory / "plan.json").read_text()).get("precision") == "bf16"
    fp32 = compile_model(_conv_then_matmul(16), cache_dir=kernel_cache)
    assert fp32.report()["precision"]["used"] == "fp32"
    assert "precision" not in json.loads((fp32.directory / "plan.json").read_text())
