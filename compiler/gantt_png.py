"""The placement's Gantt chart: one lane per device, one bar per node over its predicted time."""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Mapping

from .png import Canvas

WIDTH, LANE, GAP, MARGIN = 1200, 36, 8, 16
AXIS = (0, 0, 0)


def _color(op: str) -> tuple[int, int, int]:
    """A stable, not too light color per op type."""
    h = zlib.crc32(op.encode())
    return (40 + h % 170, 40 + (h >> 8) % 170, 40 + (h >> 16) % 170)


def write_gantt_png(path: Path, placement: Mapping[str, Any]) -> None:
    """Write the chart of placement.json's `nodes` (device, start, finish, op) to `path`.

    A node on "all" devices (data placement) is drawn in every lane.
    """
    devices = placement["devices"]
    nodes = placement["nodes"].values()
    end = max((n["finish_s"] for n in nodes), default=0.0) or 1.0
    canvas = Canvas(WIDTH, 2 * MARGIN + devices * (LANE + GAP))
    plot_w = WIDTH - 2 * MARGIN
    for node in nodes:
        x0 = MARGIN + int(plot_w * node["start_s"] / end)
        x1 = max(x0 + 1, MARGIN + int(plot_w * node["finish_s"] / end))
        lanes = range(devices) if node["device"] == "all" else [node["device"]]
        for lane in lanes:
            top = MARGIN + lane * (LANE + GAP)
            canvas.rect(x0, top, x1, top + LANE, _color(node["op"]))
    canvas.rect(MARGIN, canvas.height - MARGIN, WIDTH - MARGIN, canvas.height - MARGIN + 1, AXIS)
    canvas.save(path)
