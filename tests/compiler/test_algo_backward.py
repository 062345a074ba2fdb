"""Algorithm and micro-batch selection of a training step's backward convolutions (compiler/algo.py): the
ConvTranspose and ConvGradFilter layers are found with their algorithms, and a step compiled with micro-batches
forced on them (ConvGradFilter's pieces summed into dW) trains exactly as the step without selection."""
from __future__ import annotations

import json

import numpy as np
from onnx import helper

import tessel
from tessel.compiler import algo
from tessel.passes.algo_select import Config
from tests.ir.helpers import F, model

BATCH = 4


def _cnn():
    """Conv-Relu, strided Conv-Relu, global average pool, a linear classifier: x (4, 3, 8, 8) → 10 classes."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["h2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["h2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["logits"], transB=1)]
    return model(nodes, [("x", F, [BATCH, 3, 8, 8])], [("logits", F, [BATCH, 10])],
                 [("w1", (0.3 * rng.standard_normal((8, 3, 3, 3))).astype(np.float32)),
                  ("w2", (0.2 * rng.standard_normal((16, 8, 3, 3))).astype(np.float32)),
                  ("w3", (0.3 * rng.standard_normal((10, 16))).astype(np.float32)),
                  ("b3", np.zeros(10, np.float32))])


def _compile(cache, **options):
    return tessel.compile_training(_cnn(), loss="cross_entropy", optimizer=tessel.optim.SGD(lr=0.1, momentum=0.9),
                                   input_shapes={"x": (BATCH, 3, 8, 8)}, cache_dir=cache, **options)


def _train(trainer, steps: int = 3) -> list[float]:
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        x = rng.standard_normal((BATCH, 3, 8, 8)).astype(np.float32)
        losses.append(trainer.step({"x": x}, rng.integers(0, 10, BATCH).astype(np.int64)))
    return losses


def _forcing_micro_batches(monkeypatch):
    """Make the selection run every divisible backward layer as pieces 2 (tiled) + 2 (generic): both algorithms,
    and ConvGradFilter's sum across them. Returns the layers the selection saw."""
    seen = []
    real = algo.select

    def select(layers, timing, mode, limit, source, policy):
        selection = real(layers, timing, mode, limit, source, policy)
        seen.extend(layers)
        for layer in layers:
            if layer.anchor in ("ConvTranspose", "ConvGradFilter") and layer.sizes == (1, 2, 4):
                selection.chosen[layer.node.name] = Config((("tiled", 2), ("generic", 2)), 1.0, 0, False)
        return selection

    monkeypatch.setattr(algo, "select", select)
    return seen


def test_backward_micro_batches_train_as_the_whole_batch(kernel_cache, monkeypatch):
    whole = _compile(kernel_cache)
    plain = _train(whole)
    seen = _forcing_micro_batches(monkeypatch)
    chosen = _compile(kernel_cache, algo_select="dp", profile_budget=0.0)
    ops = sorted(layer.anchor for layer in seen)
    assert ops == ["ConvGradFilter", "ConvGradFilter", "ConvTranspose"]
    summed = [layer for layer in seen if layer.summing]
    assert [layer.anchor for layer in summed] == ["ConvGradFilter", "ConvGradFilter"]
    assert all(layer.algorithms == ("tiled", "generic") and layer.sizes == (1, 2, 4) for layer in seen)
    np.testing.assert_allclose(_train(chosen), plain, rtol=1e-5)
    for name in ("w1", "w2", "w3", "b3"):
        np.testing.assert_allclose(chosen.state[name], whole.state[name], rtol=1e-5, atol=1e-6)
    doc = json.loads((chosen.step_artifact.directory / "reports" / "algo.json").read_text())
    rows = {r["op"]: r for r in doc["layers"]}
    assert rows["ConvGradFilter"]["micro_batches"] == "summed" and rows["ConvTranspose"]["micro_batches"] == "sliced"
    assert rows["ConvGradFilter"]["chosen"]["describe"] == "tiled 2, generic 2"
    assert all(r["chosen"]["source"] == "estimated" and r["best_single"]["source"] == "estimated" for r in doc["layers"])
    assert "ConvGradFilter (pieces summed)" in (chosen.step_artifact.directory / "reports" / "algo.md").read_text()
