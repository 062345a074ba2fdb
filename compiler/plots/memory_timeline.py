"""The memory timeline: live activation bytes per step, one panel per worker, with the arena size, the lower
bound and the peak marked."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from .style import MIB, pyplot, save

PANEL_HEIGHT = 2.6  # inches per worker


def byte_unit(largest: int) -> tuple[str, int]:
    """MiB for charts that reach a mebibyte, else KiB (tiny graphs would read 0.00 MiB)."""
    return ("MiB", MIB) if largest >= MIB else ("KiB", 1024)


def write_memory_timeline(path: Path, workers: Sequence[Mapping[str, Any]], title: str) -> list[Path]:
    """Write path.png and path.svg from the workers' memory reports (compiler/memory.memory_report), in worker order.

    Each report gives `timeline` (live bytes per step), `arena_bytes`, `bound_bytes` (most bytes live at once)
    and `peak` ({step, node, op}). Returns the written paths.
    """
    plt = pyplot()
    unit, scale = byte_unit(max((max(w["arena_bytes"], w["bound_bytes"]) for w in workers), default=0))
    figure, axes = plt.subplots(len(workers), 1, figsize=(10, 0.8 + PANEL_HEIGHT * len(workers)), squeeze=False)
    for index, (ax, report) in enumerate(zip(axes[:, 0], workers)):
        _panel(ax, report, f"device {index}" if len(workers) > 1 else "", unit, scale)
    axes[-1, 0].set_xlabel("step (instruction in execution order)")
    figure.suptitle(title)
    figure.tight_layout()
    return save(figure, path)


def _panel(ax, report: Mapping[str, Any], name: str, unit: str, scale: int) -> None:
    """One worker: the live bytes as a filled step line, arena and bound as labelled lines, the peak annotated."""
    from matplotlib.ticker import MaxNLocator

    live = [b / scale for b in report["timeline"]]
    arena, bound = report["arena_bytes"] / scale, report["bound_bytes"] / scale
    if live:
        _live_bytes(ax, live, report["peak"], unit)
    else:
        ax.text(0.5, 0.5, "no steps on this worker", transform=ax.transAxes, ha="center", va="center")
    ax.axhline(arena, color="#e15759", linestyle="--", linewidth=1.2, label=f"arena {arena:.2f} {unit}")
    ax.axhline(bound, color="#59a14f", linestyle=":", linewidth=1.4, label=f"lower bound {bound:.2f} {unit}")
    ax.set_xlim(0, max(len(live), 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(arena, bound, max(live, default=0)) * 1.25 or 1)
    ax.set_ylabel(f"live bytes ({unit})")
    if name:
        ax.set_title(name, loc="left")
    ax.legend(loc="upper left", ncols=3, framealpha=0.9)


def _live_bytes(ax, live: list[float], peak: Mapping[str, Any], unit: str) -> None:
    """The live bytes per step (step t spans [t, t + 1)) and the peak step's marker and label."""
    edges, heights = range(len(live) + 1), live + live[-1:]  # the last step's right edge repeats its height
    ax.fill_between(edges, heights, step="post", color="#a0cbe8", alpha=0.8, label="live activations")
    ax.step(edges, heights, where="post", color="#4e79a7", linewidth=0.8)
    step = peak["step"]
    ax.plot([step + 0.5], [live[step]], marker="v", color="#e15759", markersize=7)
    left = step > len(live) / 2  # the label goes to the side with more room, so it never runs off the axes
    ax.annotate(f"peak {live[step]:.2f} {unit} at step {step}\n{peak['node']} ({peak['op']})",
                xy=(step + 0.5, live[step]), xytext=(-12 if left else 12, -6), textcoords="offset points",
                ha="right" if left else "left", va="top", fontsize=8,
                bbox={"boxstyle": "round,pad=0.25", "facecolor": "white", "alpha": 0.85, "edgecolor": "#999999"})
