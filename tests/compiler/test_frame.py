"""compiler/plots/frame.py: round-number ticks and their labels."""
from __future__ import annotations

from tessel.compiler.plots.frame import nice_ticks, tick_label


def test_ticks_are_round_steps_from_zero_to_the_top():
    assert nice_ticks(555, 7) == [0, 100, 200, 300, 400, 500]
    assert nice_ticks(4.125, 7) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert nice_ticks(1.0, 7) == [0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]
    assert nice_ticks(26, 10, integer=True) == [0, 5, 10, 15, 20, 25]
    assert nice_ticks(1, 10, integer=True) == [0, 1]  # never a fractional step on an integer axis
    assert nice_ticks(0, 7) == [0.0]


def test_labels_carry_the_decimals_the_step_needs():
    ticks = nice_ticks(1.0, 7)
    assert [tick_label(v, ticks) for v in ticks] == ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]
    assert tick_label(2.5, [0, 2.5, 5]) == "2.5" and tick_label(100, [0, 100]) == "100"
