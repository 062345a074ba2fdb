"""The memory timeline chart: live bytes per step (blue), the arena size (grey), the peak step (red)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .png import Canvas

WIDTH, HEIGHT, MARGIN = 960, 320, 16
AREA, ARENA, PEAK, AXIS = (70, 130, 200), (120, 120, 120), (220, 40, 40), (0, 0, 0)


def write_timeline_png(path: Path, timeline: Sequence[int], arena_bytes: int, peak_step: int) -> None:
    """Write the chart to `path`."""
    canvas = Canvas(WIDTH, HEIGHT)
    plot_w, plot_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN
    top = max([arena_bytes, *timeline, 1])
    steps = max(len(timeline), 1)
    base = HEIGHT - MARGIN
    for x in range(plot_w):
        t = min(steps - 1, x * steps // plot_w)
        height = int(plot_h * (timeline[t] if timeline else 0) / top)
        canvas.rect(MARGIN + x, base - height, MARGIN + x + 1, base, AREA)
    arena_y = base - int(plot_h * arena_bytes / top)
    for x in range(0, plot_w, 2):
        canvas.put(MARGIN + x, arena_y, ARENA)
    canvas.rect(MARGIN + int((peak_step + 0.5) * plot_w / steps), MARGIN,
                MARGIN + int((peak_step + 0.5) * plot_w / steps) + 1, base, PEAK)
    canvas.rect(MARGIN, base, WIDTH - MARGIN, base + 1, AXIS)
    canvas.rect(MARGIN - 1, MARGIN, MARGIN, base + 1, AXIS)
    canvas.save(path)
