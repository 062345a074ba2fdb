"""A chart's axes on a Canvas: a plot box mapping data to pixels, with round-number ticks, grid lines, labels
and a one-row legend, laid out like the matplotlib charts (tick labels outside the box, grid inside)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .canvas import Canvas, text_width

TICK_SIZE, LABEL_SIZE, LEGEND_SIZE = 12.0, 13.0, 12.0  # font sizes, pixels
GRID_COLOR, SPINE_COLOR, TICK_LENGTH = "#e7e7e7", "#000000", 4


def nice_ticks(top: float, target: int, integer: bool = False) -> list[float]:
    """Ticks 0, s, 2s, … up to `top`, about `target` of them, s being 1, 2, 2.5 or 5 times a power of ten
    (no 2.5 when `integer`, never below 1 then)."""
    if top <= 0:
        return [0.0]
    raw = top / target
    magnitude = 10 ** math.floor(math.log10(raw))
    steps = (1, 2, 5, 10) if integer and magnitude < 10 else (1, 2, 2.5, 5, 10)
    step = next(m * magnitude for m in steps if m * magnitude >= raw)
    if integer:
        step = max(round(step), 1)
    return [i * step for i in range(int(top / step + 1e-9) + 1)]


def tick_label(value: float, ticks: list[float]) -> str:
    """`value` with as many decimals as the tick spacing needs (0, 0.5, 1.0 → '0.0', '0.5', '1.0')."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = 0
    while decimals < 6 and abs(step * 10 ** decimals - round(step * 10 ** decimals)) > 1e-6:
        decimals += 1
    return f"{value:.{decimals}f}"


def y_axis_width(ticks: list[float]) -> float:
    """Pixels left of a box that its y ticks, their labels and the axis's label take."""
    return TICK_LENGTH + 8 + max(text_width(tick_label(v, ticks), TICK_SIZE) for v in ticks) + LABEL_SIZE * 1.2 + 4


@dataclass(frozen=True)
class Frame:
    """The plot box (left, top, right, bottom in pixels) showing x in [0, x_max] and y in [0, y_max]."""

    left: float
    top: float
    right: float
    bottom: float
    x_max: float
    y_max: float

    def x(self, value: float) -> float:
        """The pixel column of data x `value`."""
        return self.left + (self.right - self.left) * value / self.x_max

    def y(self, value: float) -> float:
        """The pixel row of data y `value` (y grows upwards)."""
        return self.bottom - (self.bottom - self.top) * value / self.y_max

    def draw_axes(self, canvas: Canvas, x_ticks: list[float], y_ticks: list[float], y_label: str) -> None:
        """Grid lines at the ticks, the ticks and their labels left of and under the box, the y axis's label."""
        for value in x_ticks:
            canvas.line([(self.x(value), self.top), (self.x(value), self.bottom)], GRID_COLOR)
            canvas.line([(self.x(value), self.bottom), (self.x(value), self.bottom + TICK_LENGTH)], SPINE_COLOR)
            canvas.text(self.x(value), self.bottom + TICK_LENGTH + 2, tick_label(value, x_ticks), TICK_SIZE, "center")
        for value in y_ticks:
            canvas.line([(self.left, self.y(value)), (self.right, self.y(value))], GRID_COLOR)
            canvas.line([(self.left - TICK_LENGTH, self.y(value)), (self.left, self.y(value))], SPINE_COLOR)
            canvas.text(self.left - TICK_LENGTH - 3, self.y(value) - TICK_SIZE * 0.6, tick_label(value, y_ticks),
                        TICK_SIZE, "right")
        canvas.text(self.left - y_axis_width(y_ticks) + 4, (self.top + self.bottom) / 2, y_label, LABEL_SIZE,
                    vertical=True)

    def draw_box(self, canvas: Canvas) -> None:
        """The box's outline (drawn last, over what the box holds)."""
        canvas.rect(self.left, self.top, self.right, self.bottom, None, SPINE_COLOR, 1.0)

    def draw_legend(self, canvas: Canvas, entries: list[tuple[str, dict]]) -> None:
        """A one-row legend in the box's top-left corner: (label, handle) pairs, a handle being
        {"fill": colour} for a patch or {"color", "style", "width"} for a line."""
        pad, handle_width, gap = 6.0, 22.0, 14.0
        widths = [handle_width + 5 + text_width(label, LEGEND_SIZE) for label, _ in entries]
        x0, y0 = self.left + 6, self.top + 6
        height = LEGEND_SIZE * 1.25 + 2 * pad
        canvas.rect(x0, y0, x0 + sum(widths) + gap * (len(entries) - 1) + 2 * pad, y0 + height, "#ffffff",
                    "#cccccc", 1.0, radius=3)
        x, middle = x0 + pad, y0 + height / 2
        for (label, handle), width in zip(entries, widths):
            if "fill" in handle:
                canvas.rect(x, middle - 5, x + handle_width, middle + 5, handle["fill"], handle.get("edge"))
            else:
                canvas.line([(x, middle), (x + handle_width, middle)], handle["color"], handle["width"],
                            handle["style"])
            canvas.text(x + handle_width + 5, middle - LEGEND_SIZE * 0.6, label, LEGEND_SIZE)
            x += width + gap
