"""Test accuracy of a trained digits model, run by onnxruntime (independent of Tessel).

    python examples/digits/evaluate.py RUN_DIR/model.onnx examples/digits/data/test.npz
"""
from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort


def accuracy(model_path: str, data_path: str) -> float:
    """The fraction of the data's digits whose largest logit is their label."""
    session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    with np.load(data_path, allow_pickle=False) as data:
        x, labels = data["x"], data["labels"]
    logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    return float((logits.argmax(axis=1) == labels).mean())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print(f"test accuracy: {100 * accuracy(argv[0], argv[1]):.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
