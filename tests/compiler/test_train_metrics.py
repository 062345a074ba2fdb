"""compiler/train_metrics.py: the host-side validation losses equal PyTorch's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

from tessel.compiler.train_metrics import ValidationTally, batch_loss_sum

RNG = np.random.default_rng(0)
LOGITS = RNG.standard_normal((6, 5)).astype(np.float32)
CLASSES = RNG.integers(0, 5, 6)
TARGETS = RNG.random((6, 5)).astype(np.float32)


@pytest.mark.parametrize("kind, labels, reference", [
    ("cross_entropy", CLASSES, lambda o, t: tf.cross_entropy(o, t)),
    ("mse", TARGETS, tf.mse_loss),
    ("l1", TARGETS, tf.l1_loss),
    ("bce_with_logits", TARGETS, tf.binary_cross_entropy_with_logits),
])
def test_mean_of_the_batch_loss_equals_pytorch(kind, labels, reference):
    mean = batch_loss_sum(kind, LOGITS, labels) / len(LOGITS)
    assert mean == pytest.approx(float(reference(torch.from_numpy(LOGITS), torch.from_numpy(labels))), rel=1e-5)


def test_label_smoothing_equals_pytorch():
    got = batch_loss_sum("cross_entropy", LOGITS, CLASSES, 0.1) / len(LOGITS)
    want = tf.cross_entropy(torch.from_numpy(LOGITS), torch.from_numpy(CLASSES), label_smoothing=0.1)
    assert got == pytest.approx(float(want), rel=1e-5)


def test_the_tally_counts_only_the_valid_rows_of_a_padded_chunk():
    tally = ValidationTally("cross_entropy", 0.0)
    tally.add(LOGITS[:4], CLASSES[:4], 4)
    tally.add(np.concatenate([LOGITS[4:], np.zeros((2, 5), np.float32)]), np.concatenate([CLASSES[4:], [0, 0]]), 2)
    result = tally.result()
    want = float(tf.cross_entropy(torch.from_numpy(LOGITS), torch.from_numpy(CLASSES)))
    assert result["val_loss"] == pytest.approx(want, rel=1e-5)
    assert result["val_accuracy"] == pytest.approx(float((LOGITS.argmax(1) == CLASSES).mean()))
