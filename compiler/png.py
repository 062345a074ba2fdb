"""A tiny RGB canvas written as PNG with zlib alone (the reports' charts need no plotting library)."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

Color = tuple[int, int, int]


class Canvas:
    """Pixels, rectangles and lines on a white background."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def put(self, x: int, y: int, color: Color) -> None:
        """Set one pixel (outside the canvas: ignored)."""
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x:3 * x + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill [x0, x1) × [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        for y in range(max(0, y0), min(self.height, y1)):
            if x1 > x0:
                self.rows[y][3 * x0:3 * x1] = bytes(color) * (x1 - x0)

    def save(self, path: Path) -> None:
        """Write the canvas as an 8-bit RGB PNG."""
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
                               + chunk(b"IEND", b""))
