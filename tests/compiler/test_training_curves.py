"""compiler/plots/training_curves.py on synthetic run logs."""
from __future__ import annotations

from tessel.compiler.plots.training_curves import write_training_curves
from tests.compiler.chart_checks import assert_chart


def _log(epochs=3, steps=4, val=True):
    records = []
    for epoch in range(1, epochs + 1):
        for index in range(1, steps + 1):
            step = (epoch - 1) * steps + index
            records.append({"kind": "step", "epoch": epoch, "step": step, "loss": 2.0 / step, "lr": 0.1})
        record = {"kind": "epoch", "epoch": epoch, "step": epoch * steps, "loss": 1.5 / epoch}
        if val:
            record.update(val_loss=1.6 / epoch, val_accuracy=0.8 + 0.05 * epoch)
        records.append(record)
    return records


def test_loss_and_accuracy_panels_with_axes_units_and_legend(tmp_path):
    paths = write_training_curves(tmp_path / "training_curves", _log(), "cnn.onnx: training", "cross_entropy")
    assert_chart(paths, ["cnn.onnx: training", "loss (cross_entropy)", "step (batches trained)",
                         "training loss (per step)", "training loss (epoch mean)", "validation loss",
                         "accuracy (%)", "epoch", "validation accuracy", "best 95.00 % (epoch 3)"])


def test_without_validation_only_the_loss_panel(tmp_path):
    svg = assert_chart(write_training_curves(tmp_path / "c", _log(val=False), "mlp", "mse"), ["loss (mse)"])
    assert "accuracy (%)" not in svg and "validation loss" not in svg


def test_an_empty_log_still_draws(tmp_path):
    assert_chart(write_training_curves(tmp_path / "c", [], "mlp", "mse"), ["no steps logged"], min_width=400)
