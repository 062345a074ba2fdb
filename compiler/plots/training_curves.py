"""The training curves of a `tessel train` run: the loss per step and per epoch (training and validation) and,
for classification, the validation accuracy per epoch, from the records of RUN_DIR/log.jsonl."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from ..train_log import epoch_records, step_records
from .style import PALETTE, new_figure, save

TRAIN_COLOR, VAL_COLOR = PALETTE[0], PALETTE[1]


def write_training_curves(path: Path, records: Sequence[Mapping[str, Any]], title: str, loss_name: str) -> list[Path]:
    """Write path.png and path.svg from the log's records ("step" and "epoch" ones, see compiler/train_log.py).

    Left: the loss against the step (each step faint, the epoch means and the validation loss marked at the
    epoch's last step). Right, when the log has validation accuracy: the accuracy in % per epoch.
    Returns the written paths.
    """
    steps = [r for r in step_records(records) if r.get("loss") is not None]
    epochs = epoch_records(records)
    accuracy = [r for r in epochs if r.get("val_accuracy") is not None]
    panels = 2 if accuracy else 1
    figure = new_figure(figsize=(5.2 * panels + 0.6, 3.8))
    axes = figure.subplots(1, panels, squeeze=False)
    _loss_panel(axes[0, 0], steps, epochs, loss_name)
    if accuracy:
        _accuracy_panel(axes[0, 1], accuracy)
    figure.suptitle(title)
    figure.tight_layout()
    return save(figure, path)


def _loss_panel(ax, steps, epochs, loss_name: str) -> None:
    if steps:
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], color=TRAIN_COLOR, alpha=0.35,
                linewidth=0.8, label="training loss (per step)")
    trained = [r for r in epochs if r.get("loss") is not None]
    if trained:
        ax.plot([r["step"] for r in trained], [r["loss"] for r in trained], color=TRAIN_COLOR, marker="o",
                markersize=4, label="training loss (epoch mean)")
    validated = [r for r in epochs if r.get("val_loss") is not None]
    if validated:
        ax.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], color=VAL_COLOR, marker="s",
                markersize=4, label="validation loss")
    if not (steps or epochs):
        ax.text(0.5, 0.5, "no steps logged", transform=ax.transAxes, ha="center", va="center")
    positive = [r["loss"] for r in steps] + [r["val_loss"] for r in validated]
    if positive and min(positive) > 0 and max(positive) / min(positive) > 50:
        ax.set_yscale("log")  # a loss that falls by orders of magnitude stays readable
    ax.set_xlabel("step (batches trained)")
    ax.set_ylabel(f"loss ({loss_name})")
    ax.set_title("loss", loc="left")
    if steps or epochs:
        ax.legend(loc="upper right", framealpha=0.9)


def _accuracy_panel(ax, epochs) -> None:
    from matplotlib.ticker import MaxNLocator

    values = [100.0 * r["val_accuracy"] for r in epochs]
    ax.plot([r["epoch"] for r in epochs], values, color=VAL_COLOR, marker="s", markersize=4,
            label="validation accuracy")
    best = max(range(len(values)), key=values.__getitem__)
    right = len(values) > 1 and best >= len(values) / 2  # the label grows away from the nearer edge
    ax.annotate(f"best {values[best]:.2f} % (epoch {epochs[best]['epoch']})", xy=(epochs[best]["epoch"], values[best]),
                xytext=(-4 if right else 4, -12), textcoords="offset points", ha="right" if right else "left",
                va="top", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(max(0.0, min(values) - 5), 100.5)
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("validation accuracy", loc="left")
    ax.legend(loc="lower right", framealpha=0.9)
