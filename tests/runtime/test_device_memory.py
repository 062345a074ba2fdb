"""Buffers in TVM device memory, checked on the host (TVM's cpu device): the GPU path without a GPU."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from tessel.compiler.api import compile
from tessel.runtime.device_memory import DeviceMemory
from tessel.runtime.errors import ArtifactError
from tessel.runtime.executor import Executor
from tests.conftest import POSITIVE, assert_matches_onnxruntime, gpu_available, run_onnxruntime
from tests.runtime.test_executor import _if_model


@pytest.fixture
def memory():
    from tessel.backends.tvm_env import tvm

    return DeviceMemory(tvm().cpu(0), 1024)


def test_views_share_the_arena_at_their_offsets(memory):
    values = np.arange(32, dtype=np.float32).reshape(2, 16)
    a = memory.at(64, (2, 16), np.float32)
    memory.write(a, values)
    np.testing.assert_array_equal(memory.read(memory.reshape(a, (32,))), values.reshape(-1))
    np.testing.assert_array_equal(memory.read(memory.rows(a, 1, 2)), values[1:])
    b = memory.at(256, (2, 16), np.float32)
    memory.copy(b, a)
    np.testing.assert_array_equal(memory.read(memory.at(256 + 64, (16,), np.float32)), values[1])
    memory.fill(0xFF)
    assert np.isnan(memory.read(a)).all()


@pytest.mark.parametrize("name", ["silero_vad", "mtcnn_onet"])
def test_corpus_model_on_device_memory_matches_onnxruntime(name, kernel_cache):
    model = next(m for m in POSITIVE if m.name == name)
    artifact = compile(model.path, input_shapes=model.input_shapes, cache_dir=kernel_cache)
    executor = Executor(artifact.directory, memory_device="cpu")
    feeds = model.make_inputs()
    executor.poison()
    assert_matches_onnxruntime(executor.run(feeds), run_onnxruntime(str(model.path), feeds))


def test_if_on_device_memory_reads_its_condition_every_run(kernel_cache):
    original = _if_model()
    artifact = compile(original, cache_dir=kernel_cache)
    executor = Executor(artifact.directory, memory_device="cpu")
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    for flag in (True, False, True):
        feeds = {"x": x, "c": np.array(flag)}
        np.testing.assert_array_equal(executor.run(feeds)["y"], run_onnxruntime(original, feeds)[0])


@pytest.mark.skipif(shutil.which("nvcc") is None or gpu_available(), reason="needs nvcc and no GPU")
def test_cuda_artifact_without_a_gpu_is_refused_in_one_line(tmp_path):
    artifact = compile(_if_model(), target="cuda:sm_80", cache_dir=tmp_path / "cache")
    with pytest.raises(ArtifactError, match="does not see here") as info:
        artifact.run({"x": np.zeros((2, 3), np.float32), "c": np.array(True)})
    assert "\n" not in str(info.value)
