"""Shared fixtures: the model corpus and onnxruntime as the numerical reference."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tessel.compiler.corpus import CorpusModel, load_corpus

CORPUS = load_corpus()  # raises CorpusMissingError with a clear message when ../shared/models is absent
POSITIVE = [m for m in CORPUS if not m.negative]
NEGATIVE = [m for m in CORPUS if m.negative]


def run_onnxruntime(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of onnxruntime (one thread, no graph optimisation) on a model path, bytes or proto."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def by_name(models: list[CorpusModel]):
    """pytest.param per model, with the model name as id."""
    return [pytest.param(m, id=m.name) for m in models]


@pytest.fixture(scope="session")
def tessel_cache(tmp_path_factory):
    """One cache root ($TESSEL_CACHE_DIR) for the whole test session, empty at its start."""
    return tmp_path_factory.mktemp("tessel-cache")


@pytest.fixture(scope="session")
def kernel_cache(tessel_cache):
    """The session's kernel cache: `kernels/` of its cache root, where a compile under that root puts kernels."""
    return tessel_cache / "kernels"


def assert_matches_onnxruntime(outputs: dict, expected: list, rtol: float = 1e-3, atol: float = 1e-4) -> None:
    """Tessel's outputs (by name, in model order) equal onnxruntime's."""
    assert len(outputs) == len(expected)
    for got, want in zip(outputs.values(), expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def gpu_available() -> bool:
    """Whether TVM sees a CUDA GPU here (its CUDA runtime loads only where a driver is installed)."""
    from tessel.backends.tvm_env import tvm

    return bool(tvm().cuda(0).exist)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped where there is no GPU."""
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if gpu_tests and not gpu_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; TVM sees none here")
        for item in gpu_tests:
            item.add_marker(skip)
