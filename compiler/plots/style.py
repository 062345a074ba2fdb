"""What the charts share: matplotlib loaded on first use (no pyplot), one palette, one way to write PNG + SVG."""
from __future__ import annotations

from pathlib import Path
from typing import Any

# Colours by op kind (the Tableau 10 palette, then its light variants); ops of one kind share a colour.
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac", "#a0cbe8", "#ffbe7d", "#8cd17d", "#ff9d9a", "#86bcb6", "#f1ce63", "#d4a6c8", "#d7b5a6")
OTHER_COLOR = "#d9d9d9"  # op kinds past the palette's length: one grey, named "other" in the legend
TRANSFER_COLOR = "#222222"
MEASURED_COLOR, ESTIMATED_COLOR = "#4e79a7", "#f28e2b"
# Micro-batch k's bars carry HATCHES[k % len(HATCHES)]: colour tells the op, hatch the micro-batch.
HATCHES = ("", "///", "...", "xxx", "\\\\\\", "ooo")
DPI = 110
MIB = 1024 * 1024

_configured = False


def new_figure(**kwargs: Any):
    """A matplotlib Figure (kwargs: Figure's, e.g. figsize), matplotlib imported on first use so that `import
    tessel` stays light. No pyplot: its figure manager and backend machinery only cost time for files."""
    global _configured
    import matplotlib
    from matplotlib.figure import Figure

    if not _configured:
        matplotlib.rcParams.update({
            "svg.fonttype": "none",  # text stays text in the SVG (searchable, and what the tests read)
            "font.size": 9,
            "axes.titlesize": 10,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "legend.fontsize": 8,
            "svg.hashsalt": "tessel",  # the same chart gives the same SVG bytes
        })
        _configured = True
    return Figure(**kwargs)


def op_colors(kinds_by_time: dict[str, float]) -> dict[str, str]:
    """A colour per op kind, the kinds taking the most time first; the ones past the palette share OTHER_COLOR."""
    ranked = sorted(kinds_by_time, key=lambda kind: (-kinds_by_time[kind], kind))
    return {kind: PALETTE[i] if i < len(PALETTE) else OTHER_COLOR for i, kind in enumerate(ranked)}


def source_label(estimated: int, total: int) -> str:
    """'measured', 'estimated' or 'k of n estimated': where a chart's numbers came from."""
    if total == 0 or estimated == 0:
        return "measured"
    if estimated == total:
        return "estimated"
    return f"{estimated} of {total} estimated"


def save(figure: Any, path: Path) -> list[Path]:
    """Write `figure` as path.png and path.svg (any suffix of `path` is replaced); returns both paths."""
    path = Path(path)
    written = []
    for suffix in (".png", ".svg"):
        target = path.with_suffix(suffix)
        figure.savefig(target, dpi=DPI, metadata={"Date": None} if suffix == ".svg" else None)
        written.append(target)
    return written
