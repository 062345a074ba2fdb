"""Data-parallel training with compressed gradients (compile_training(compression=...): passes/data_parallel.py
marks the gradients' AllReduce nodes, runtime/comm.py all-gathers each worker's encoded bucket with error
feedback): top-k of every element trains exactly as the float32 all-reduce does, 1-bit trains and reports its
bytes per step, and a checkpoint keeps each worker's residuals so that a resumed run ends as an uninterrupted one."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tessel
from tessel.compiler.dp_training import compressed_bytes
from tessel.compiler.options import CompileError
from tessel.compiler.training import build_step_graph
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.passes.data_parallel import GradientCompression
from tessel.runtime.instructions import AllReduce, from_json
from tests.compiler.train_fixtures import write_classifier

STEPS, BATCH = 6, 8


def _train(model: Path, kernel_cache, host_first: bool = False, **options) -> tuple[list[float], dict, dict]:
    """STEPS steps on 2 workers: (losses, state, the data-parallel report); with `host_first`, after measuring the
    host's share of a step (Trainer.host_s), which runs steps of its own and then undoes them."""
    trainer = tessel.compile_training(str(model), loss="cross_entropy", optimizer=tessel.optim.SGD(lr=0.5),
                                      input_shapes={"x": (BATCH, 4)}, devices=2, cache_dir=kernel_cache, **options)
    try:
        if host_first:
            assert trainer.host_s(1) > 0 and trainer.steps_done == 0
        rng = np.random.default_rng(0)
        losses = []
        for _ in range(STEPS):
            x = rng.standard_normal((BATCH, 4)).astype(np.float32)
            losses.append(trainer.step({"x": x}, (x[:, 0] > 0).astype(np.int64)))
        report = json.loads((Path(trainer.step_artifact.directory) / "reports/data_parallel.json").read_text())
        return losses, trainer.state, report
    finally:
        trainer.close()


def test_the_gradients_all_reduce_records_its_compression_and_bytes(tmp_path):
    step = build_step_graph(str(write_classifier(tmp_path / "m.onnx")), {"x": (BATCH // 2, 4)}, "cross_entropy",
                            tessel.optim.SGD(lr=0.5), replicas=2,
                            compression=GradientCompression("1bit"))
    reduces = [n for n in step.graph.nodes if n.domain == TESSEL_DOMAIN and n.op_type == "AllReduce"]
    marked = [n for n in reduces if n.attrs.get("compression") == "1bit"]
    assert len(marked) == 1 and len(reduces) == 2  # the gradients' bucket; the loss's mean stays float32
    assert sorted(zip(marked[0].attrs["part_sizes"], marked[0].attrs["part_rows"])) == [(3, 1), (12, 3)]
    # W (3 x 4) and b (3): 3 + 1 segments of 2 bfloat16 means, then 15 sign bits, sent to the 1 peer.
    assert compressed_bytes(step.graph, 2) == {"codec": "1bit", "bytes_per_step": 4 * 4 + 2,
                                               "float32_ring_bytes_per_step": 4 * 15, "ratio": 60 / 18}
    instruction = AllReduce(node="n", op="AllReduce", tensor="g", reduction="mean", compression="topk",
                            topk_ratio=0.5, part_sizes=(12, 3), part_rows=(3, 1))
    assert from_json(json.loads(json.dumps(instruction.to_json()))) == instruction


@pytest.mark.slow  # three compiles and runs on 2 workers: ~70 s on the shared 2-core machine
def test_compressed_gradients_train_and_report_their_bytes(tmp_path, kernel_cache):
    model = write_classifier(tmp_path / "m.onnx")
    losses, state, report = _train(model, kernel_cache)
    assert report["compression"] is None
    # Top-k keeping every element sends indices and values: lossless, so the same training as float32.
    exact_losses, exact_state, exact_report = _train(model, kernel_cache, compression="topk", topk_ratio=1.0)
    np.testing.assert_allclose(exact_losses, losses, rtol=1e-6)
    for name, value in state.items():
        np.testing.assert_allclose(exact_state[name], value, atol=1e-6, err_msg=name)
    assert exact_report["compression"]["codec"] == "topk"
    one_bit_losses, _, one_bit = _train(model, kernel_cache, compression="1bit")
    assert one_bit_losses[-1] < one_bit_losses[0]
    assert one_bit["compression"]["bytes_per_step"] == 4 * 4 + 2


def test_measuring_the_host_share_leaves_no_error_feedback_behind(tmp_path, kernel_cache):
    # Its steps of ones make residuals where there were none: they must start from zero again, as on a fresh
    # trainer, or the next real steps (and a checkpoint) would carry them.
    model = write_classifier(tmp_path / "m.onnx")
    losses, state, _ = _train(model, kernel_cache, compression="1bit")
    measured_losses, measured_state, _ = _train(model, kernel_cache, host_first=True, compression="1bit")
    assert measured_losses == losses
    for name, value in state.items():
        np.testing.assert_array_equal(measured_state[name], value, err_msg=name)


def test_a_resumed_compressed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, kernel_cache):
    trainer = tessel.compile_training(str(write_classifier(tmp_path / "m.onnx")), loss="cross_entropy",
                                      optimizer=tessel.optim.SGD(lr=0.5, momentum=0.9), input_shapes={"x": (BATCH, 4)},
                                      devices=2, cache_dir=kernel_cache, compression="1bit")
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((BATCH, 4)).astype(np.float32) for _ in range(STEPS)]
    try:
        for x in batches[:3]:
            trainer.step({"x": x}, (x[:, 0] > 0).astype(np.int64))
        saved = trainer.residuals
        trainer.save(tmp_path / "ckpt")
        for x in batches[3:]:
            trainer.step({"x": x}, (x[:, 0] > 0).astype(np.int64))
        whole = trainer.state
    finally:
        trainer.close()
    # Each worker's own residual of the gradients' bucket: what its 1-bit messages have not delivered yet.
    assert sorted(name.split("/")[0] for name in saved) == ["0", "1"]
    assert all(np.abs(residual).max() > 0 for residual in saved.values())
    resumed = tessel.load_training(tmp_path / "ckpt")
    try:
        for name, residual in resumed.residuals.items():
            np.testing.assert_array_equal(residual, saved[name], err_msg=name)
        for x in batches[3:]:
            resumed.step({"x": x}, (x[:, 0] > 0).astype(np.int64))
        for name, value in whole.items():
            np.testing.assert_array_equal(resumed.state[name], value, err_msg=name)
    finally:
        resumed.close()


def test_compression_needs_data_parallel_training(tmp_path):
    with pytest.raises(CompileError, match="needs data-parallel training on 2 or more devices"):
        tessel.compile_training(str(write_classifier(tmp_path / "m.onnx")), loss="cross_entropy",
                                optimizer=tessel.optim.SGD(lr=0.5), input_shapes={"x": (BATCH, 4)},
                                compression="1bit")
