"""What `tessel train` shows while it trains: on a terminal a progress bar per epoch (step, loss, samples/s);
one line per epoch in any case (stderr, through the `tessel` logger, so -q silences both)."""
from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import Any, Mapping

_log = logging.getLogger("tessel.train")

BAR_WIDTH = 24
REDRAW_S = 0.1  # a fast step loop redraws at most ten times a second
RATE_WINDOW = 20  # steps the bar's samples/s is averaged over


class TrainProgress:
    """Draws the bar (when stderr is a terminal and progress is wanted) and writes the epoch lines."""

    def __init__(self, epochs: int, steps_per_epoch: int, batch: int):
        self.epochs, self.steps_per_epoch, self.batch = epochs, steps_per_epoch, batch
        self.draw = sys.stderr.isatty() and _log.isEnabledFor(logging.INFO)
        self._times: deque[float] = deque(maxlen=RATE_WINDOW)
        self._drawn_at = 0.0

    def step(self, epoch: int, index: int, loss: float, seconds: float) -> None:
        """Step `index` (1-based) of `epoch` took `seconds` and gave `loss`."""
        self._times.append(seconds)
        now = time.monotonic()
        if not self.draw or (now - self._drawn_at < REDRAW_S and index < self.steps_per_epoch):
            return
        self._drawn_at = now
        filled = BAR_WIDTH * index // self.steps_per_epoch
        rate = self.batch * len(self._times) / max(sum(self._times), 1e-12)
        sys.stderr.write(f"\repoch {epoch}/{self.epochs} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                         f"{index}/{self.steps_per_epoch} loss {loss:.4f} {rate:,.0f} samples/s\x1b[K")
        sys.stderr.flush()

    def epoch(self, record: Mapping[str, Any]) -> None:
        """The epoch's line (after the bar, which it replaces on a terminal)."""
        if self.draw:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        _log.info("%s", epoch_line(record, self.epochs))


def epoch_line(record: Mapping[str, Any], epochs: int) -> str:
    """'epoch 3/10: loss 0.1234, val loss 0.2345, val accuracy 97.50%, 5,120 samples/s, 1.2 s'."""
    parts = [f"loss {_number(record.get('loss'))}"]
    if "val_loss" in record:
        parts.append(f"val loss {_number(record['val_loss'])}")
    if record.get("val_accuracy") is not None:
        parts.append(f"val accuracy {100 * record['val_accuracy']:.2f}%")
    parts.append(f"{record['samples_per_s']:,.0f} samples/s")
    parts.append(f"{record['seconds']:.1f} s")
    return f"epoch {record['epoch']}/{epochs}: " + ", ".join(parts)


def _number(value) -> str:
    return "nan" if value is None else f"{value:.4f}"
