"""compiler/train_data.py: batches that depend only on (seed, epoch), padded evaluation chunks."""
from __future__ import annotations

import numpy as np

from tessel.compiler.train_data import Dataset, as_step_labels, feeds, model_inputs, model_outputs
from tests.compiler.train_fixtures import write_classifier


def _dataset(n=10):
    return Dataset({"x": np.arange(n, dtype=np.float32).reshape(n, 1), "labels": np.arange(n)}, n)


def test_batches_are_full_shuffled_and_drawn_from_seed_and_epoch():
    data = _dataset()
    first = [b["labels"].tolist() for b in data.batches(3, seed=0, epoch=1)]
    assert len(first) == 3 and all(len(b) == 3 for b in first)  # 10 // 3 full batches, the rest left out
    assert len({x for b in first for x in b}) == 9
    assert first == [b["labels"].tolist() for b in data.batches(3, seed=0, epoch=1)]
    assert first != [b["labels"].tolist() for b in data.batches(3, seed=0, epoch=2)]
    assert first != [b["labels"].tolist() for b in data.batches(3, seed=1, epoch=1)]
    batch = next(data.batches(3, 0, 1))
    assert np.array_equal(batch["x"][:, 0], batch["labels"])  # rows stay together


def test_chunks_cover_every_sample_in_order_and_pad_the_last():
    chunks = list(_dataset(7).chunks(3))
    assert [valid for _, valid in chunks] == [3, 3, 1]
    last, _ = chunks[-1]
    assert last["labels"].tolist() == [6, 0, 0] and last["x"].shape == (3, 1)


def test_model_inputs_and_outputs_are_read_from_the_onnx_file(tmp_path):
    path = write_classifier(tmp_path / "clf.onnx")
    (spec,) = model_inputs(path)
    assert (spec.name, spec.dtype, spec.sample_shape) == ("x", np.float32, (4,))
    assert model_outputs(path) == {"logits": (None, 3)}


def test_step_feeds_and_labels():
    batch = {"x": np.zeros((2, 1), np.float32), "labels": np.array([1, 2], np.int32)}
    assert list(feeds(batch)) == ["x"]
    assert as_step_labels(batch["labels"]).dtype == np.int64
    assert as_step_labels(np.zeros(2)).dtype == np.float32
