"""What every chart test asks of a written chart: a PNG that decodes to a sensible size and an SVG whose text
(kept as text: svg.fonttype 'none') names what the chart must show."""
from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Iterable


def assert_chart(paths: list[Path], texts: Iterable[str], min_width: int = 600, min_height: int = 200) -> str:
    """Check the .png and .svg in `paths`; returns the SVG's text."""
    from matplotlib.image import imread

    png, svg = sorted(paths, key=lambda p: p.suffix)
    assert (png.suffix, svg.suffix) == (".png", ".svg")
    height, width = imread(png).shape[:2]
    assert width >= min_width and height >= min_height, (width, height)
    document = svg.read_text()
    missing = [text for text in texts if escape(text, quote=False) not in document]
    assert not missing, f"not in {svg.name}: {missing}"
    return document
