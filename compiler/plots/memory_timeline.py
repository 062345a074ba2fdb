"""The memory timeline: live activation bytes per step, one panel per worker, with the arena size, the lower
bound and the peak marked. Drawn on every compile, so on a Canvas (a few milliseconds), not with matplotlib."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from .canvas import Canvas, text_width
from .frame import LABEL_SIZE, Frame, nice_ticks, y_axis_width
from .style import DPI, MIB

PANEL_HEIGHT = 2.6  # inches per worker
WIDTH = 10  # inches
TITLE_SIZE, NOTE_SIZE = 15.0, 12.0  # font sizes, pixels
TOP, BOTTOM, RIGHT = 34, 30, 18  # pixels above the first panel (title), below the last (x label), right of all
PANEL_NAME, PANEL_TICKS = 20, 22  # pixels a panel keeps above its box (its name) and below (its tick labels)
LIVE_FILL, LIVE_LINE = "#b3d5ed", "#4e79a7"  # the live bytes (#a0cbe8 at 80 % over white) and their outline
ARENA, BOUND, PEAK = "#e15759", "#59a14f", "#e15759"


def byte_unit(largest: int) -> tuple[str, int]:
    """MiB for charts that reach a mebibyte, else KiB (tiny graphs would read 0.00 MiB)."""
    return ("MiB", MIB) if largest >= MIB else ("KiB", 1024)


def write_memory_timeline(path: Path, workers: Sequence[Mapping[str, Any]], title: str) -> list[Path]:
    """Write path.png and path.svg from the workers' memory reports (compiler/memory.memory_report), in worker order.

    Each report gives `timeline` (live bytes per step), `arena_bytes`, `bound_bytes` (most bytes live at once)
    and `peak` ({step, node, op}). Returns the written paths.
    """
    unit, scale = byte_unit(max((max(w["arena_bytes"], w["bound_bytes"]) for w in workers), default=0))
    width, height = WIDTH * DPI, round((0.8 + PANEL_HEIGHT * len(workers)) * DPI)
    canvas = Canvas(width, height)
    canvas.text(width / 2, 8, title, TITLE_SIZE, "center")
    panel = (height - TOP - BOTTOM) / max(len(workers), 1)
    y_ticks = [nice_ticks(_y_max(report, scale), 7) for report in workers]
    # One left edge for every panel (as wide as the widest tick label needs), so that their step axes line up.
    left = 10 + max((y_axis_width(ticks) for ticks in y_ticks), default=0)
    for index, (report, ticks) in enumerate(zip(workers, y_ticks)):
        top = TOP + index * panel
        frame = Frame(left, top + PANEL_NAME, width - RIGHT, top + panel - PANEL_TICKS, max(len(report["timeline"]), 1),
                      _y_max(report, scale))
        frame.draw_axes(canvas, nice_ticks(frame.x_max, 10, integer=True), ticks, f"live bytes ({unit})")
        if len(workers) > 1:
            canvas.text(frame.left, top + 2, f"device {index}", LABEL_SIZE)
        _panel(canvas, frame, report, unit, scale)
    canvas.text(width / 2, height - BOTTOM + 4, "step (instruction in execution order)", LABEL_SIZE, "center")
    return canvas.save(path)


def _y_max(report: Mapping[str, Any], scale: int) -> float:
    """The top of a worker's byte axis: a quarter above its highest line, leaving the legend room."""
    return max(report["arena_bytes"], report["bound_bytes"], max(report["timeline"], default=0)) / scale * 1.25 or 1


def _panel(canvas: Canvas, frame: Frame, report: Mapping[str, Any], unit: str, scale: int) -> None:
    """One worker's box: the live bytes as a filled step line, arena and bound as labelled lines, the peak
    annotated."""
    live = [b / scale for b in report["timeline"]]
    arena, bound = report["arena_bytes"] / scale, report["bound_bytes"] / scale
    entries = []
    if live:
        _live_bytes(canvas, frame, live)
        entries.append(("live activations", {"fill": LIVE_FILL, "edge": LIVE_LINE}))
    else:
        canvas.text((frame.left + frame.right) / 2, (frame.top + frame.bottom) / 2 - LABEL_SIZE / 2,
                    "no steps on this worker", LABEL_SIZE, "center")
    canvas.line([(frame.left, frame.y(arena)), (frame.right, frame.y(arena))], ARENA, 1.8, "dashed")
    canvas.line([(frame.left, frame.y(bound)), (frame.right, frame.y(bound))], BOUND, 2.1, "dotted")
    entries += [(f"arena {arena:.2f} {unit}", {"color": ARENA, "width": 1.8, "style": "dashed"}),
                (f"lower bound {bound:.2f} {unit}", {"color": BOUND, "width": 2.1, "style": "dotted"})]
    if live:
        _peak(canvas, frame, live, report["peak"], unit)
    frame.draw_box(canvas)
    frame.draw_legend(canvas, entries)


def _live_bytes(canvas: Canvas, frame: Frame, live: list[float]) -> None:
    """The live bytes per step (step t spans [t, t + 1)) as one filled step polygon and its outline."""
    outline = []
    for step, value in enumerate(live):
        outline += [(frame.x(step), frame.y(value)), (frame.x(step + 1), frame.y(value))]
    canvas.polygon([(frame.x(0), frame.y(0))] + outline + [(frame.x(len(live)), frame.y(0))], LIVE_FILL)
    canvas.line(outline, LIVE_LINE, 1.2)


def _peak(canvas: Canvas, frame: Frame, live: list[float], peak: Mapping[str, Any], unit: str) -> None:
    """A marker on the peak step and its label (bytes, step, node, op) on the side with more room."""
    step = peak["step"]
    x, y = frame.x(step + 0.5), frame.y(live[step])
    canvas.polygon([(x - 5.5, y - 9), (x + 5.5, y - 9), (x, y)], PEAK)
    label = f"peak {live[step]:.2f} {unit} at step {step}\n{peak['node']} ({peak['op']})"
    left = step > len(live) / 2  # the label goes to the side with more room, so it never runs off the box
    pad, box_width = 4.0, text_width(label, NOTE_SIZE)
    x0 = x - 18 - box_width if left else x + 18
    y0 = y + 9
    canvas.rect(x0 - pad, y0 - pad, x0 + box_width + pad, y0 + 2 * NOTE_SIZE * 1.25 + pad, "#ffffff", "#999999",
                1.0, radius=4)
    canvas.text(x0, y0, label, NOTE_SIZE)
