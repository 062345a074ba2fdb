"""CUDA artifacts on a GPU: every corpus model compiled for the GPU here equals onnxruntime.

Marked `gpu`: skipped where TVM sees no CUDA device (tests/conftest.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from tessel.compiler.api import compile
from tests.conftest import POSITIVE, assert_matches_onnxruntime, by_name, run_onnxruntime

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_target() -> str:
    """cuda:sm_XX for the GPU of this machine."""
    from tessel.backends.tvm_env import tvm

    return "cuda:sm_" + tvm().cuda(0).compute_version.replace(".", "")


@pytest.mark.parametrize("model", by_name(POSITIVE))
def test_corpus_model_runs_on_the_gpu_and_matches_onnxruntime(model, gpu_target, tmp_path_factory):
    artifact = compile(model.path, input_shapes=model.input_shapes, target=gpu_target,
                       cache_dir=tmp_path_factory.getbasetemp() / "gpu-kernel-cache")
    feeds = model.make_inputs()
    expected = run_onnxruntime(str(model.path), feeds)
    for _ in range(2):
        artifact.executor().poison()
        assert_matches_onnxruntime(artifact.run(feeds), expected)


def test_gpu_profile_times_every_step(gpu_target, tmp_path):
    model = next(m for m in POSITIVE if m.name == "mtcnn_onet")
    artifact = compile(model.path, input_shapes=model.input_shapes, target=gpu_target, cache_dir=tmp_path)
    rows = artifact.executor().profile(model.make_inputs(), runs=3)
    assert len(rows) == len(artifact.plan["workers"][0]["instructions"]) and all(np.isfinite(ms) and ms >= 0 for _, _, ms in rows)
