"""Compile a corpus model with Tessel's Python API, run it, and save the artifact.

    python examples/compile_and_run.py [MODEL.onnx] [ARTIFACT_DIR]

By default it compiles ResNet-18 from the shared model corpus (../shared/models).
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
    destination = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="tessel-example-")) / "resnet18"
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
