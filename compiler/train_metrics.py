"""Validation metrics of `tessel train`, on the host from the model's outputs: the loss the run trains with
(inference semantics: no dropout, BatchNorm on running statistics) and, for classification, the accuracy."""
from __future__ import annotations

import numpy as np

HOST_LOSSES = ("cross_entropy", "mse", "l1", "bce_with_logits")


def batch_loss_sum(kind: str, output: np.ndarray, labels: np.ndarray, label_smoothing: float = 0.0) -> float:
    """The sum over the batch of the per-sample loss `kind` (the mean over its elements for mse/l1/bce, as
    PyTorch's reduction='mean' divides by every element)."""
    output = output.astype(np.float64)
    if kind == "cross_entropy":
        shifted = output - output.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        picked = -np.take_along_axis(log_probs, labels.reshape(-1, 1, *log_probs.shape[2:]).astype(np.int64), axis=1)
        per_sample = picked.reshape(len(output), -1).mean(axis=1)
        if label_smoothing:
            uniform = -log_probs.mean(axis=1).reshape(len(output), -1).mean(axis=1)
            per_sample = (1 - label_smoothing) * per_sample + label_smoothing * uniform
        return float(per_sample.sum())
    target = labels.astype(np.float64).reshape(output.shape)
    if kind == "mse":
        elementwise = (output - target) ** 2
    elif kind == "l1":
        elementwise = np.abs(output - target)
    elif kind == "bce_with_logits":
        elementwise = np.maximum(output, 0) - output * target + np.log1p(np.exp(-np.abs(output)))
    else:
        raise ValueError(f"no host-side loss '{kind}'")
    return float(elementwise.reshape(len(output), -1).mean(axis=1).sum())


def correct_count(output: np.ndarray, labels: np.ndarray) -> int:
    """How many samples' largest logit (axis 1) is their label."""
    return int((output.argmax(axis=1) == labels).sum())


class ValidationTally:
    """Sums the loss and the correct answers over the validation chunks; `result()` gives the means."""

    def __init__(self, kind: str, label_smoothing: float):
        self.kind, self.label_smoothing = kind, label_smoothing
        self.loss = 0.0
        self.correct = 0
        self.samples = 0

    def add(self, output: np.ndarray, labels: np.ndarray | None, valid: int) -> None:
        """Count one chunk's first `valid` rows (the rest pad the chunk to the compiled batch). `output` is the
        model's first output, or the loss output when the model computes its own loss (then its mean stands for
        the chunk, padding included: such a model's loss cannot leave rows out)."""
        self.samples += valid
        if self.kind not in HOST_LOSSES:
            self.loss += float(np.mean(output)) * valid
            return
        output, labels = output[:valid], labels[:valid]
        self.loss += batch_loss_sum(self.kind, output, labels, self.label_smoothing)
        if self.kind == "cross_entropy":
            self.correct += correct_count(output, labels)

    def result(self) -> dict[str, float]:
        """val_loss, and val_accuracy (a fraction) for cross-entropy."""
        metrics = {"val_loss": self.loss / max(self.samples, 1)}
        if self.kind == "cross_entropy":
            metrics["val_accuracy"] = self.correct / max(self.samples, 1)
        return metrics
