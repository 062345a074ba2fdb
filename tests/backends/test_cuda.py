"""CUDA code generation without a GPU: every corpus model compiles for sm_80, nvcc building each kernel.

Running CUDA artifacts needs a GPU: those tests are marked `gpu`.
"""
from __future__ import annotations

import shutil

import pytest

from compiler.api import compile
from tests.conftest import POSITIVE, by_name

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@needs_nvcc
@pytest.mark.parametrize("model", by_name(POSITIVE))
def test_corpus_model_compiles_for_cuda_with_nvcc(model, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "cuda-kernel-cache"
    artifact = compile(model.path, input_shapes=model.input_shapes, target="cuda:sm_80", cache_dir=cache)
    kernels = artifact.directory / "kernels"
    libraries = sorted(kernels.glob("*.so"))
    assert libraries and len(libraries) == artifact.report()["kernels"]
    for library in libraries:
        assert library.with_suffix(".cu").read_text().count("__global__") >= 1
        assert library.with_suffix(".fatbin").stat().st_size > 0
