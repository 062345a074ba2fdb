"""Compile a corpus model with Tessel's Python API, run it, and save the artifact.

    python examples/compile_and_run.py [MODEL.onnx] [ARTIFACT_DIR]

By default it compiles ResNet-18 from the shared model corpus (../shared/models) and saves the artifact into a
temporary directory removed at the end; give ARTIFACT_DIR to keep it.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import tessel
from tessel.compiler.corpus import models_dir


def main(argv: list[str]) -> int:
    model = Path(argv[0]) if argv else models_dir() / "resnet18.onnx"
    if len(argv) > 1:
        return compile_run_save(model, Path(argv[1]))
    # No destination given: save into a temporary directory that goes away with the example (150 MB for ResNet-18).
    with tempfile.TemporaryDirectory(prefix="tessel-example-") as scratch:
        return compile_run_save(model, Path(scratch) / "resnet18")


def compile_run_save(model: Path, destination: Path) -> int:
    """Compile `model`, run it, save the artifact to `destination` and check that the saved one runs alike."""
    artifact = tessel.compile(model, target="llvm", input_shapes={"input": (1, 3, 224, 224)})
    print(f"inputs: {artifact.inputs}  outputs: {artifact.outputs}")
    image = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    scores = artifact.run({"input": image})["output"]
    started = time.perf_counter()
    artifact.run({"input": image})
    print(f"top-5 classes: {np.argsort(scores[0])[::-1][:5].tolist()}  latency: {1e3 * (time.perf_counter() - started):.1f} ms")
    saved = artifact.save(destination)
    again = tessel.load(saved).run({"input": image})["output"]
    print(f"saved to {saved}; reloaded run matches: {bool(np.array_equal(again, scores))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
