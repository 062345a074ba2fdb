"""compiler/train_progress.py: a bar on a terminal, one line per epoch always."""
from __future__ import annotations

import io

from tessel.compiler.progress import NORMAL, logging_to_stderr
from tessel.compiler.train_progress import TrainProgress, epoch_line

RECORD = {"epoch": 2, "loss": 0.25, "val_loss": 0.5, "val_accuracy": 0.975, "samples_per_s": 12345.6, "seconds": 1.25}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_epoch_line():
    assert epoch_line(RECORD, 10) == ("epoch 2/10: loss 0.2500, val loss 0.5000, val accuracy 97.50%, "
                                      "12,346 samples/s, 1.2 s")
    assert epoch_line({**RECORD, "loss": None, "val_accuracy": None}, 3).startswith("epoch 2/3: loss nan, val loss")


def test_a_terminal_gets_a_bar_with_loss_and_samples_per_second(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with logging_to_stderr(NORMAL):
        progress = TrainProgress(epochs=3, steps_per_epoch=4, batch=8)
        for index in range(1, 5):
            progress.step(1, index, 0.5, 0.001)
        progress.epoch({**RECORD, "epoch": 1})
    text = terminal.getvalue()
    assert "\repoch 1/3 [" in text and "4/4 loss 0.5000 8,000 samples/s" in text
    assert text.endswith("epoch 1/3: loss 0.2500, val loss 0.5000, val accuracy 97.50%, 12,346 samples/s, 1.2 s\n")


def test_without_a_terminal_only_the_epoch_lines(monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    with logging_to_stderr(NORMAL):
        progress = TrainProgress(epochs=1, steps_per_epoch=2, batch=8)
        progress.step(1, 1, 0.5, 0.001)
        progress.epoch({**RECORD, "epoch": 1})
    assert pipe.getvalue().count("\n") == 1 and "\r" not in pipe.getvalue()
