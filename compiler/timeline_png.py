"""A memory timeline as a PNG, written with zlib alone: live bytes per step, the arena size, the peak.

Blue area: bytes live at each step. Grey line: the arena size. Red line: the
peak step. (No plotting library: the picture is simple enough to rasterize.)
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Sequence

WIDTH, HEIGHT, MARGIN = 960, 320, 16
BACKGROUND, AREA, ARENA, PEAK, AXIS = (255, 255, 255), (70, 130, 200), (120, 120, 120), (220, 40, 40), (0, 0, 0)


def render(timeline: Sequence[int], arena_bytes: int, peak_step: int) -> list[bytearray]:
    """RGB rows of the chart."""
    rows = [bytearray(bytes(BACKGROUND) * WIDTH) for _ in range(HEIGHT)]

    def put(x: int, y: int, color) -> None:
        if 0 <= x < WIDTH and 0 <= y < HEIGHT:
            rows[y][3 * x:3 * x + 3] = bytes(color)

    plot_w, plot_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN
    top = max([arena_bytes, *timeline, 1])
    steps = max(len(timeline), 1)
    base = HEIGHT - MARGIN
    for x in range(plot_w):
        t = min(steps - 1, x * steps // plot_w)
        height = int(plot_h * (timeline[t] if timeline else 0) / top)
        for y in range(base - height, base):
            put(MARGIN + x, y, AREA)
    arena_y = base - int(plot_h * arena_bytes / top)
    for x in range(0, plot_w, 2):
        put(MARGIN + x, arena_y, ARENA)
    peak_x = MARGIN + int((peak_step + 0.5) * plot_w / steps)
    for y in range(MARGIN, base):
        put(peak_x, y, PEAK)
    for x in range(MARGIN, WIDTH - MARGIN):
        put(x, base, AXIS)
    for y in range(MARGIN, base + 1):
        put(MARGIN - 1, y, AXIS)
    return rows


def write_timeline_png(path: Path, timeline: Sequence[int], arena_bytes: int, peak_step: int) -> None:
    """Write the chart to `path`."""
    rows = render(timeline, arena_bytes, peak_step)
    raw = b"".join(b"\x00" + bytes(row) for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
