"""compiler/plots/canvas.py: one drawing written as a PNG and an SVG with the same content."""
from __future__ import annotations

import xml.etree.ElementTree as ElementTree

from tessel.compiler.plots.canvas import Canvas, text_width


def test_shapes_and_text_go_to_both_files(tmp_path):
    canvas = Canvas(200, 100)
    canvas.rect(10, 10, 190, 90, "#ffffff", "#000000", radius=3)
    canvas.polygon([(20, 80), (60, 30), (100, 80)], "#4e79a7")
    canvas.line([(10, 50), (190, 50)], "#e15759", 2.0, "dashed")
    canvas.text(100, 20, "a < b & c\nsecond line", 12, "center")
    canvas.text(5, 50, "bytes", 12, vertical=True)
    png, svg = canvas.save(tmp_path / "chart.anything")
    assert (png.name, svg.name) == ("chart.png", "chart.svg")
    from PIL import Image

    with Image.open(png) as image:
        assert image.size == (200, 100)
        pixels = image.convert("RGB")
        assert pixels.getpixel((60, 70)) == (0x4e, 0x79, 0xa7)  # inside the polygon
        assert pixels.getpixel((12, 50)) == (0xe1, 0x57, 0x59) and pixels.getpixel((25, 50)) != (0xe1, 0x57, 0x59)  # 12 px dash, 6 px gap
    root = ElementTree.parse(svg).getroot()
    texts = [element.text for element in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts == ["a < b & c", "second line", "bytes"]
    dashed = [e for e in root.iter("{http://www.w3.org/2000/svg}polyline") if e.get("stroke-dasharray")]
    assert [e.get("stroke-dasharray") for e in dashed] == ["12 6"]


def test_text_width_is_the_widest_line():
    assert text_width("ab\nabcd", 12) == text_width("abcd", 12) > text_width("ab", 12) > 0
