"""CUDA code generation without a GPU: every corpus model compiles for sm_80, nvcc building each kernel.

Running CUDA artifacts needs a GPU: those tests are marked `gpu`.
"""
from __future__ import annotations

import shutil

import pytest

from tessel.compiler.api import compile
from tests.conftest import POSITIVE

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")


def carries_fatbin(library) -> bool:
    """Whether a kernel library embeds an nvcc fatbin (a GPU can load it without compiling anything)."""
    return FATBIN_MAGIC in library.read_bytes()


# The largest models take 20 s to a minute each through nvcc: `pytest -m slow` builds them, the rest cover the same
# op kinds (plain, grouped and depthwise convolutions, RNNs, attention) in the default run.
SLOW_CUDA_BUILDS = {"topology_densenet121", "ppocr_v4_det", "yolov8n_320", "topology_inception_v1", "topology_inception_v2",
                    "topology_resnet50", "ppocr_v4_rec", "topology_vgg19"}


@needs_nvcc
@pytest.mark.parametrize("model", [pytest.param(m, id=m.name, marks=[pytest.mark.slow] if m.name in SLOW_CUDA_BUILDS else [])
                                   for m in POSITIVE])
def test_corpus_model_compiles_for_cuda_with_nvcc(model, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "cuda-kernel-cache"
    artifact = compile(model.path, input_shapes=model.input_shapes, target="cuda:sm_80", cache_dir=cache)
    kernels = artifact.directory / "kernels"
    libraries = sorted(kernels.glob("*.so"))
    assert libraries and len(libraries) == artifact.report()["kernels"]
    for library in libraries:
        assert library.with_suffix(".cu").read_text().count("__global__") >= 1
        assert carries_fatbin(library)


@needs_nvcc
@pytest.mark.parametrize("algorithm", ["gemm", "direct"])
def test_conv_algorithms_compile_for_cuda_with_nvcc(algorithm, tmp_path):
    from tessel import ir
    from tessel.backends.builder import build_kernels
    from tessel.backends.cache import KernelCache
    from tessel.backends.target import parse_target
    from tessel.compiler.algo import find_layers
    from tessel.compiler.pipeline import run_pipeline, select_passes
    from tessel.compiler.program import ProgramBuilder
    from tests.backends.test_algorithms import CONVS, conv_relu_model

    target = parse_target("cuda:sm_80")
    graph, _ = run_pipeline(ir.from_onnx(conv_relu_model(**CONVS["3x3_pad1"])), select_passes([]))
    (layer,) = find_layers(graph, "cuda", "powers-of-two")
    assert layer.algorithms == ("gemm", "direct")
    builder = ProgramBuilder(target)
    specs = {}
    for size in (layer.batch, 1):
        spec, _ = builder.candidate(layer.node, algorithm, size)
        specs[spec.key(target)] = spec
    cache = KernelCache(tmp_path)
    build_kernels(specs, target, cache)
    for key in specs:
        assert cache.library(key).with_suffix(".cu").read_text().count("__global__") >= 1
        assert carries_fatbin(cache.library(key))
