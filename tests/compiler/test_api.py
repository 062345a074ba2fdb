"""compiler.compile / Artifact / compiler.load on the corpus."""
from __future__ import annotations

import pytest

from tessel.compiler.api import CompileError, compile, load
from tessel.runtime.errors import ArtifactError
from tests.conftest import POSITIVE, assert_matches_onnxruntime, by_name, run_onnxruntime


@pytest.mark.parametrize("model", by_name(POSITIVE))
def test_corpus_model_compiles_for_llvm_and_matches_onnxruntime(model, kernel_cache):
    artifact = compile(model.path, input_shapes=model.input_shapes, cache_dir=kernel_cache)
    feeds = model.make_inputs()
    expected = run_onnxruntime(str(model.path), feeds)
    # Poisoned arena: a kernel that reads activation memory nobody wrote this run gives NaN.
    for _ in range(2):
        artifact.executor().poison()
        assert_matches_onnxruntime(artifact.run(feeds), expected)


def test_second_compile_hits_the_cache_and_is_ten_times_faster(tmp_path):
    model = next(m for m in POSITIVE if m.name == "oww_embedding")
    first = compile(model.path, input_shapes=model.input_shapes, cache_dir=tmp_path)
    second = compile(model.path, input_shapes=model.input_shapes, cache_dir=tmp_path)
    assert first.report()["kernels_compiled"] > 0
    assert second.report()["kernels_compiled"] == 0 and second.report()["kernels_cached"] == first.report()["kernels"]
    # Timed on the kernel stage, the cache's own: the rest of a compile (import, passes, the report's charts) is
    # the same work both times.
    cold, warm = first.report()["seconds"]["kernels"], second.report()["seconds"]["kernels"]
    assert cold >= 10 * warm, f"kernel stage cold {cold:.2f}s vs warm {warm:.2f}s"


def test_saved_artifact_loads_and_runs(tmp_path, kernel_cache):
    model = next(m for m in POSITIVE if m.name == "mtcnn_onet")
    artifact = compile(model.path, input_shapes=model.input_shapes, cache_dir=kernel_cache)
    saved = artifact.save(tmp_path / "onet")
    assert {p.name for p in saved.iterdir()} >= {"plan.json", "kernels", "weights.npz", "graph.json", "reports"}
    assert not (saved / "model.onnx").exists()  # kept only with keep_model=True
    feeds = model.make_inputs()
    assert_matches_onnxruntime(load(saved).run(feeds), run_onnxruntime(str(model.path), feeds))
    with pytest.raises(ArtifactError, match="already exists"):
        artifact.save(saved)


@pytest.mark.parametrize("options,match", [
    ({"devices": 0}, "devices=0"), ({"microbatches": 0}, "microbatches=0"),
    ({"microbatches": 3}, "not a multiple of 3"),
    ({"devices": 2, "placement": "pipeline", "pins": [".*=1"]}, "--pin works with"),
])
def test_bad_placement_options_are_refused(options, match, tmp_path):
    model = next(m for m in POSITIVE if m.name == "mtcnn_pnet")
    with pytest.raises(CompileError, match=match):
        compile(model.path, input_shapes=model.input_shapes, cache_dir=tmp_path, profile=False, **options)


def test_the_package_offers_compile_and_load():
    from tessel import compiler
    from tessel.compiler import api

    assert compiler.compile is api.compile and compiler.load is api.load
