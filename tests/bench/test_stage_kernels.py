"""bench/stage_kernels.py: a pipeline's stage programs timed kernel by kernel, against the one-worker program."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("stage_kernels", REPO / "bench" / "stage_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mlp():
    """Four MatMul+Relu layers (big enough that a two-stage pipeline splits them: as tests/runtime/test_session.py)."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for k in range(4):
        weights.append(numpy_helper.from_array((rng.standard_normal((256, 256)) * 0.1).astype(np.float32), f"w{k}"))
        nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]), helper.make_node("Relu", [f"m{k}"], [f"r{k}"])]
        x = f"r{k}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 256])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [16, 256])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.slow
def test_each_stage_times_its_own_kernels_and_the_stages_cover_the_model(kernel_cache, capsys):
    pipeline = compile(_mlp(), devices=2, placement="pipeline", microbatches=2, profile=False, cache_dir=kernel_cache)
    one = compile(_mlp(), cache_dir=kernel_cache)
    bench = _bench()
    stages = [bench.node_us(str(pipeline.directory), worker, runs=2) for worker in range(2)]
    whole = bench.node_us(str(one.directory), 0, runs=2)
    # Every kernel node runs on exactly one stage, and its time was measured (the transfers were skipped).
    assert stages[0] and stages[1] and not stages[0].keys() & stages[1].keys()
    assert stages[0].keys() | stages[1].keys() == whole.keys()
    assert all(us > 0 for times in [*stages, whole] for us in times.values())
