"""A small drawing surface for charts drawn on every compile: shapes and text in pixels, written as one PNG
(Pillow) and one SVG (by hand, text kept as text) with the same content.

matplotlib takes about half a second per chart, whatever its size, for its text layout and two renders; a
compile must not pay that. The surface knows rectangles, polygons, lines (solid, dashed, dotted) and text
(left/centre/right aligned, optionally rotated by 90°), measured with the font both files name (DejaVu Sans,
the font of the matplotlib charts, read from matplotlib's data folder without importing matplotlib).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

FONT_FAMILY = "DejaVu Sans, Bitstream Vera Sans, Arial, sans-serif"
DASHES = {"solid": None, "dashed": (6, 3), "dotted": (1.5, 2.5)}  # (on, off) in multiples of the line width
ANCHORS = {"left": "start", "center": "middle", "right": "end"}


@lru_cache(maxsize=None)
def font(size: float):
    """DejaVu Sans at `size` pixels (Pillow's FreeType font), loaded once per size."""
    from PIL import ImageFont

    package = importlib.util.find_spec("matplotlib").submodule_search_locations[0]
    return ImageFont.truetype(str(Path(package) / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"), size)


def text_width(text: str, size: float) -> float:
    """Pixels `text` takes at font size `size` (its widest line)."""
    return max(font(size).getlength(line) for line in text.split("\n"))


@dataclass
class Canvas:
    """Shapes and text on a white `width` × `height` pixel page, in drawing order; `save` writes both files."""

    width: int
    height: int
    _shapes: list[tuple] = field(default_factory=list)

    def rect(self, x0: float, y0: float, x1: float, y1: float, fill: str | None, stroke: str | None = None,
             line_width: float = 1.0, radius: float = 0.0) -> None:
        """An axis-aligned rectangle from (x0, y0) to (x1, y1), optionally with rounded corners."""
        self._shapes.append(("rect", (min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)), fill, stroke,
                             line_width, radius))

    def polygon(self, points: list[tuple[float, float]], fill: str) -> None:
        """A closed polygon filled with `fill`."""
        self._shapes.append(("polygon", points, fill))

    def line(self, points: list[tuple[float, float]], color: str, width: float = 1.0, style: str = "solid") -> None:
        """An open polyline; `style` is solid, dashed or dotted (dashes only on horizontal and vertical runs)."""
        self._shapes.append(("line", points, color, width, style))

    def text(self, x: float, y: float, text: str, size: float = 12.0, align: str = "left", color: str = "#000000",
             vertical: bool = False) -> None:
        """`text` (lines split on newline) whose first line's top sits at y, aligned at x; `vertical` turns it
        90° counter-clockwise about (x, y), reading bottom to top, centred on y."""
        self._shapes.append(("text", x, y, text, size, align, color, vertical))

    def save(self, path: Path) -> list[Path]:
        """Write path.png and path.svg (any suffix of `path` is replaced); returns both paths."""
        path = Path(path)
        png, svg = path.with_suffix(".png"), path.with_suffix(".svg")
        self._png(png)
        svg.write_text(self._svg())
        return [png, svg]

    def _png(self, path: Path) -> None:
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.width, self.height), "white")
        draw = ImageDraw.Draw(image)
        for shape in self._shapes:
            kind = shape[0]
            if kind == "rect":
                _, box, fill, stroke, width, radius = shape
                draw.rounded_rectangle(box, radius=radius, fill=fill, outline=stroke,
                                       width=round(width) if stroke else 0)
            elif kind == "polygon":
                draw.polygon(shape[1], fill=shape[2])
            elif kind == "line":
                _, points, color, width, style = shape
                for segment in _dashed(points, style, width):
                    draw.line(segment, fill=color, width=max(round(width), 1))
            else:
                _png_text(image, draw, *shape[1:])
        image.save(path, compress_level=1)  # zlib level 1: a quarter of the default level's time, a few KiB more

    def _svg(self) -> str:
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
               f'viewBox="0 0 {self.width} {self.height}" font-family={quoteattr(FONT_FAMILY)}>',
               f'<rect width="{self.width}" height="{self.height}" fill="#ffffff"/>']
        for shape in self._shapes:
            kind = shape[0]
            if kind == "rect":
                _, (x0, y0, x1, y1), fill, stroke, width, radius = shape
                out.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" height="{y1 - y0:.1f}" rx="{radius}" '
                           f'fill="{fill or "none"}"' + (f' stroke="{stroke}" stroke-width="{width}"' if stroke else "")
                           + "/>")
            elif kind == "polygon":
                out.append(f'<polygon points="{_points(shape[1])}" fill="{shape[2]}"/>')
            elif kind == "line":
                _, points, color, width, style = shape
                dash = DASHES[style]
                out.append(f'<polyline points="{_points(points)}" fill="none" stroke="{color}" stroke-width="{width}"'
                           + (f' stroke-dasharray="{dash[0] * width:g} {dash[1] * width:g}"' if dash else "") + "/>")
            else:
                out.extend(_svg_text(*shape[1:]))
        out.append("</svg>")
        return "\n".join(out) + "\n"


def _points(points: list[tuple[float, float]]) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


def _dashed(points: list[tuple[float, float]], style: str, width: float) -> list[list[tuple[float, float]]]:
    """The polyline as Pillow draws it: whole for solid, else cut into dashes along each straight run."""
    dash = DASHES[style]
    if dash is None:
        return [points]
    on, off = dash[0] * width, dash[1] * width
    segments = []
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        length = abs(x1 - x0) + abs(y1 - y0)  # runs are horizontal or vertical
        dx, dy = ((x1 - x0) / length, (y1 - y0) / length) if length else (0.0, 0.0)
        start = 0.0
        while start < length:
            end = min(start + on, length)
            segments.append([(x0 + dx * start, y0 + dy * start), (x0 + dx * end, y0 + dy * end)])
            start = end + off
    return segments


def _line_height(size: float) -> float:
    return size * 1.25


def _png_text(image, draw, x, y, text, size, align, color, vertical) -> None:
    """Pillow's text: anchored at its first line's top ("a" anchors put the ascender line at y)."""
    face = font(size)
    anchor = {"left": "la", "center": "ma", "right": "ra"}[align]
    if not vertical:
        for i, line in enumerate(text.split("\n")):
            draw.text((x, y + i * _line_height(size)), line, fill=color, font=face, anchor=anchor)
        return
    from PIL import Image, ImageDraw

    width, height = round(text_width(text, size)) + 2, round(_line_height(size)) + 2
    strip = Image.new("L", (width, height), 0)
    ImageDraw.Draw(strip).text((1, 1), text, fill=255, font=face, anchor="la")
    turned = strip.rotate(90, expand=True)
    image.paste(color, (round(x), round(y - width / 2)), turned)


def _svg_text(x, y, text, size, align, color, vertical) -> list[str]:
    """One <text> per line; SVG places text by its baseline, so y moves down by the font's ascent."""
    ascent = font(size).getmetrics()[0]
    if vertical:
        return [f'<text x="{x + ascent:.1f}" y="{y:.1f}" font-size="{size}" fill="{color}" text-anchor="middle" '
                f'transform="rotate(-90 {x + ascent:.1f} {y:.1f})">{escape(text)}</text>']
    return [f'<text x="{x:.1f}" y="{y + ascent + i * _line_height(size):.1f}" font-size="{size}" fill="{color}" '
            f'text-anchor="{ANCHORS[align]}">{escape(line)}</text>'
            for i, line in enumerate(text.split("\n"))]
